"""Fault 02 (torch 2.13.0): Frozen TP parameters become trainable.

DistributedDataParallel(model, device_mesh=mesh["dp"]) localizes each DTensor parameter in
torch/distributed/tensor/parallel/ddp.py:_localize_dtensor: _data_parallel_utils.py:
_flatten_tensor calls tensor._local_tensor.requires_grad_() on every DTensor, frozen or not,
and the shard is wrapped in nn.Parameter(t) (requires_grad=True by default). A layer frozen
with requires_grad_(False) comes back trainable, and an optimizer over the parameters that
require grad moves it. replicate() and FSDP1's DTensorExtensions use the same functions.
2 ranks, a (dp=1, tp=2) mesh. Run: python f02_ddp_tp_thaws_frozen_params.py
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


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def flags(m: nn.Module) -> dict:
    return {n: p.requires_grad for n, p in m.named_parameters()}


def step_moves_frozen(m: nn.Module, frozen: torch.Tensor, forward) -> float:
    """One SGD step over the parameters that require grad: how far the frozen weight moved."""
    before = frozen.detach().clone()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    forward(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
    opt.step()
    return (frozen.detach() - before).abs().max().item()


def one_device() -> tuple[dict, float]:
    m = model()
    m[0].requires_grad_(False)
    return flags(m), step_moves_frozen(m, m[0].weight, m)


def on_rank(rank: int) -> tuple[dict, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    tp = parallelize_module(model(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    tp[0].requires_grad_(False)  # frozen after TP, so TP's own handling plays no part
    ddp = DDP(tp, device_mesh=mesh["dp"])  # runs _pre_dp_module_transform(tp)
    got = flags(tp)  # read before a forward: after one the TP parameters leave the registry (fault 1)
    return got, step_moves_frozen(tp, tp[0].weight, ddp)


def main() -> int:
    expected, still = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got, moved = results[0][1]
    print(f"expected: requires_grad = {expected}; frozen 0.weight moves {still:g} in an SGD step "
          f"(one device)")
    print(f"actual:   requires_grad after DDP wraps = {got}; frozen 0.weight moved {moved:.4g} "
          f"in an SGD step over the parameters requiring grad (rank 0 of {WORLD})")
    present = any(g != expected or m != 0 for _, (g, m) in results.values())
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
