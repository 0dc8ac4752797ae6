"""torch 2.13: fully_shard over a (dp_replicate, dp_shard) mesh with dp_replicate of 4 and TP
shards of unequal size: the tp ranks' copies of a parameter TP keeps Replicate() get
gradients that differ in the last bit, so the copies drift apart
(docs/known-divergences.md, fault 21).

Each tp rank all-reduces its own flat gradient buffer over dp_replicate. With uneven TP
shards (hidden 7 over tp 2) the buffers differ in size between tp ranks, and the replicated
bias sits at another offset in each; gloo's all-reduce sums an element's four values in an
order that depends on the buffer, so the tp ranks get sums that differ by an ulp. With
hidden 8 the buffers are alike, and so are the sums; on a (2, 2, 2) or (1, 4, 2) mesh too.

Eight gloo ranks on the CPU, a (dp_replicate, dp_shard, tp) = (4, 1, 2) mesh:
python docs/examples/hsdp_uneven_tp_replicas_drift.py
"""

import torch

from tpdp_verify import RankPool


def bias_gradient(seed: int, hidden: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """One forward and backward of a Colwise -> Rowwise -> Colwise model under HSDP x TP;
    the gradient of the Rowwise layer's bias (Replicate() on tp) as this rank holds it."""
    import warnings

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tpdp_verify.ranks.pool import device_mesh

    warnings.simplefilter("ignore")
    mesh = device_mesh(shape, ("dp_replicate", "dp_shard", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 3), nn.Tanh(), nn.Linear(3, 3))
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel(),
                                                   "4": ColwiseParallel(output_layouts=Replicate())})
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    torch.manual_seed(seed + dist.get_rank() // shape[2])  # each dp rank its rows, the same over its tp group
    model(torch.randn(4, 3)).pow(2).sum().backward()
    return model[2].bias.grad.to_local()


def disagreeing(pool, hidden: int, shape: tuple[int, int, int], seeds: range) -> list[int]:
    """The seeds whose step leaves the tp ranks' copies of the bias gradient unequal."""
    def split(grads):
        tp = shape[2]
        return any(not torch.equal(grads[r], grads[r - r % tp]) for r in range(len(grads)))
    return [s for s in seeds if split(pool.run(bias_gradient, s, hidden, shape))]


if __name__ == "__main__":
    with RankPool(8) as pool:
        for hidden, shape in ((7, (4, 1, 2)), (8, (4, 1, 2)), (7, (2, 2, 2)), (7, (1, 4, 2))):
            seeds = disagreeing(pool, hidden, shape, range(30))
            print(f"hidden {hidden} on {shape}: the tp copies of a replicated bias's gradient "
                  f"{'DISAGREE' if seeds else 'agree'} in {len(seeds)} of 30 seeds {seeds or ''}".rstrip())
