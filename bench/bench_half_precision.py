"""Benchmark: the whole-tensor bound of half-precision gradients, on real TP+DP runs.

Run as ``.venv/bin/python bench/bench_half_precision.py [--examples N] [--world-size W]``.
For each half dtype, N cases are drawn by trains_like_one_device's own strategy (every
zoo model, mesh and sound entry point), and by trains_like_plain_ddp's (the options that
round to half precision, judged against plain DP with the same option). The ranks train
each with the reference transform, and each first-step gradient is judged as a whole
tensor (tpdp_verify.judging.tolerance.whole_error):

- correct runs: rms error / its bound for every such gradient; the largest must stay below 1;
- planted scalings: the same gradients times 1.01, 1.05 and 1.10; a case is caught when
  one of its gradients goes past its bound (as the property fails on one), and the share
  of cases caught is printed per factor, beside the same share under the max bound alone.

Results go in docs/tolerance.md ("Half precision"). Exits 1 if a correct run is flagged,
or if fewer than 9 in 10 cases scaled by 1.05 are caught in a row of the table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from hypothesis import Phase, given, settings

from tpdp_verify.judging.tolerance import error
from tpdp_verify.judging.verdict import assemble
from tpdp_verify.oracles.plain_ddp import observe_with_plain_ddp
from tpdp_verify.oracles.single_device import oracle
from tpdp_verify.properties.training import sound_cases, sound_cases_with_half
from tpdp_verify.ranks.pool import RankPool
from tpdp_verify.ranks.tp_dp import observe
from tpdp_verify.hypothesis_internals import without_local_constants

FACTORS = (1.01, 1.05, 1.10)


def draw(n: int, strategy) -> list:
    cases = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None)
    @given(strategy)
    def collect(case):
        cases.append(case)

    with without_local_constants():
        collect()
    return cases


def first_gradients(pool, case, against: str):
    """(observed, baseline, shadow, dtype) of each first-step gradient of a correct run,
    the baseline as the property has it: one device, or plain DP with the same option."""
    if against == "one device":
        whole, checks = assemble(case, pool.run(observe, case, "reference"))
        baseline, shadow = oracle(case)
    else:
        traces = pool.run(observe_with_plain_ddp, case, "reference")
        whole, checks = assemble(case, [t for t, _ in traces])
        (baseline, more), shadow = assemble(case, [p for _, p in traces]), oracle(case).shadow
        checks += more
    if whole.error or baseline.error or not all(c.ok for c in checks):
        return None  # the reference does not train it (a known fault of torch's entry point)
    dtype = case.wire_dtype
    return [(g, baseline.grads[0][name], shadow.grads[0][name], dtype)
            for name, g in whole.grads[0].items() if g is not None and shadow.grads[0][name] is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    ok = True
    print(f"torch {torch.__version__}, {args.world_size} gloo ranks, {args.examples} cases a space and dtype")
    print(f"{'dtype':<9}{'judged against':<16}{'cases':>6}{'grads':>7}{'worst correct':>15}"
          + "".join(f"{f'x{f:g} caught':>14}{'(max only)':>11}" for f in FACTORS))
    with tempfile.TemporaryDirectory() as logs, RankPool(args.world_size, output=logs) as pool:
        for dtype in ("bfloat16", "float16"):
            for against, space in (("one device", sound_cases(args.world_size)),
                                   ("plain DP", sound_cases_with_half(args.world_size))):
                pick = (lambda c, d=dtype: c.dtype == d) if against == "one device" else \
                    (lambda c, d=dtype: c.wire_dtype == getattr(torch, d))
                runs = [r for c in draw(args.examples, space.filter(pick)) if (r := first_gradients(pool, c, against))]
                worst = max(error(*g, whole=True).ratio for r in runs for g in r)
                caught = {f: sum(any(not error(o.double() * f, b, s, d, whole=True).ok for o, b, s, d in r) for r in runs)
                          for f in FACTORS}
                by_max = {f: sum(any(not error(o.double() * f, b, s, d).ok for o, b, s, d in r) for r in runs)
                          for f in FACTORS}
                print(f"{dtype:<9}{against:<16}{len(runs):>6}{sum(map(len, runs)):>7}{worst:>15.3f}"
                      + "".join(f"{f'{caught[f]}/{len(runs)}':>14}{f'{by_max[f]}/{len(runs)}':>11}"
                                for f in FACTORS))
                ok &= worst <= 1 and caught[1.05] >= 0.9 * len(runs)
    print("PASS: no correct gradient flagged, 9 in 10 cases scaled by 1.05 caught or more" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
