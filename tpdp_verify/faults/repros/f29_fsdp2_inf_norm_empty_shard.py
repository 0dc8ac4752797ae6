"""Fault 29 (torch 2.13.0): clip_grad_norm_(norm_type=inf) raises on a rank whose FSDP2 shard is empty; the others hang.

fully_shard splits each parameter's dim 0 like torch.chunk over the dp ranks: a dim smaller than
the dp degree (here nn.Linear(1, 1) on 2 ranks) leaves the last ranks empty shards ([0, 1] weight,
[0] bias). For the inf (and -inf) norm, DTensor computes the norm of each local shard and marks it
Partial("max") (torch/distributed/tensor/_ops/_math_ops.py: _get_norm_reduction_op, used by
foreach_norm_strategy and vector_norm_strategy): the local aten._foreach_norm (or
linalg.vector_norm, foreach=False) of an empty shard raises RuntimeError "_foreach_norm cannot
compute the infinity norm on an empty tensor" on that rank, in torch.nn.utils.clip_grad:
_get_total_norm (get_total_norm raises the same), while the ranks with data wait in the
all-reduce of _clip_grads_with_norm_ until that rank's exit breaks their connection (gloo; here)
or the collective times out. The 2-norm and the 1-norm work (_NormPartial: an empty shard's norm
is 0). TP plays no part: a TP model under fully_shard(mesh["dp"]) on a (dp=2, tp=2) mesh raises
the same on dp rank 1's ranks. 2 ranks, a (dp=2) mesh. Run: python f29_fsdp2_inf_norm_empty_shard.py
"""

import os
import re
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
MAX_NORM, INF = 1.0, float("inf")  # Linear(1, 1) over dp 2: rank 1's weight and bias shards are empty
FAULT = "cannot compute the infinity norm on an empty tensor"


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1, 1)


def backward(m: nn.Module) -> None:
    m(torch.ones(2, 1)).pow(2).sum().backward()  # one backward on a fixed batch


def one_device() -> float:
    m = model()
    backward(m)
    return round(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, norm_type=INF).item(), 4)


def on_rank(rank: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    m = model()
    fully_shard(m, mesh=mesh)
    backward(m)
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM, norm_type=INF)  # the fault raises here
    return round(norm.full_tensor().item(), 4)


def last_line(tb: str) -> str:
    return re.sub(r"\[/\S*\] ", "", tb.strip().splitlines()[-1])  # without gloo's source path


def main() -> int:
    expected = one_device()
    results = run_ranks()
    raised = {r: last_line(v) for r, (s, v) in results.items() if s == "error" and FAULT in v}
    if not raised and (code := bail_out(results)) is not None:  # no fault: any failure is this script's
        return code
    print(f"expected: clip_grad_norm_(nn.Linear(1, 1).parameters(), {MAX_NORM}, norm_type=inf) = {expected} "
          f"(one device)")
    if raised:
        said = {f"raised {m}": [r] for r, m in raised.items()}
        for r, (status, value) in results.items():  # the others: waiting on it, or failing once it left
            if r not in raised:
                what = f"then raised {last_line(value).split(' [')[0]} (in the all-reduce)" if status == "error" else \
                    "hung in the all-reduce (killed)" if status == "hung" else status
                said.setdefault(what, []).append(r)
        print(f"actual:   clip_grad_norm_(norm_type=inf) under fully_shard on {WORLD} dp ranks: "
              + "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {what}" for what, rs in said.items()))
    else:
        print(f"actual:   clip_grad_norm_(norm_type=inf) under fully_shard on {WORLD} dp ranks = "
              f"{', '.join(str(v) for _, v in results.values())}")
    present = bool(raised) or any(v != expected for _, v in results.values())
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
