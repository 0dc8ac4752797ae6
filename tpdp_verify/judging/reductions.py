"""Whether TP reduced gradients as precisely as the policy says.

The tp ranks of a dp group each give their partial sum of a gradient and the reduced result
(tpdp_verify.ranks.reductions), so the exact sum is known (in float64). Summing k partial
sums in ``reduce_dtype`` errs, element by element, by at most k * eps * sum(|partial|),
eps that dtype's unit in the last place (each addition rounds once). A reduction in
bfloat16 where float32 was asked errs by up to 2^-9 of the sum: over 10^4 times the bound,
so a value that departs at all departs by orders of magnitude (docs/tolerance.md).
"""

from __future__ import annotations

import torch

from tpdp_verify.cases.training import FSDP2_ENTRIES, TrainCase
from tpdp_verify.ranks.loop import Trace
from tpdp_verify.ranks.observation import Check


def reduce_dtype(case: TrainCase) -> torch.dtype:
    """The dtype the case's DP reduces gradients in: FSDP2's mixed-precision policy's
    ``reduce_dtype`` (float32: FSDP2Options.kwargs), else the gradients' own."""
    return torch.float32 if case.entry in FSDP2_ENTRIES and case.fsdp.mixed_precision else case.torch_dtype


def judge_reductions(case: TrainCase, traces: list[Trace]) -> list[Check]:
    """One check over every gradient TP reduced under FSDP2 (none where it reduced none),
    named for the path through FSDP2: a step's gradient, or one accumulated over
    microbatches (cast to ``reduce_dtype`` before the reduction)."""
    dtype = reduce_dtype(case)
    eps = torch.finfo(dtype).eps
    groups: dict[int, list[Trace]] = {}
    for rank, trace in enumerate(traces):
        groups.setdefault(rank // case.tp, []).append(trace)  # a dp group's tp ranks (row-major mesh)
    compared, departed = 0, []
    for group in groups.values():
        for records in zip(*(t.reductions for t in group)):
            if len({r.name for r in records}) > 1 or any(r.reduced.shape != r.partial.shape for r in records):
                continue  # a reduce-scatter to a tp shard: not a sum each rank holds whole
            exact = sum(r.partial.double() for r in records)
            allowed = len(records) * eps * sum(r.partial.double().abs() for r in records)
            for r in records:
                compared += 1
                off = (r.reduced.double() - exact).abs()
                if (off > allowed).any():
                    worst = int((off - allowed).argmax())
                    departed.append(f"{r.name}: {off.flatten()[worst].item():.3g} off the exact sum "
                                    f"{exact.flatten()[worst].item():.6g}, where {dtype} allows "
                                    f"{allowed.flatten()[worst].item():.3g}")
    if not compared:
        return []
    path = "gradients accumulated over microbatches" if case.accumulate > 1 else "a step's gradients"
    return [Check(f"TP sums {path} in the reduce dtype", not departed,
                  f"{len(departed)} of {compared} reductions depart: {departed[0]}" if departed else "")]
