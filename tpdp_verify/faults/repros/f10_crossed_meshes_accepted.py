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


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    return {entry: dp_over_tp(mesh, entry) for entry in ("fully_shard", "DDP", "replicate")}


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    results = {rank: value for rank, (_, value) in results.items()}

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
