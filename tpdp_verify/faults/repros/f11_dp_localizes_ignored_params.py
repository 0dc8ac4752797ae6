"""Fault 11 (torch 2.13.0): DDP with TP, and replicate(), localize what they are told to ignore.

A module kept out of DP should stay the DTensor TP made it. DistributedDataParallel(model,
device_mesh=mesh["dp"]) calls torch/distributed/tensor/parallel/ddp.py:_pre_dp_module_transform,
whose _localize_dtensor(module, None, None) never sees DDP's ignore list
(_ddp_params_and_buffers_to_ignore): the ignored DTensor becomes its local shard at wrapping.
torch.distributed._composable.replicate passes its ignored parameters to _localize_dtensor at
wrapping, but its forward hook (register_forward_hook(_localize_dtensor)) has none: localized
after the first forward. 2 ranks, a (dp=1, tp=2) mesh. Run: python f11_dp_localizes_ignored_params.py
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


def describe(t: torch.Tensor) -> str:
    return f"{type(t).__name__} {list(t.shape)}"  # a DTensor's shape is the global one


def on_rank(rank: int) -> dict:
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))

    def tp_model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        return parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})

    ddp = tp_model()
    seen = {"before wrapping": describe(ddp[0].weight)}
    DDP._set_params_and_buffers_to_ignore_for_model(ddp, ["0.weight", "0.bias"])
    DDP(ddp, device_mesh=mesh["dp"])
    seen["DDP, after wrapping"] = describe(ddp[0].weight)

    rep = tp_model()
    replicate(rep, device_mesh=mesh["dp"], ignored_modules=[rep[0]])
    seen["replicate, after wrapping"] = describe(rep[0].weight)
    rep(torch.randn(3, 4)).sum().backward()  # one training step's forward and backward
    seen["replicate, after a forward"] = describe(rep[0].weight)
    return seen


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    seen = results[0][1]
    left = seen.pop("before wrapping")
    print(f"expected: the ignored 0.weight stays the {left} TP made it, under DDP and replicate, "
          f"before and after a forward")
    print(f"actual:   ignored 0.weight is a {'; '.join(f'{v} ({k})' for k, v in seen.items())} "
          f"(rank 0 of {WORLD})")
    present = any(v != left for _, answer in results.values() for v in answer.values())
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
