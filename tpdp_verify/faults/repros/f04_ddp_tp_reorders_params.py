"""Fault 04 (torch 2.13.0): A replaced parameter moves to the end of the registration order.

DistributedDataParallel(model, device_mesh=mesh["dp"]) swaps each DTensor parameter for its
local shard in torch/distributed/tensor/parallel/ddp.py:_update_module_param by delattr then
setattr, which registers it again, last in its module. A module holding a DTensor parameter
before a plain one changes the order of named_parameters(), parameters() and state_dict(), so
whatever pairs parameters by position (optimizer.state_dict() ids) pairs the wrong ones.
replicate() localizes through the same function. 2 ranks, a (dp=1, tp=2) mesh.
Run: python f04_ddp_tp_reorders_params.py
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


class ScaledProjection(nn.Module):
    """A projection and a learned temperature: TP shards the projection, not the scalar."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(8, 4))
        self.temperature = nn.Parameter(torch.ones(()))


def one_device() -> list:
    return [n for n, _ in ScaledProjection().named_parameters()]


def on_rank(rank: int) -> tuple[list, list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    tp = ScaledProjection()
    # TP by hand: shard the projection's rows, leave the scalar a plain parameter
    # (parallelize_module and distribute_module would make it a Replicate() DTensor too).
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh["tp"], [Shard(0)]))
    before = [n for n, _ in tp.named_parameters()]
    DDP(tp, device_mesh=mesh["dp"])  # runs _pre_dp_module_transform(tp)
    return before, [n for n, _ in tp.named_parameters()]


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    before, after = results[0][1]
    print(f"expected: named_parameters() = {expected} (one device; after TP: {before})")
    print(f"actual:   named_parameters() after DDP wraps = {after} (rank 0 of {WORLD})")
    present = any(a != expected for _, (_, a) in results.values())
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
