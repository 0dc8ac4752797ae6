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
            grads[strategy] = model.module.weight.grad.tolist()
    return grads  # plain values: the rank exits once it answers


def describe(expected: tuple) -> str:
    return f"every replica's gradient = the global batch's, {fmt(expected[0])} (one device)"


def judge(expected: tuple, answers: list) -> tuple[str, bool]:
    answers = [{s: torch.tensor(g) for s, g in a.items()} for a in answers]
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
