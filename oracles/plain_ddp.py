"""The plain-DP oracle: the unsharded model through the case's own DP entry point, no TP.

For the DDP entry points (DDP with a mesh, the explicit transform then DDP, replicate)
that is plain DDP over the case's dp groups; for FSDP1 and FSDP2 it is the same FSDP
without TP. Each tp coordinate forms its own dp group, so every rank's trace is a whole
plain-DP run. Where TP+DP departs from one device, this run says whether the entry point
alone departs the same way (its own matter) or not (the TP->DP composition's).

For fully_shard over the whole SPMD mesh (TrainCase.dp_mesh_dims) the model is a DTensor
program whatever the wrapper: the oracle is that program with no DP wrapper, DTensor itself
reducing the gradients over dp.
"""

from __future__ import annotations

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.ranks.loop import Trace
from tpdp_verify.ranks.tp_dp import observe


def observe_plain_ddp(case: TrainCase) -> Trace:
    """On every rank: the case without TP, through torch's own entry point; in the SPMD form,
    the same DTensor program without the wrapper."""
    return observe(case, "torch", dp=False) if case.dp_mesh_dims else observe(case, "torch", tp=False)


def observe_with_plain_ddp(case: TrainCase, impl_name: str) -> tuple[Trace, Trace]:
    """On every rank: the TP+DP run and the plain-DP run, in one call to the ranks."""
    return observe(case, impl_name), observe_plain_ddp(case)
