"""Fault 18 (torch 2.13.0): FSDP1's hybrid strategies with a shard group of one rank never synchronize the replicas.

FSDP1 with HYBRID_SHARD or _HYBRID_SHARD_ZERO2 on a (dp_replicate, dp_shard) = (2, 1) device
mesh warns "FSDP is switching to use NO_SHARD ... since the world size is 1" (the shard
group's; torch/distributed/fsdp/_init_utils.py:_init_core_state). The NO_SHARD reduction,
torch/distributed/fsdp/_runtime_utils.py:_reduce_grad_no_shard, then all-reduces over
state.process_group, the one-rank shard group, and never over the replicate group
(_inter_node_pg), though it divides by both groups' size: each replica steps with its own
rows' gradient, halved. No TP is needed. Run: python f18_fsdp1_hybrid_one_rank_shard_group.py
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

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 3
STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, 4, generator=gen), torch.randn(2 * WORLD, 4, generator=gen)  # weight, global batch


def gradient(rows: torch.Tensor) -> torch.Tensor:
    weight = data()[0].requires_grad_()
    (rows @ weight.T).square().mean().backward()
    return weight.grad


def one_device() -> tuple[torch.Tensor, list]:
    """The global batch's gradient, and each replica's own rows' (to name what the ranks got)."""
    batch = data()[1]
    return gradient(batch), [gradient(rows) for rows in batch.chunk(WORLD)]


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    grads = {}
    for strategy in STRATEGIES:
        weight, batch = data()
        model = nn.Linear(4, 1, bias=False)
        model.weight = nn.Parameter(weight)
        model = FSDP(model, device_mesh=mesh, sharding_strategy=ShardingStrategy[strategy],
                     use_orig_params=True, device_id=torch.device("cpu"))  # warns: "switching to NO_SHARD"
        model(batch.chunk(WORLD)[rank]).square().mean().backward()  # this replica's rows
        with FSDP.summon_full_params(model, with_grads=True):
            grads[strategy] = model.module.weight.grad.clone()
    return grads


def is_fault(exc: Exception) -> bool:
    return False  # the fault is silent: replicas that never synchronize


def describe(expected: tuple) -> str:
    return f"every replica's gradient = the global batch's, {fmt(expected[0])} (one device)"


def judge(expected: tuple, answers: list) -> tuple[str, bool]:
    said, present = [], False
    for strategy in STRATEGIES:
        grads = [a[strategy] for a in answers]
        present |= any(not torch.allclose(g, expected[0], atol=1e-6) for g in grads)
        said.append(f"{strategy} on a (2, 1) mesh: " + ", ".join(f"rank {r} {fmt(g)}" for r, g in enumerate(grads)))
    own = all(torch.allclose(a[s], mine / WORLD, atol=1e-6)  # a replica's rows alone, divided by the dp size
              for a, mine in zip(answers, expected[1]) for s in STRATEGIES)
    return "; ".join(said) + f" (each its own rows' gradient / {WORLD}: never all-reduced)" * own, present


def fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.5f}" for v in t.flatten().tolist()) + "]"


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
