"""Fault 30 (torch 2.13.0): clip_grad_norm_(norm_type=inf) under FSDP2 returns a total norm whose .item() is each rank's own.

For the inf norm DTensor marks each shard's norm Partial("max") (torch/distributed/tensor/_ops/
_math_ops.py: _get_norm_reduction_op), and the max of maxima that torch.nn.utils.clip_grad:
_get_total_norm takes next (linalg.vector_norm over the stacked norms) stays Partial("max"):
clip_grad_norm_ and get_total_norm return a DTensor that was never reduced. The clipping is
right (the clip coefficient's division reduces it), but .item(), as users log the norm (or
compare it with a threshold to skip a step), is the max of the rank's own shards: each rank
reads another number, none of them the total unless it holds the largest entry. The 2-norm and
the 1-norm come back Replicate. TP plays no part: any DTensor gradient sharded over ranks does
it. 2 ranks, a (dp=2) mesh, nn.Linear(2, 4) (each rank two rows). Run: python f30_max_norm_read_per_rank.py
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
MAX_NORM, INF = 1e-2, float("inf")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(2, 4)


def backward(m: nn.Module) -> None:
    m(torch.arange(4.0).reshape(2, 2)).pow(2).sum().backward()  # one backward on a fixed batch


def one_device() -> float:
    m = model()
    backward(m)
    return round(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, norm_type=INF).item(), 4)


def on_rank(rank: int) -> tuple[float, float, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    m = model()
    fully_shard(m, mesh=mesh)
    backward(m)
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, norm_type=INF)
    return round(norm.item(), 4), round(norm.full_tensor().item(), 4), str(norm.placements)


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    print(f"expected: clip_grad_norm_(nn.Linear(2, 4).parameters(), {MAX_NORM}, norm_type=inf).item() = {expected} "
          f"(one device), on every rank")
    print(f"actual:   under fully_shard on {WORLD} dp ranks, "
          + "; ".join(f"rank {r}: .item() = {item}, .full_tensor().item() = {whole}, placements {placements}"
                      for r, (_, (item, whole, placements)) in sorted(results.items())))
    present = any(item != expected for _, (item, _, _) in results.values())
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
