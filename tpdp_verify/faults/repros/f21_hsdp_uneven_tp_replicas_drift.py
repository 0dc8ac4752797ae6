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
import queue
import signal
import socket
import sys
import traceback
import warnings
from datetime import timedelta
from time import monotonic

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD, TIMEOUT_S, GRACE_S = 8, 90, 3
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
        grads.append(model[2].bias.grad.to_local().clone())  # this tp rank's copy
    return grads


def is_fault(exc: Exception) -> bool:
    return False  # the fault is silent: copies that differ in the last bit


def describe(expected: list) -> str:
    return ("every tp rank holds the same copy of a Replicate() parameter's gradient (the Rowwise layer's bias), "
            "one device's to rounding")


def judge(expected: list, answers: list) -> tuple[str, bool]:
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


# --- the same in every repro: gloo ranks on 127.0.0.1 answer once; a timeout catches hangs ------

def rank_main(rank, port, answers, done):
    warnings.filterwarnings("ignore")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = timedelta(seconds=TIMEOUT_S + 30)  # the parent calls a hang first
    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
        answers.put((rank, "ok", on_rank(rank)))
    except Exception as exc:
        if is_fault(exc):
            answers.put((rank, "raised", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"))
        else:
            answers.put((rank, "error", traceback.format_exc()))
    done.wait()  # stay in the group, as a job's rank would, until every rank has answered


def run_ranks() -> dict:
    """{rank: (status, value)}, status one of ok, raised (the fault), error, hung, aborted."""
    ctx = mp.get_context("spawn")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # a free port, on loopback only
    listener.listen(WORLD + 1)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach(), timeout=timedelta(seconds=TIMEOUT_S))
    answers, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=rank_main, args=(r, port, answers, done)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {}, monotonic() + TIMEOUT_S
    while len(results) < WORLD and monotonic() < deadline:
        try:
            rank, status, value = answers.get(timeout=0.2)
        except queue.Empty:
            results.update({r: ("aborted", p.exitcode) for r, p in enumerate(procs)
                            if r not in results and p.exitcode not in (None, 0)})
            continue
        results[rank] = (status, value)
        if status != "ok":  # the others may be waiting for this rank: a grace, not the timeout
            deadline = min(deadline, monotonic() + GRACE_S)
    done.set()
    for r, p in enumerate(procs):
        p.join(timeout=5 if r in results else 0)
        if p.is_alive():
            p.kill()
            p.join()
    del store
    return {r: results.get(r, ("hung", None)) for r in range(WORLD)}


def failures(results: dict) -> str:
    """The ranks that raised the fault, aborted or hung (and what the others then raised), in words."""
    said = {}
    for kind in ("raised", "aborted", "hung", "error"):
        for r, (status, value) in results.items():
            if status == kind == "raised":
                said.setdefault(f"raised {value}", []).append(r)
            elif status == kind == "aborted":
                name = signal.Signals(-value).name if value < 0 else f"exit code {value}"
                said.setdefault(f"aborted with {name}", []).append(r)
            elif status == kind == "hung":
                said.setdefault("hung (no answer; killed)", []).append(r)
            elif status == kind == "error":
                said.setdefault(f"then raised {value.strip().splitlines()[-1]}", []).append(r)
    return "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {what}" for what, rs in said.items())


def main() -> int:
    expected = one_device()
    results = run_ranks()
    statuses = {status for status, _ in results.values()}
    if "error" in statuses and not statuses & {"raised", "aborted"}:  # a bug in this script, not the fault
        print(next(value for status, value in results.values() if status == "error"), file=sys.stderr)
        return 2
    actual = failures(results)
    present = bool(actual)
    if not present:
        actual, present = judge(expected, [value for _, value in results.values()])
    print(f"expected: {describe(expected)}")
    print(f"actual:   {actual}")
    print("fault present" if present else "fault absent")
    return int(present)


if __name__ == "__main__":
    sys.exit(main())
