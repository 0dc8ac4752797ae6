"""Functions tests/test_fixtures.py sends to ranks: module-level, so spawned ranks import them.

Each rank builds a zoo model twice from one seed, tensor-parallelizes one copy on the tp
sub-mesh and runs one forward/backward through both; everything comes back whole (DTensors
gathered), and the parent compares.
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from tpdp_verify.fixtures import ZOO, Size
from tpdp_verify.ranks.rank import device_mesh
from tpdp_verify.ranks.tp_dp import sharded_per_part


def _full(t):
    if t is None:
        return None
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(fx, model, batch, weight, parallel_loss: bool):
    with loss_parallel() if parallel_loss else contextlib.nullcontext():
        out = model(batch["input"])
        loss = (weight * fx.per_sample_loss(out, batch)).mean()
        loss.backward()
    return out, loss


def _observe(model, out, loss) -> dict:
    params = dict(model.named_parameters(remove_duplicate=False))
    return {
        "output": _full(out),
        "loss": _full(loss),
        "grads": {n: _full(p.grad) for n, p in params.items()},
        "requires_grad": {n: p.requires_grad for n, p in params.items()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
    }


def tp_against_unsharded(name: str, size: Size, mesh_shape: tuple, seed: int, n: int) -> dict:
    """One forward/backward of the TP'd model and of the unsharded one, on one batch."""
    fx = ZOO[name]
    mesh = device_mesh(mesh_shape, ("dp", "tp"))
    torch.manual_seed(seed)
    reference = fx.build(size)
    torch.manual_seed(seed)
    model = fx.build(size)
    parallelize_module(model, mesh["tp"], fx.plan(size))
    if fx.after_parallelize is not None:
        fx.after_parallelize(model)
    sharded = sorted(p_name for p_name, p in model.named_parameters() if isinstance(p, DTensor))

    gen = torch.Generator().manual_seed(seed + 1)
    batch = fx.batch(gen, n, size)
    weight = torch.rand(n, generator=gen)
    out, loss = _step(fx, model, batch, weight, fx.loss_parallel)
    output_is_dtensor = isinstance(out, DTensor)
    tp_run = _observe(model, out, loss)
    ref_run = _observe(reference, *_step(fx, reference, batch, weight, False))

    tied = None
    if hasattr(model, "head") and hasattr(model, "embed"):
        tied = model.head.weight is model.embed.weight and isinstance(model.embed.weight, DTensor)
    return {"tp": tp_run, "ref": ref_run, "sharded": sharded, "tied": tied,
            "output_is_dtensor": output_is_dtensor, "per_part": sharded_per_part(dict(model.named_parameters()))}
