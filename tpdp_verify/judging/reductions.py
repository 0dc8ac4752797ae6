"""Whether TP and DP reduced gradients as precisely as the policy says.

The tp ranks of a dp group each give their partial sum of a gradient and the reduced result
(tpdp_verify.ranks.reductions), so the exact sum is known (in float64). Summing k partial
sums in ``reduce_dtype`` errs, element by element, by at most k * eps * sum(|partial|),
eps that dtype's unit in the last place (each addition rounds once). A reduction in
bfloat16 where float32 was asked errs by up to 2^-9 of the sum: over 10^4 times the bound,
so a value that departs at all departs by orders of magnitude (docs/tolerance.md).

FSDP2's reduction over dp is judged alike: each rank's unsharded gradient and its shard of
the result are seen (tpdp_verify.ranks.reductions.DPReduction), so each shard's exact mean
over the dp ranks is known, and a reduce-scatter run in bfloat16 where the policy asks for
float32 departs by thousands of times the bound, whatever the data.
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


def judge_dp_reductions(case: TrainCase, traces: list[Trace]) -> list[Check]:
    """One check over every gradient FSDP2 reduced over dp (none where it reduced none): each
    rank's shard of it is the exact mean of the unsharded gradients of the ranks it was
    summed over (the shard group, and under HSDP the replicas' shard groups), within N + 2
    roundings in ``reduce_dtype`` of the summands' magnitudes, and the cast to the
    gradient's own dtype and its accumulation into the shard's gradient in that dtype."""
    dtype = reduce_dtype(case)
    calls = [t.dp_reductions for t in traces]
    compared, departed = 0, []
    for rank, records in enumerate(calls):
        for i, r in enumerate(records):
            compared += 1
            said = _departs(r, rank, i, calls, dtype)
            if said:
                departed.append(f"{r.name} on rank {rank}: {said}")
    if not compared:
        return []
    return [Check("DP sums gradients in the reduce dtype", not departed,
                  f"{len(departed)} of {compared} reductions depart: {departed[0]}" if departed else "")]


def _departs(r, rank: int, i: int, calls: list[list], dtype: torch.dtype) -> str:
    """What is wrong with reduction ``r``, the ``i``-th on ``rank``; "" if nothing."""
    over = set(r.shard_group)
    for replica in r.replicas:
        theirs = calls[replica][i] if i < len(calls[replica]) else None
        if theirs is None or theirs.name != r.name:
            return f"replica rank {replica} reduced {'nothing' if theirs is None else theirs.name} there"
        over |= set(theirs.shard_group)
    summands = []
    for other in sorted(over):
        theirs = calls[other][i] if i < len(calls[other]) else None
        if theirs is None or theirs.name != r.name or theirs.grad.shape != r.grad.shape:
            return f"rank {other} reduced {'nothing' if theirs is None else theirs.name} there"
        summands.append(theirs.grad.double())
    if r.delta is None:
        return "its shard holds no gradient after the reduction"
    divide = r.divide_factor or len(summands)
    rows = -(-r.grad.shape[0] // len(r.shard_group)) if r.grad.dim() else 1
    at = slice(r.shard_group.index(rank) * rows, (r.shard_group.index(rank) + 1) * rows) if r.grad.dim() else ...
    exact = (sum(summands) / divide)[at]
    if r.delta.shape != exact.shape:
        return f"its shard is {tuple(r.delta.shape)}, the mean's rows for it {tuple(exact.shape)}"
    magnitude = (sum(x.abs() for x in summands) / divide)[at]
    reducing, kept = torch.finfo(dtype), torch.finfo(r.delta.dtype)
    # each rounding relative to what it rounds, and at least half a subnormal's spacing
    # (float16 divides before and after its sum: a small gradient's quotient is subnormal);
    # the cast to the gradient's dtype, and its accumulation into what the shard held
    # (a gradient a step left unzeroed), each by one rounding of the gradient's dtype
    held = r.held.double().abs() if r.held is not None and r.held.shape == exact.shape else exact.abs()
    allowed = (len(summands) + 2) * reducing.eps * (magnitude + reducing.smallest_normal) \
        + kept.eps * (exact.abs() + 2 * held + 2 * kept.smallest_normal)
    off = (r.delta.double() - exact).abs()
    if not (off > allowed).any():
        return ""
    worst = int((off - allowed).argmax())
    return (f"{off.flatten()[worst].item():.3g} off the exact mean {exact.flatten()[worst].item():.6g}, "
            f"where {dtype} allows {allowed.flatten()[worst].item():.3g}")
