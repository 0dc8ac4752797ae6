"""torch 2.13: under fully_shard's MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32), TP sums a replicated parameter's gradient over tp in bfloat16,
unless the gradient was accumulated over microbatches.

A SequenceParallel norm's weight is replicated over tp and each tp rank holds a slice of
the sequence, so each rank's gradient is a partial sum. FSDP2 turns it into the tensor it
reduces over dp in ``FSDPParam._get_grad_inner_tensor``
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py), which first all-reduces the partial
sums over tp, in the gradient's dtype: the compute dtype, bfloat16, for a step's gradient;
``reduce_dtype`` only for a gradient accumulated under ``set_requires_gradient_sync(False)``,
which ``to_accumulated_grad_if_needed`` cast to it (docs/known-divergences.md, fault 16).
Two gloo ranks on the CPU: python docs/examples/fsdp2_tp_reduce_dtype.py
"""

import torch

from tpdp_verify import RankPool


def tp_sums(microbatches: int) -> list[str]:
    """The dtype of each all-reduce over tp in the backward of a SequenceParallel norm."""
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from tpdp_verify.ranks.pool import device_mesh

    seen = []

    class AllReduces(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_reduce" in str(func):
                seen.append(str(args[0].dtype).removeprefix("torch."))
            return func(*args, **(kwargs or {}))

    mesh = device_mesh((1, 2), ("dp", "tp"))
    norm = parallelize_module(nn.RMSNorm(8), mesh["tp"], SequenceParallel())
    fully_shard(norm, mesh=mesh["dp"],
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    gen = torch.Generator().manual_seed(mesh.get_rank())
    for m in range(microbatches):
        norm.set_requires_gradient_sync(m == microbatches - 1)
        out = norm(torch.randn(2, 4, 8, generator=gen))  # this rank's 4 positions of the sequence
        with AllReduces():
            out.to_local().float().square().sum().backward()
    return seen


if __name__ == "__main__":
    with RankPool(2) as pool:
        for microbatches in (1, 2):
            dtypes = pool.run(tp_sums, microbatches)[0]
            print(f"{microbatches} microbatch{'es' * (microbatches > 1)}: the norm's gradient summed over tp in "
                  f"{', '.join(dtypes) or 'no all-reduce'} (reduce_dtype float32)")
