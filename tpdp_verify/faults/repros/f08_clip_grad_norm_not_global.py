"""Fault 08 (torch 2.13.0): clip_grad_norm_ does not see the global norm.

Two gloo ranks, a (dp=1, tp=2) mesh; an MLP whose two Linears are Colwise/Rowwise and whose
third Linear the plan leaves alone, clipped with torch.nn.utils.clip_grad_norm_(model.parameters()):
1. DDP(device_mesh=mesh["dp"]): after a forward the TP parameters are not in parameters()
   (the forward hooks of torch/distributed/tensor/parallel/ddp.py, _reconstruct_dtensor and
   _localize_dtensor, leave DTensors outside the registry), so each rank clips by the norm of
   the plain layer alone and does not clip the TP gradients at all.
2. fully_shard(mesh=mesh["dp"]): the plain layer's parameters are DTensors on the 1-D dp mesh,
   the TP ones on the 2-D mesh, and _get_total_norm (torch/nn/utils/clip_grad.py) stacks their
   norms: "All operands in aten.stack.default must have the same mesh".
Run: python f08_clip_grad_norm_not_global.py
"""

import os
import socket
import sys
import traceback
import warnings
from datetime import timedelta
from time import monotonic, sleep

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5
MAX_NORM = 0.01  # always clips


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), nn.Linear(4, 4))


def tp_model(mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def whole(grad, param):
    """A gradient as one device holds it: a localized shard is put back together over tp."""
    from torch.distributed.tensor import DTensor

    if not hasattr(param, "_st_info"):  # a plain layer's gradient is whole on every rank
        return grad
    spec = param._st_info  # the layout DDP's TP transform recorded when it localized the parameter
    return DTensor.from_local(grad, spec.mesh, spec.placements, shape=spec.shape, stride=spec.stride).full_tensor()


def clip_under_ddp(mesh) -> tuple[float, int, list]:
    """(the norm clip_grad_norm_ returned, parameters it saw, the clipped gradients, whole)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(tp_model(mesh), device_mesh=mesh["dp"])
    handles = list(ddp.parameters())  # taken before the forward, when they are all registered
    ddp(torch.ones(2, 4)).sum().backward()
    seen = list(ddp.parameters())
    norm = nn.utils.clip_grad_norm_(seen, MAX_NORM).item()
    return norm, len(seen), [whole(p.grad, p) for p in handles]


def clip_under_fully_shard(mesh) -> str:
    from torch.distributed.fsdp import fully_shard

    sharded = fully_shard(tp_model(mesh), mesh=mesh["dp"])
    sharded(torch.ones(2, 4)).sum().backward()
    try:
        return f"{nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM).full_tensor().item():.4f}"
    except RuntimeError as exc:  # the fault: norms on two meshes
        if "same mesh" not in str(exc):
            raise
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}..."


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    one = model()
    one(torch.ones(2, 4)).sum().backward()
    one_norm = nn.utils.clip_grad_norm_(one.parameters(), MAX_NORM).item()
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    norm, seen, grads = clip_under_ddp(mesh)
    error = max((g - p.grad).abs().max().item() for g, p in zip(grads, one.parameters()))
    return {"one": one_norm, "count": len(list(one.parameters())), "ddp": (norm, seen, error),
            "fully_shard": clip_under_fully_shard(mesh)}


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    results = {rank: value for rank, (_, value) in results.items()}
    r = results[0]
    print(f"expected: clip_grad_norm_ returns one device's total norm {r['one']:.4f} over all {r['count']} "
          f"parameters and scales every gradient by {MAX_NORM}/{r['one']:.4f}, under DDP and fully_shard alike")
    ddp = "; ".join(f"rank {k} {v['ddp'][0]:.4f} over {v['ddp'][1]}" for k, v in sorted(results.items()))
    print(f"actual:   DDP + TP: {ddp} parameters, the clipped gradients off one device's by up to "
          f"{max(v['ddp'][2] for v in results.values()):.4f}; fully_shard + TP: {r['fully_shard']}")
    present = any(abs(v["ddp"][0] - v["one"]) > 1e-5 or v["ddp"][2] > 1e-6 or v["fully_shard"] != f"{v['one']:.4f}"
                  for v in results.values())
    print("fault present" if present else "fault absent")
    return int(present)


# --- boilerplate: WORLD gloo ranks on 127.0.0.1, each answering once; a timeout for hangs ------

def rank_main(rank, port, answers):
    warnings.filterwarnings("ignore")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on loopback too
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    try:
        answers.put((rank, "ok", on_rank(rank)))
    except Exception:
        answers.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def run_ranks() -> dict:
    """{rank: (status, value)}: status ok, error (a bug in this script), hung or aborted."""
    # forkserver: torch and the distributed packages the reproductions use imported once, by the
    # server the ranks are forked from (spawn imports them in each rank: seconds of CPU a rank)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor.parallel",
                                "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch._dynamo"])
    listener = socket.create_server(("127.0.0.1", 0))  # a free port, on loopback only
    port = listener.getsockname()[1]
    # The ranks' rendezvous, hosted here on the listener so that it listens on loopback only.
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach(), timeout=timedelta(seconds=TIMEOUT_S))
    answers = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_main, args=(r, port, answers), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {}, monotonic() + TIMEOUT_S
    while len(results) < WORLD and monotonic() < deadline:
        while not answers.empty():
            rank, status, value = answers.get()
            results[rank] = (status, value)
            if status != "ok":  # the others may wait for this rank: give them a grace only
                deadline = min(deadline, monotonic() + GRACE_S)
        for r, p in enumerate(procs):
            if r not in results and p.exitcode not in (None, 0) and answers.empty():
                results[r] = ("aborted", p.exitcode)
        sleep(0.05)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    del store  # kept until every rank is done with it
    return {r: results.get(r, ("hung", None)) for r in range(WORLD)}


def bail_out(results) -> int | None:
    """2 when a rank failed in a way that is not this fault (what each said, to stderr), else None.

    This fault neither raises out of on_rank nor hangs nor aborts a rank: any of those is
    a bug in this script or another fault.
    """
    failed = {r: (s, v) for r, (s, v) in results.items() if s != "ok"}
    for r, (status, value) in failed.items():
        detail = {"error": f":\n{value}", "aborted": f" (exit code {value})"}.get(status, "")
        print(f"rank {r} {status}{detail}", file=sys.stderr)
    return 2 if failed else None


if __name__ == "__main__":
    sys.exit(main())
