"""Run a case on every rank: the TP+DP run under test, and the plain-DDP run beside it.

Functions here are sent to ranks by ``RankPool.run``; each returns the rank's ``Trace``
with every value gathered to its full tensor, so the parent compares whole tensors.
"""

from __future__ import annotations

import traceback

import torch
from torch.distributed.tensor import DTensor

from tpdp_verify.cases import TrainCase
from tpdp_verify.training import Run, Trace, build, fixture, make_optimizer, train

MESH_DIMS = ("dp", "tp")


def rows(case: TrainCase, dp_rank: int) -> slice:
    return slice(dp_rank * case.local_batch, (dp_rank + 1) * case.local_batch)


def gatherer(specs: dict):
    """``full(name, value)``: the global tensor behind a rank's value.

    A value is a DTensor, or a local shard of the parameter ``name`` whose layout was
    recorded from the TP'd model before any DP wrapper touched it (so a transform that
    garbles its own record of the layout cannot fool the gathering), or already whole.
    Every rank calls it for the same names in the same order: it may be a collective.
    """

    def full(name: str, value: torch.Tensor) -> torch.Tensor:
        if isinstance(value, DTensor):
            return value.full_tensor()
        spec = specs.get(name)
        if spec is None:
            return value
        return DTensor.from_local(value, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride).full_tensor()

    return full


def _failed(stage: str, exc: Exception) -> Trace:
    return Trace(error=f"{stage}: " + "".join(traceback.format_exception_only(exc)).strip())


def observe(case: TrainCase, impl_name: str, capture: bool = False) -> Trace:
    """On every rank: TP on the tp sub-mesh, the case's DP entry point, K steps."""
    from torch.distributed.tensor.parallel import parallelize_module

    from tpdp_verify.entries import WRAP
    from tpdp_verify.impl import installed, load
    from tpdp_verify.pool import device_mesh

    impl, fx = load(impl_name), fixture(case)
    mesh = device_mesh(case.mesh_shape, MESH_DIMS)
    with installed(impl):
        model = build(case)
        parallelize_module(model, mesh["tp"], fx.plan(case.size))
        if fx.after_parallelize is not None:
            fx.after_parallelize(model)
        before = dict(model.named_parameters(remove_duplicate=False))
        specs = {n: p._spec for n, p in before.items() if isinstance(p, DTensor)}
        optimizer = make_optimizer(case, model.parameters()) if case.built == "before_wrap" else None
        try:
            wrapped = WRAP[case.entry](model, case, mesh, impl)
        except Exception as exc:
            return _failed(f"wrapping with {case.entry}", exc)
        run = Run(wrapped.model, wrapped.inner, rows(case, mesh.get_local_rank("dp")),
                  full=gatherer(specs), no_sync=wrapped.no_sync, loss_parallel=fx.loss_parallel,
                  handles=dict(wrapped.inner.named_parameters(remove_duplicate=False)),
                  before_wrap=before)
        try:
            optimizer = optimizer or _optimizer_for(case, run)
        except Exception as exc:
            return _failed(f"building the optimizer {case.built.replace('_', ' ')}", exc)
        return train(case, run, optimizer, capture)


def _optimizer_for(case: TrainCase, run: Run) -> torch.optim.Optimizer:
    if case.built == "after_forward":
        from tpdp_verify.training import batches

        with torch.no_grad():
            run.model(batches(case)[0][0]["input"][run.rows])
    return make_optimizer(case, run.model.parameters())


def observe_both(case: TrainCase, impl_name: str) -> tuple[Trace, Trace]:
    """The TP+DP run and the plain-DDP run, in one call to the ranks."""
    from tpdp_verify.oracles.plain_ddp import observe_plain_ddp

    return observe(case, impl_name), observe_plain_ddp(case)
