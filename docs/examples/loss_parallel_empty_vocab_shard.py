"""torch 2.13: loss_parallel's cross entropy over a vocab that leaves a tp rank no columns
raises on that rank alone, while the others wait in a collective for it: a hang in a job.

A vocab of 5 sharded over 4 tp ranks (torch.chunk: 2, 2, 1, 0 columns) is what
``ColwiseParallel`` makes of an output head of 5 classes. The rank with no column raises
``RuntimeError: index 0 is out of bounds for dimension 1 with size 0`` in
``_nll_loss_forward``; ranks 0-2 wait in its all-reduce (docs/known-divergences.md,
fault 13). Four gloo ranks on the CPU: python docs/examples/loss_parallel_empty_vocab_shard.py
"""

import torch

from tpdp_verify import RankPool
from tpdp_verify.errors import RankFailed


def cross_entropy(vocab: int) -> float:
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from tpdp_verify.ranks.pool import device_mesh

    torch.manual_seed(0)
    logits = distribute_tensor(torch.randn(3, vocab), device_mesh((4,), ("tp",)), [Shard(1)])
    with loss_parallel():
        return F.cross_entropy(logits, torch.tensor([0, 1, 2])).full_tensor().item()


if __name__ == "__main__":
    with RankPool(4, timeout=60) as pool:
        print("vocab 8:", pool.run(cross_entropy, 8)[0])  # every rank holds 2 columns
        try:
            pool.run(cross_entropy, 5)
        except RankFailed as exc:
            print("vocab 5:", str(exc).splitlines()[0])
            print("  rank 3:", exc.tracebacks[3].strip().splitlines()[-1])
