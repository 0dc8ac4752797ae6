"""torch 2.13: DDP with TP, and replicate(), localize the parameters they are told to ignore.

DDP's TP transform (_pre_dp_module_transform) localizes every DTensor parameter, those on
DDP's ignore list included; replicate() passes its ignored_modules at wrapping, but its
forward hook (_localize_dtensor) localizes them after the first forward. A module the
user trains apart from DP (or froze) comes back a plain local shard, not the DTensor TP
made it (docs/known-divergences.md, fault 11). Runs on one CPU process:
python docs/examples/dp_localizes_ignored.py
"""

import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP


def model(mesh) -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    return parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "1": ColwiseParallel()})


if __name__ == "__main__":
    with tempfile.NamedTemporaryFile() as rendezvous:  # a file, not a port: nothing to collide with
        dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))

        ddp = model(mesh)
        DDP._set_params_and_buffers_to_ignore_for_model(ddp, ["0.weight", "0.bias"])
        DDP(ddp, device_mesh=mesh["dp"])
        print(f"DDP: ignored 0.weight is {type(ddp[0].weight).__name__} after wrapping")

        rep = model(mesh)
        replicate(rep, device_mesh=mesh["dp"], ignored_modules=[rep[0]])
        print(f"replicate: ignored 0.weight is {type(rep[0].weight).__name__} after wrapping", end="")
        rep(torch.randn(2, 4))
        print(f", {type(rep[0].weight).__name__} after a forward")
        dist.destroy_process_group()
