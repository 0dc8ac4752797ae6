"""Fault 21 (torch 2.13.0): HSDP with uneven TP shards lets the tp copies of a replicated parameter drift apart.

fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"]) all-reduces each tp rank's flat
gradient buffer over dp_replicate (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:
foreach_reduce, dist.all_reduce over all_reduce_group). With a width TP splits unevenly (7 =
4 + 3 over tp 2) the tp ranks' buffers differ in size, and a parameter TP keeps Replicate()
(a RowwiseParallel bias) sits at another offset in each; gloo sums an element's 4 values in
an order that depends on its place in the buffer, so the tp ranks' copies differ in the last
bit and then step apart. 8 ranks, a (4, 1, 2) mesh: 2 replicas sum exactly, 3 showed no
difference in 30 seeds. Run: python f21_hsdp_uneven_tp_replicas_drift.py
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

WORLD, TIMEOUT_S, GRACE_S = 8, 90, 5
REPLICAS, TP, HIDDEN = 4, 2, 7  # a (dp_replicate, dp_shard, tp) = (4, 1, 2) mesh; 7 = 4 + 3 over tp
SEEDS = range(30)  # the last bit differs for some data only


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 3), nn.Tanh(), nn.Linear(3, 3))


def rows(seed: int, replica: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(1000 * seed + replica))


def one_device() -> list:
    """The Rowwise layer's bias gradient for each seed: the mean over the replicas' rows."""
    grads = []
    for seed in SEEDS:
        model = build()
        for r in range(REPLICAS):
            (model(rows(seed, r)).pow(2).sum() / REPLICAS).backward()
        grads.append(model[2].bias.grad)
    return grads


def on_rank(rank: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (REPLICAS, 1, TP), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    plan = {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel(),
            "4": ColwiseParallel(output_layouts=Replicate())}
    grads = []
    for seed in SEEDS:
        model = parallelize_module(build(), mesh["tp"], plan)  # model[2].bias: Replicate() over tp
        fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])  # HSDP: all-reduce over dp_replicate
        model(rows(seed, mesh.get_local_rank("dp_replicate"))).pow(2).sum().backward()
        grads.append(model[2].bias.grad.to_local().tolist())  # this tp rank's copy
    return grads  # plain values: the rank exits once it answers


def describe(expected: list) -> str:
    return ("every tp rank holds the same copy of a Replicate() parameter's gradient (the Rowwise layer's bias), "
            "one device's to rounding")


def judge(expected: list, answers: list) -> tuple[str, bool]:
    answers = [[torch.tensor(g) for g in a] for a in answers]
    split = {}  # seed -> (replica, max difference between its tp ranks' copies)
    for i, seed in enumerate(SEEDS):
        for r in reversed(range(REPLICAS)):
            copies = [answers[r * TP + t][i] for t in range(TP)]
            if any(not torch.equal(c, copies[0]) for c in copies):
                split[seed] = (r, max((c - copies[0]).abs().max().item() for c in copies))
    if not split:
        return f"the copies agree for each of {len(SEEDS)} seeds", False
    seed, (r, diff) = next(iter(split.items()))
    i = SEEDS.index(seed)
    return (f"the copies differ for {len(split)} of {len(SEEDS)} seeds; seed {seed}, replica {r}: "
            f"tp rank 0 {fmt(answers[r * TP][i])}, tp rank 1 {fmt(answers[r * TP + 1][i])} (max difference "
            f"{diff:.3g}), one device {fmt(expected[i])}", True)


def fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.9g}" for v in t.tolist()) + "]"


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    actual, present = judge(expected, [value for _, value in results.values()])
    print(f"expected: {describe(expected)}")
    print(f"actual:   {actual}")
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
