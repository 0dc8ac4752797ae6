"""torch 2.13: with TP, FSDP1 trains nothing an optimizer built before wrapping holds.

FSDP1 with use_orig_params=True keeps the user's parameters, so an optimizer built on the
model before wrapping trains it: plain FSDP1 does. With TP the parameters are DTensors, and
after wrapping the model holds others, rebuilt from FSDP1's flat shards by its TP extension
(DTensorExtensions): the optimizer's DTensors get no gradient, and a step moves nothing the
model computes with (docs/known-divergences.md, fault 12). Four gloo ranks on the CPU:
python docs/examples/fsdp1_optimizer_before_wrap.py
"""

import torch

from tpdp_verify import RankPool


def one_step(tp: bool) -> tuple[int, int, int]:
    """On this rank: (parameters the model computes with that a step moved, parameters the
    optimizer holds that got a gradient, parameters it holds)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from tpdp_verify.fixtures import models, plans
    from tpdp_verify.ranks.pool import device_mesh

    torch.manual_seed(0)
    model, mesh = models.MLP(4, 8), device_mesh((2, 2), ("dp", "tp"))
    if tp:
        parallelize_module(model, mesh["tp"], plans.mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # before wrapping
    held = list(optimizer.param_groups[0]["params"])
    fsdp = FSDP(model, device_mesh=mesh["dp"] if tp else device_mesh((4,), ("dp",)),
                use_orig_params=True, device_id=torch.device("cpu"))
    local = lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    before = [local(p) for p in fsdp.parameters()]
    fsdp(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    moved = sum(not torch.equal(local(a), b) for a, b in zip(fsdp.parameters(), before))
    graded = sum(p.grad is not None for p in held)
    return moved, graded, len(held)


if __name__ == "__main__":
    with RankPool(4) as pool:
        for name, tp in (("plain FSDP1", False), ("FSDP1 + TP ", True)):
            moved, graded, held = (sum(x) for x in zip(*pool.run(one_step, tp)))
            print(f"{name}: a step moved {moved} local parameters over 4 ranks; "
                  f"{graded} of the {held} the optimizer holds got a gradient")
