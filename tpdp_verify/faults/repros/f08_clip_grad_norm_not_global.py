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

import datetime
import os
import signal
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD, TIMEOUT = 2, 60
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


def on_rank(rank: int, send) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    one = model()
    one(torch.ones(2, 4)).sum().backward()
    one_norm = nn.utils.clip_grad_norm_(one.parameters(), MAX_NORM).item()
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    norm, seen, grads = clip_under_ddp(mesh)
    error = max((g - p.grad).abs().max().item() for g, p in zip(grads, one.parameters()))
    send("one", one_norm)
    send("count", len(list(one.parameters())))
    send("ddp", (norm, seen, error))
    send("fully_shard", clip_under_fully_shard(mesh))


# --- boilerplate: gloo ranks on loopback, joined with a timeout --------------------------

def rank_entry(rank: int, port: int, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo listens on loopback only
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    # on_rank sends plain values (no tensors) as it goes; an exception it lets out is a bug of this file
    on_rank(rank, lambda key, value: queue.put((rank, key, value)))
    queue.put((rank, "done", True))
    dist.destroy_process_group()


def launch() -> tuple[dict, dict]:
    """Run on_rank on WORLD ranks: ({rank: {key: value}}, {rank: 'hung' | 'aborted with SIG..' | 'raised'}),
    the second for ranks that did not finish on_rank."""
    listener = socket.create_server(("127.0.0.1", 0))  # a free port, loopback only
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], WORLD + 1, is_master=True,
                          wait_for_workers=False, master_listen_fd=listener.detach())
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_entry, args=(r, store.port, queue), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {r: {} for r in range(WORLD)}, time.monotonic() + TIMEOUT

    def drain():
        while not queue.empty():
            rank, key, value = queue.get()
            results[rank][key] = value

    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        drain()
        if any(p.exitcode for p in procs) or all("done" in r for r in results.values()):
            deadline = min(deadline, time.monotonic() + 5)  # a rank died, or all finished: 5 s more
        time.sleep(0.05)
    drain()
    failed = {}
    for rank, p in enumerate(procs):
        if p.exitcode is None:
            failed[rank] = "hung"
            p.kill()
            p.join()
        elif p.exitcode != 0:
            failed[rank] = f"aborted with {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else "raised"
        if results[rank].pop("done", False) and rank in failed:  # in teardown, after its work: not ours
            print(f"note: rank {rank} {failed.pop(rank)} after finishing on_rank", file=sys.stderr)
    return results, failed


def main() -> int:
    results, failed = launch()
    if failed:
        print(f"repro error: ranks {failed} (see stderr)", file=sys.stderr)
        return 2
    r = results[0]
    print(f"expected: clip_grad_norm_ returns one device's total norm {r['one']:.4f} over all {r['count']} "
          f"parameters and scales every gradient by {MAX_NORM}/{r['one']:.4f}, under DDP and fully_shard alike")
    ddp = "; ".join(f"rank {k} {v['ddp'][0]:.4f} over {v['ddp'][1]}" for k, v in sorted(results.items()))
    print(f"actual:   DDP + TP: {ddp} parameters, the clipped gradients off one device's by up to "
          f"{max(v['ddp'][2] for v in results.values()):.4f}; fully_shard + TP: {r['fully_shard']}")
    present = any(abs(v["ddp"][0] - v["one"]) > 1e-5 or v["ddp"][2] > 1e-6 or v["fully_shard"] != f"{v['one']:.4f}"
                  for v in results.values())
    print("fault present" if present else "fault absent")
    return 1 if present else 0


if __name__ == "__main__":
    sys.exit(main())
