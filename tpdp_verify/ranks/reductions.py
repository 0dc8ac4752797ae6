"""TP's reductions of gradients under FSDP2, watched where torch makes them.

FSDP2 turns an unsharded parameter's gradient into the local tensor it reduce-scatters over
dp in ``FSDPParam._get_grad_inner_tensor``. A gradient that is a partial sum over tp (a
SequenceParallel norm's, whose rows of the sequence each tp rank holds) is all-reduced
there first. Seeing each rank's partial sum and the reduced result, judging can tell in
which precision the reduction ran (tpdp_verify.judging.reductions), which the policy's
``reduce_dtype`` promises and no comparison of trained values can resolve under a
half-precision ``param_dtype``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

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
    (nothing on a torch whose FSDP2 has no such step)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def partial_of(grad):
        grad = grad.wait() if isinstance(grad, AsyncCollectiveTensor) else grad  # as torch's own does first
        return grad._local_tensor.detach().clone() if isinstance(grad, DTensor) and partial_on_tp(grad) else None

    def record(fsdp_param, partial, out):
        seen.append(Reduction(fsdp_param._param_fqn or "", partial, out.detach().clone()))

    return grad_step_replaced(lambda inner: taps.watching(inner, partial_of, record))
