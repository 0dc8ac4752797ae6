"""torch 2.13: FSDP1 with HYBRID_SHARD (or _HYBRID_SHARD_ZERO2) whose shard group is one rank
never synchronizes its replicas, with or without TP.

On a (dp_replicate, dp_shard) = (2, 1) device mesh FSDP1 warns that it is "switching to use
NO_SHARD instead of ShardingStrategy.HYBRID_SHARD since the world size is 1" (the shard
group's) and then reduces each gradient over that one rank only: the replicate group's
all-reduce is never run, so each replica steps with its own rows' gradient
(docs/known-divergences.md, fault 18). Two gloo ranks on the CPU:
python docs/examples/fsdp1_hybrid_one_rank_shard_group.py
"""

import torch

from tpdp_verify import RankPool


def gradients(strategy: str) -> list[float]:
    """Each rank's gradient of one weight after a backward on its own rows, under FSDP1."""
    import warnings

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    from tpdp_verify.ranks.pool import device_mesh

    hybrid = strategy.startswith("HYBRID")
    mesh = device_mesh((2, 1), ("dp_replicate", "dp_shard")) if hybrid else device_mesh((2,), ("dp",))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the switch to NO_SHARD, above
        model = FSDP(nn.Linear(4, 1, bias=False), device_mesh=mesh, use_orig_params=True,
                     device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy[strategy])
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))[2 * dist.get_rank():][:2]  # this rank's rows
    model(x).square().mean().backward()
    with FSDP.summon_full_params(model, with_grads=True):
        return [float(model.module.weight.grad[0, 0])]


if __name__ == "__main__":
    with RankPool(2) as pool:
        for strategy in ("FULL_SHARD", "HYBRID_SHARD"):
            grads = [g[0] for g in pool.run(gradients, strategy)]
            agree = "the replicas agree" if grads[0] == grads[1] else "the replicas DISAGREE"
            print(f"{strategy}: rank 0's gradient {grads[0]:.6f}, rank 1's {grads[1]:.6f}: {agree}")
