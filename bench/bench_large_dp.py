"""Benchmark: what the DP large models train with costs at the ci profile, on 4 ranks and on 8.

Run as ``.venv/bin/python bench/bench_large_dp.py``. Each property of properties/large_dp.py
searches under the ci profile (its capped examples and its cover cases) against the shipped
baseline of torch 2.13.0, as the gate runs it, on a pool of 4 ranks and then of 8 (the 2 x 2 x 2
mesh, every dimension real). It prints each search's seconds, the ratio 8 ranks / 4, and what
the whole ci run would take with world size 8 added, from the ci budget's share the 4-rank
searches take now: whether a world-8 search fits in ci's 5 minutes (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

from tpdp_verify.properties.large_dp import (
    large_dp_checkpoint_resumes,
    large_dp_state_dict_like_unsharded,
    large_dp_trains_like_one_device,
    large_dp_trains_like_plain_dp,
)
from tpdp_verify.ranks.pool import RankPool
from tpdp_verify.runner import profiles
from tpdp_verify.runner.baseline import Baseline
from tpdp_verify.runner.gate import judged_search

PROPERTIES = (large_dp_trains_like_one_device, large_dp_trains_like_plain_dp, large_dp_state_dict_like_unsharded,
              large_dp_checkpoint_resumes)


def searches(world_size: int) -> dict[str, float]:
    """Seconds each property's ci search takes on ``world_size`` ranks, judged by torch 2.13.0."""
    release = Baseline("2.13.0", install=False)
    profile = dataclasses.replace(profiles.get("ci"), shrink=False)  # a known failure is never shrunk
    out = {}
    logs = tempfile.mkdtemp(prefix="bench-large-dp-")  # torch's warnings, out of the terminal
    with RankPool(world_size, output=logs) as pool:
        for prop in PROPERTIES:
            start = time.monotonic()
            outcome = judged_search(prop, pool, "torch", profile, release)
            out[prop.name] = time.monotonic() - start
            print(f"  {prop.name:38} world {world_size}  {outcome.status:8} {outcome.stats.drawn:3} drawn "
                  f"{outcome.stats.covered:3} cover  {out[prop.name]:6.1f} s", flush=True)
    return out


if __name__ == "__main__":
    four, eight = searches(4), searches(8)
    total4, total8 = sum(four.values()), sum(eight.values())
    print(f"large_dp at ci: {total4:.0f} s on 4 ranks, {total8:.0f} s on 8: ratio {total8 / total4:.2f}")
    print(f"a ci run with world size 8 added would take {total8:.0f} s more of its "
          f"{profiles.get('ci').budget:.0f} s budget")
