"""torch 2.13: FSDP1 with NO_SHARD (the ZeRO stage that shards nothing) cannot train a TP'd
model: its first forward raises in the write-back of the parameters, where FULL_SHARD and
SHARD_GRAD_OP train, and where NO_SHARD trains the same model without TP
(docs/known-divergences.md, fault 20).

Four gloo ranks on the CPU, a (dp, tp) = (2, 2) mesh (on one dp rank FSDP1 switches every
strategy to NO_SHARD, with a warning, and each raises alike):
python docs/examples/fsdp1_no_shard_with_tp.py
"""

import torch

from tpdp_verify import RankPool


def train_one_step(strategy: str, tp: bool = True) -> str:
    """FSDP1 over a column-sharded Linear: a forward, a backward and a step; what happened."""
    import warnings

    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tpdp_verify.ranks.pool import device_mesh

    warnings.simplefilter("ignore")
    mesh = device_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8))
    if tp:
        model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    model = FSDP(model, device_mesh=mesh["dp"], use_orig_params=True, device_id=torch.device("cpu"),
                 sharding_strategy=ShardingStrategy[strategy])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stage = "the forward"
    try:
        loss = model(torch.ones(2, 4)).sum()
        stage = "the backward"
        loss.backward()
        stage = "the step"
        optimizer.step()
        stage = "the next forward"
        model(torch.ones(2, 4))
    except RuntimeError as exc:
        return f"{stage} raises {str(exc).splitlines()[0]}"
    return "trains"


if __name__ == "__main__":
    with RankPool(4) as pool:
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            print(f"{strategy}: {pool.run(train_one_step, strategy)[0]}")
        print(f"NO_SHARD without TP: {pool.run(train_one_step, 'NO_SHARD', False)[0]}")
