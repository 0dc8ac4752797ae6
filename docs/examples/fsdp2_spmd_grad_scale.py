"""torch 2.13: fully_shard over the whole SPMD mesh (dp_mesh_dims) scales every gradient by
1/dp.

Parameters are DTensors on the whole (dp, tp) mesh, Replicate() on dp, as
``DataParallelMeshDims`` asks; the batch is a DTensor sharded on dp and the loss a DTensor
mean over the global batch. DTensor alone (no wrapper) gives each parameter the gradient
of that mean: a partial sum over dp that it reduces with a sum, exactly one device's
gradient. fully_shard keeps the partial sums pending over dp "so FSDP's reduce-scatter
handles them directly" (``FSDPParam._get_grad_inner_tensor``) and reduce-scatters them
with its default average, dividing by dp a second time (docs/known-divergences.md, fault 17).
Four gloo ranks on the CPU: python docs/examples/fsdp2_spmd_grad_scale.py
"""

import torch

from tpdp_verify import RankPool


def gradient(dims: str) -> tuple[float, float]:
    """The weight's gradient norm, with fully_shard(dp_mesh_dims=...) given ``dims`` and without it."""
    from torch import nn
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from tpdp_verify.ranks.pool import device_mesh

    mesh = device_mesh((2, 2), ("dp", "tp"))
    norms = []
    for wrapped in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(4, 4, bias=False)
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, (Replicate(), Shard(0))))
        if wrapped:
            fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**{dims: "dp"}))
        rows = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))[2 * mesh.get_local_rank("dp"):][:2]
        x = DTensor.from_local(rows, mesh, (Shard(0), Replicate()))  # the global batch: 4 rows, 2 a dp rank
        model(x).square().mean().backward()
        grad = model.weight.grad
        norms.append(float(grad.full_tensor().norm()) if isinstance(grad, DTensor) else float(grad.norm()))
    return norms[0], norms[1]


if __name__ == "__main__":
    with RankPool(4) as pool:
        for dims in ("shard", "replicate"):
            wrapped, alone = pool.run(gradient, dims)[0]
            print(f"dp_mesh_dims {dims}: the gradient is {wrapped / alone:.3f} of the one DTensor computes alone "
                  f"(dp = 2)")
