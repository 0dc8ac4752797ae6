"""Benchmark: how much room the tolerance model leaves, on real TP+DP runs.

Run as ``.venv/bin/python bench/bench_tolerance.py [--examples N] [--world-size W]``.
Cases are drawn by the property's strategy (derandomized) over every zoo model and mesh
factorization, through the entry points where the reference trains as documented; for
each, the ranks train it with the reference transform and every value is judged against
the float64 shadow (tpdp_verify.judging.tolerance):

- correct runs: the error/bound ratio of every compared value (outputs, losses,
  gradients, parameters, optimizer state, buffers). The largest must stay below 1, and
  how far below says how much room is left;
- scaled gradients: each gradient the run produced whose largest element exceeds its
  bound (one that does not is rounding noise, in which no departure can show; they are
  counted), times 1 + 1e-3 and times 1 - 1e-3, judged against the same bound. The smallest ratio must stay above 1, and how
  far above says how much smaller a departure would still be caught.

Results go in docs/tolerance.md. Exits 1 if a correct run is flagged or a scaled gradient
passes.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from hypothesis import Phase, given, settings

from tpdp_verify.judging.tolerance import error
from tpdp_verify.judging.verdict import assemble, judge_training
from tpdp_verify.oracles.single_device import oracle
from tpdp_verify.properties.training import SOUND_TRAINING, train_cases
from tpdp_verify.ranks.pool import RankPool
from tpdp_verify.ranks.tp_dp import observe

FACTORS = (1 + 1e-3, 1 - 1e-3)

def draw(n: int, world_size: int) -> list:
    cases = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None)
    @given(train_cases(world_size, **SOUND_TRAINING))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    correct, scaled, worst_correct, weakest, noise = [], [], None, None, 0
    with RankPool(args.world_size) as pool:
        for case in draw(args.examples, args.world_size):
            whole, checks = assemble(case, pool.run(observe, case, "reference"))
            baseline, shadow = oracle(case)
            verdict = judge_training(case, whole, baseline, shadow)
            if not all(c.ok for c in checks) or not verdict.ok:
                print(f"A CORRECT RUN WAS FLAGGED: {case!r}\n{verdict.report()}", file=sys.stderr)
                return 1
            for row in verdict.rows:
                correct.append(row.err.ratio)
                if worst_correct is None or row.err.ratio > worst_correct[0]:
                    worst_correct = (row.err.ratio, row, case)
            for step, grads in enumerate(whole.grads):
                # the scale the verdict bounds every gradient of this step with
                scale = max(g.abs().max().item() for g in shadow.grads[step].values() if g is not None and g.numel())
                for name, grad in grads.items():
                    exact = shadow.grads[step][name]
                    if grad is None or not exact.abs().max() > 0:
                        continue
                    if exact.abs().max() <= error(exact, baseline.grads[step][name], exact, scale=scale).bound:
                        noise += 1  # the gradient is no larger than its rounding: no departure shows
                        continue
                    for f in FACTORS:
                        ratio = error(grad * f, baseline.grads[step][name], exact, scale=scale).ratio
                        scaled.append(ratio)
                        if weakest is None or ratio < weakest[0]:
                            weakest = (ratio, name, f, case)
    models = sorted({c.model for c in draw(args.examples, args.world_size)})
    print(f"torch {torch.__version__}, {args.world_size} gloo ranks, {args.examples} cases over {', '.join(models)}")
    print(f"correct runs: {len(correct)} values; error/bound ratio median {statistics.median(correct):.3g}, "
          f"99th percentile {sorted(correct)[int(0.99 * len(correct))]:.3g}, largest {max(correct):.3g}")
    ratio, row, case = worst_correct
    print(f"  largest: {row.what} {row.name} step {row.step} (max abs {row.err.max_abs:.3g}, "
          f"bound {row.err.bound:.3g}) in {case!r}")
    print(f"gradients scaled by 1 +- 1e-3: {len(scaled)} values ({noise} gradients no larger than their "
          f"bound left out); ratio median {statistics.median(scaled):.3g}, "
          f"1st percentile {sorted(scaled)[int(0.01 * len(scaled))]:.3g}, smallest {min(scaled):.3g}")
    ratio, name, f, case = weakest
    print(f"  smallest: {name} times {f:g} in {case!r}")
    ok = max(correct) <= 1 < min(scaled)
    print("PASS: no correct value flagged, every scaled gradient caught" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
