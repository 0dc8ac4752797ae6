"""torch 2.13: SequenceParallel makes a frozen parameter trainable again.

Every other ParallelStyle builds its DTensor parameters with the original's requires_grad;
SequenceParallel._replicate_module_fn wraps each in a new nn.Parameter, whose default is
True. A norm frozen before parallelize_module trains afterwards (docs/known-divergences.md,
fault 7). Runs on one CPU process: python docs/examples/sequence_parallel_thaws.py
"""

import tempfile

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

if __name__ == "__main__":
    with tempfile.NamedTemporaryFile() as rendezvous:  # a file, not a port: nothing to collide with
        dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        for style, module in ((SequenceParallel(), nn.LayerNorm(4)), (ColwiseParallel(), nn.Linear(4, 4))):
            module.requires_grad_(False)
            parallelize_module(module, mesh, style)
            print(f"{type(style).__name__}: frozen weight requires_grad after parallelize_module = "
                  f"{module.weight.requires_grad}")
        dist.destroy_process_group()
