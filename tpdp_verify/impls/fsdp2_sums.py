"""The reference's FSDP2 step for TP's partial gradients, written from the policy's contract.

``MixedPrecisionPolicy(reduce_dtype=...)`` says in which dtype gradients are reduced. Under
TP, a gradient each tp rank holds as a partial sum (a SequenceParallel norm's) is summed
over tp in ``FSDPParam._get_grad_inner_tensor`` before FSDP2's reduce-scatter over dp; torch
2.13 sums a step's gradient there in the compute dtype (docs/known-divergences.md, fault
16). The reference casts the gradients to ``reduce_dtype`` first, as torch already does for
a gradient accumulated over microbatches: one dtype for the whole group, which FSDP2's
reduce-scatter casts to anyway. Installed for a run by ``Transform.patched``; it is the
only place the reference reaches into FSDP2, whose site it replaces as a fix would
(``grad_step_replaced``, with which tpdp_verify.ranks.reductions watches the same site).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def grad_step_replaced(wrap: Callable) -> Iterator[None]:
    """FSDP2's ``FSDPParam._get_grad_inner_tensor`` replaced by ``wrap(torch's)`` for the
    run, torch's put back after it; nothing on a torch whose FSDP2 has no such step."""
    from tpdp_verify import torch_internals

    try:
        owner, name = torch_internals.site("grad step")
    except torch_internals.Unobservable:
        yield
        return
    inner = getattr(owner, name)
    setattr(owner, name, wrap(inner))
    try:
        yield
    finally:
        setattr(owner, name, inner)


def summed_in_reduce_dtype():
    def wrap(inner):
        def summed(fsdp_param, grad):
            wanted = fsdp_param.reduce_dtype
            if wanted is not None and grad.dtype != wanted:  # every gradient of the group: FSDP2 reduces them as one
                grad = grad.to(wanted)
            return inner(fsdp_param, grad)

        return summed

    return grad_step_replaced(wrap)
