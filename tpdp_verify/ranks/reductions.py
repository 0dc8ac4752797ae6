"""The reductions of gradients under FSDP2, watched where torch makes them: TP's partial
sums, and DP's reduce-scatter.

FSDP2 turns an unsharded parameter's gradient into the local tensor it reduce-scatters over
dp in ``FSDPParam._get_grad_inner_tensor``. A gradient that is a partial sum over tp (a
SequenceParallel norm's, whose rows of the sequence each tp rank holds) is all-reduced
there first. Seeing each rank's partial sum and the reduced result, judging can tell in
which precision the reduction ran (tpdp_verify.judging.reductions), which the policy's
``reduce_dtype`` promises and no comparison of trained values can resolve under a
half-precision ``param_dtype``.

FSDP2 then reduces each unsharded gradient over dp in ``foreach_reduce`` (a reduce-scatter
over the shard group, then an all-reduce over the replicate group under HSDP), in
``reduce_dtype``. Seeing each rank's unsharded gradient, its shard of the result and the
groups, judging knows the exact mean each shard should hold, and so again in which
precision the reduction ran: a reduction in bfloat16 where float32 was asked errs by
thousands of times what float32 allows, where a trained value's bound under a bfloat16
``param_dtype`` hides it.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from tpdp_verify import torch_internals
from tpdp_verify.impls.fsdp2_sums import grad_step_replaced
from tpdp_verify.ranks import taps


class Reduction(NamedTuple):
    """One gradient TP reduced on this rank: its partial sum, and the result FSDP2 reduces over dp."""

    name: str  # the parameter's name from the root module
    partial: torch.Tensor  # this rank's local gradient before the reduction
    reduced: torch.Tensor  # this rank's local gradient after it


def partial_on_tp(grad: DTensor) -> bool:
    """Whether a gradient is a pending sum over tp: its placement on the mesh dimension named
    "tp" (on the whole SPMD mesh it is pending over dp too, which FSDP2 reduces itself), or
    on any dimension of a mesh without names."""
    names = grad.device_mesh.mesh_dim_names
    dims = [names.index("tp")] if names and "tp" in names else range(len(grad.placements))
    return any(grad.placements[i].is_partial() for i in dims)


def watching(seen: list[Reduction]):
    """Record in ``seen`` every gradient of partial placement that FSDP2 reduces, in order
    (nothing on a torch whose FSDP2 has no such step: ``unobservable`` says so)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def partial_of(grad):
        grad = grad.wait() if isinstance(grad, AsyncCollectiveTensor) else grad  # as torch's own does first
        return grad._local_tensor.detach().clone() if isinstance(grad, DTensor) and partial_on_tp(grad) else None

    def record(fsdp_param, partial, out):
        seen.append(Reduction(torch_internals.param_name(fsdp_param), partial, out.detach().clone()))

    return grad_step_replaced(lambda inner: taps.watching(inner, partial_of, record))


class DPReduction(NamedTuple):
    """One gradient FSDP2 reduced over dp on this rank."""

    name: str  # the parameter's name from the root module
    grad: torch.Tensor  # this rank's unsharded gradient (its tp shard, whole over dp), as FSDP2 took it
    delta: torch.Tensor | None  # what the reduction added to this rank's shard of the gradient (None: no gradient)
    held: torch.Tensor | None  # the shard's gradient after it, into which FSDP2 accumulated the delta
    shard_group: tuple[int, ...]  # the global ranks the reduce-scatter split rows over, in order
    replicas: tuple[int, ...]  # the global ranks of the all-reduce over replicas (HSDP), else ()
    divide_factor: float | None  # the gradient divide factor set on FSDP2, else None (the mean)


def _ranks(group) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group)) if group is not None else (dist.get_rank(),)


def watching_dp(seen: list[DPReduction]):
    """Record in ``seen`` every gradient FSDP2's ``foreach_reduce`` reduces over dp and puts
    into its shard, in order: those sharded on dim 0, as plain tensors, in a call that
    completes the reduction (nothing on a torch whose FSDP2 has no such function:
    ``unobservable`` says so)."""
    import inspect

    try:
        owner, name = torch_internals.site("dp reduce")
        takes = inspect.signature(getattr(*torch_internals.site("dp reduce (defined)")))
    except torch_internals.Unobservable:
        return contextlib.nullcontext()

    def before(*args, **kwargs):
        try:
            given = takes.bind(*args, **kwargs).arguments
            if given.get("all_reduce_group") is not None and (not given.get("all_reduce_grads", True)
                                                              or given.get("partial_reduce_output") is not None):
                return given, []  # HSDP's microbatches (set_requires_all_reduce): several reductions in one shard
            taken = [(p, g.detach().clone(), torch_internals.sharded_grad(p))
                     for p, g in zip(given["fsdp_params"], given["unsharded_grads"])
                     if isinstance(g, torch.Tensor) and not isinstance(g, DTensor) and torch_internals.shard_dim(p) == 0]
            return given, [(p, g, None if b is None else b.detach().clone()) for p, g, b in taken]
        except Exception:  # a torch whose FSDP2 calls it otherwise: not judged, never the harness raising in torch
            return {}, []

    def after(noted):
        given, taken = noted
        try:
            shards = _ranks(given["reduce_scatter_group"])
            replicas = _ranks(given["all_reduce_group"]) if given.get("all_reduce_group") is not None else ()
        except Exception:
            return
        for p, grad, b in taken:  # b: the gradient a step that was not zeroed left, into which FSDP2 adds
            now = torch_internals.sharded_grad(p)
            delta = None if now is None or (b is not None and b.shape != now.shape) else \
                now.detach().clone() if b is None else now.detach() - b
            seen.append(DPReduction(torch_internals.param_name(p), grad, delta,
                                    None if delta is None else now.detach().clone(), shards, replicas,
                                    given.get("gradient_divide_factor")))

    return taps.replaced(owner, name, lambda reduce: taps.around(reduce, before, after))


def unobservable(case) -> list[str]:
    """What the taps above cannot see on this torch, for a case that would take their sites
    (a run under FSDP2): said in the report, where no check could be made."""
    from tpdp_verify.cases.training import FSDP2_ENTRIES

    if case.entry not in FSDP2_ENTRIES:
        return []
    out = []
    for name, needed in (("grad step", True), ("dp reduce", case.dp > 1)):
        try:
            torch_internals.site(name) if needed else None
        except torch_internals.Unobservable as exc:
            out.append(f"{exc}: its check is not made")
    return out
