"""torch 2.13: under loss_parallel(), log_softmax of vocab-sharded logits backpropagates as if
nll_loss came next: any other use of the log-probabilities gets wrong gradients, silently.

loss_parallel's handler for ``aten._log_softmax_backward_data`` returns the incoming
gradient unchanged (torch/distributed/tensor/parallel/loss.py, _log_softmax_backward_handler):
its nll_loss backward already produced the gradient of the fused cross entropy with respect
to the logits. A KL divergence to a teacher distribution, or any loss over the
log-probabilities that is not nll_loss, then gets the gradient with respect to the
log-probabilities as if it were the one with respect to the logits (docs/known-divergences.md,
fault 15). Cross entropy and nll_loss of the log-probabilities are right. Two gloo ranks on
the CPU: python docs/examples/loss_parallel_log_softmax_grad.py
"""

import torch

from tpdp_verify import RankPool


def max_gradient_error(loss: str) -> float:
    """The largest departure of the logits' gradient under loss_parallel from plain autograd's."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from tpdp_verify.ranks.pool import device_mesh

    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(3, 8, generator=gen, dtype=torch.float64), torch.tensor([0, 5, 2])
    teacher = torch.randn(3, 8, generator=gen, dtype=torch.float64).softmax(-1)
    mesh = device_mesh((2,), ("tp",))

    def value(x, t):
        lp = F.log_softmax(x, -1)
        return F.nll_loss(lp, target) if loss == "nll_loss" else F.kl_div(lp, t, reduction="batchmean")

    plain = logits.clone().requires_grad_()
    value(plain, teacher).backward()
    sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        got = value(sharded, distribute_tensor(teacher, mesh, [Shard(1)]))
        (got.full_tensor() if hasattr(got, "full_tensor") else got).backward()
    return (sharded.grad.full_tensor() - plain.grad).abs().max().item()


if __name__ == "__main__":
    with RankPool(2) as pool:
        for loss in ("nll_loss", "kl_div"):
            print(f"{loss}: the logits' gradient departs by {pool.run(max_gradient_error, loss)[0]:.3g}")
