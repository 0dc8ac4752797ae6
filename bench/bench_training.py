"""Benchmark: gradient-equality examples per second on a 2x2 mesh of 4 gloo ranks.

Run as ``.venv/bin/python bench/bench_training.py [--examples N]``. Cases are drawn by
the property's own strategy (``train_cases``, derandomized), narrowed to the (2, 2) mesh
and to one group of zoo models at a time; each example is one full verdict as the
property computes it: the ranks train the case (TP on the tp sub-mesh, the DP entry
point, 1-3 steps of 1-2 microbatches), the parent puts the global trace together, runs
the float32 and float64 single-device oracles and judges every value.

Against the reference transform (every example passes, as a correct implementation
would) and against torch 2.13 (failing examples also pay for the rerun that localizes
the departure and the plain-DDP run that says whose it is).

Target: >= 10 examples/s for the small models (everything but the Llama fixtures).
Exits 1 if a reference example fails or compares nothing: a broken check is never what
got timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from hypothesis import Phase, given, settings

from tpdp_verify.errors import PoolError
from tpdp_verify.oracles.verdicts import verdict_one_device
from tpdp_verify.properties.training import SOUND_TRAINING, train_cases
from tpdp_verify.ranks.pool import RankPool

TARGET = 10.0
SMALL = ("mlp", "nested", "tied", "frozen", "unused", "uneven", "buffers")
LLAMA = ("llama", "llama_sp", "llama_lm")


def draw(n: int, **narrow) -> list:
    cases = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None)
    @given(train_cases(4, mesh_shapes=((2, 2),), **narrow))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def timed(pool: RankPool, impl: str, cases: list) -> tuple[float, int, int]:
    """Seconds an example, examples that passed, values compared. A torch case whose ranks
    hang is printed and left out, of the count and of the time (it measures the pool's
    timeout, not a check)."""
    passed = compared = timed_cases = 0
    seconds = 0.0
    for case in cases:
        start = time.perf_counter()
        try:
            verdict = verdict_one_device(pool, impl, case)
        except PoolError as exc:
            if impl == "reference":
                raise
            print(f"HANG ({impl}), left out: {case!r}\n  {str(exc).splitlines()[0]}", file=sys.stderr)
            continue
        seconds += time.perf_counter() - start
        timed_cases += 1
        passed += verdict.ok
        compared += len(verdict.rows)
        if impl == "reference" and (not verdict.ok or not verdict.rows):
            print(f"REFERENCE EXAMPLE FAILED: {case!r}\n{verdict.report()}", file=sys.stderr)
            sys.exit(1)
    return seconds / timed_cases, passed, compared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=60, help="examples a workload")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, 4 gloo ranks, mesh (dp=2, tp=2)")
    rows = []
    with RankPool(4, timeout=30) as pool:
        warm = draw(3, **SOUND_TRAINING, models=SMALL)
        timed(pool, "reference", warm)  # mesh subgroups, imports, dispatch caches: once a pool
        for label, models in (("small models", SMALL), ("Llama fixtures", LLAMA)):
            for impl, narrow in (("reference", SOUND_TRAINING), ("torch", {})):
                cases = draw(args.examples, **narrow, models=models)
                per, passed, compared = timed(pool, impl, cases)
                rows.append((label, impl, len(cases), passed, compared, per))
    print()
    print(f"{'workload':<16}{'impl':<11}{'examples':>9}{'passed':>8}{'values':>8}{'ms/example':>12}{'examples/s':>12}")
    for label, impl, n, passed, compared, per in rows:
        print(f"{label:<16}{impl:<11}{n:>9}{passed:>8}{compared:>8}{per * 1e3:>12.0f}{1 / per:>12.1f}")
    small = rows[0][5]
    verdict = "PASS" if 1 / small >= TARGET else "BELOW TARGET"
    print(f"\nsmall models, reference: {1 / small:.1f} examples/s   target >= {TARGET:g}   {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
