"""Fault 10 (torch 2.13.0): crossed meshes torch accepts.

A user hands DP the tp sub-mesh: DistributedDataParallel(model, device_mesh=mesh["tp"]), or
replicate(model, device_mesh=mesh["tp"]), for a model TP'd over that same mesh["tp"].
fully_shard refuses it ("Cannot concatenate overlapping meshes"); DDP.__init__
(torch/nn/parallel/distributed.py) checks only that the mesh is 1-D and sliced from a root,
runs _pre_dp_module_transform, and its initial _sync_module_states broadcasts tp rank 0's
shards over the other tp ranks' (replicate does the same in its lazy init). The model is wrong
before the first step and each step averages different shards. Two gloo ranks, a (dp=1,
tp=2) mesh. Run: python f10_crossed_meshes_accepted.py
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
X = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))  # the same batch on every rank


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))


def tp_mlp(mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def dp_over_tp(mesh, entry: str) -> dict:
    """DP given mesh["tp"]: refused, or how far its shard of 0.weight and its output are off."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tp_mlp(mesh)
    own = model[0].weight.to_local().detach().clone()
    wrap = {"DDP": lambda m: DDP(m, device_mesh=mesh["tp"]),
            "replicate": lambda m: replicate(m, device_mesh=mesh["tp"]),
            "fully_shard": lambda m: fully_shard(m, mesh=mesh["tp"])}
    try:
        model = wrap[entry](model)
    except (RuntimeError, ValueError) as exc:  # a refusal: what a correct torch does
        return {"refused": f"{type(exc).__name__}: {str(exc).split(': [')[0][:60]}"}
    out = model(X)  # replicate broadcasts in its first forward
    weight = getattr(model, "module", model)[0].weight  # a DTensor again after the forward (fault 1)
    shard = weight.to_local() if isinstance(weight, DTensor) else weight
    return {"shard": (shard.detach() - own).abs().max().item(), "output": (out - mlp()(X)).abs().max().item()}


def on_rank(rank: int, send) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    for entry in ("fully_shard", "DDP", "replicate"):
        send(entry, dp_over_tp(mesh, entry))


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

    def said(entry):
        r = [results[k][entry] for k in sorted(results)]
        if "refused" in r[0]:
            return f"refused ({r[0]['refused']})"
        shard = ", ".join(f"rank {k} {v['shard']:.3g}" for k, v in enumerate(r))
        output = max(v["output"] for v in r)
        return f"accepted, 0.weight's shard off its own by {shard}, output off one device's by {output:.3g}"

    print(f"expected: DP given the mesh TP uses is refused, as fully_shard is: {said('fully_shard')}; "
          f"or the model computes one device's output")
    print(f"actual:   DDP(device_mesh=mesh['tp']): {said('DDP')}; "
          f"replicate(device_mesh=mesh['tp']): {said('replicate')}")
    present = any("refused" not in v[entry] and v[entry]["output"] > 1e-5
                  for v in results.values() for entry in ("DDP", "replicate"))
    print("fault present" if present else "fault absent")
    return 1 if present else 0


if __name__ == "__main__":
    sys.exit(main())
