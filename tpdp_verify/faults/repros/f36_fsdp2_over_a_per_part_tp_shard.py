"""Fault 36 (torch 2.13.0): FSDP2 over a fused projection sharded per part on tp reads back wrong.

A fused projection (gate_up: two parts of rows concatenated) sharded per part over tp by public
DTensor calls (the weight viewed (2, rows, cols), distribute_tensor on Shard(1), flattened back:
_StridedShard(0, split_factor=2)) reads back right. fully_shard over dp then gives the parameter
the placements (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)): FSDP2's
torch/distributed/fsdp/_fully_shard/_fsdp_param.py:FSDPParam._init_sharding_spec_tp strides its
dp shard by the number of tp shards, as for a contiguous Shard(0) on tp, and the per-part
split of the tp shard is lost. full_tensor(), and so the state_dict a checkpoint saves, hold
the rows out of place. The same weight sharded contiguously (Shard(0)) reads back right under
FSDP2. 4 ranks, a (dp=2, tp=2) mesh. Run: python f36_fsdp2_over_a_per_part_tp_shard.py
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

WORLD, TIMEOUT_S, GRACE_S = 4, 60, 5
PARTS, ROWS, COLS = 2, 4, 2


def on_rank(rank: int) -> dict:
    """{layout: (full_tensor() is w before fully_shard, after it), the placements after}."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    w = torch.arange(PARTS * ROWS * COLS, dtype=torch.float32).view(PARTS * ROWS, COLS)
    layouts = {"contiguous (Shard(0))": lambda: distribute_tensor(w, mesh["tp"], [Shard(0)]),
               "per part": lambda: distribute_tensor(w.unflatten(0, (PARTS, ROWS)), mesh["tp"],
                                                     [Shard(1)]).flatten(0, 1)}
    out = {}
    for name, make in layouts.items():
        module = nn.Linear(COLS, PARTS * ROWS, bias=False)
        module.weight = nn.Parameter(make())
        before = torch.equal(module.weight.full_tensor(), w)
        fully_shard(module, mesh=mesh["dp"])
        out[name] = (before, torch.equal(module.weight.full_tensor(), w), str(tuple(module.weight.placements)))
    return out


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = results[0][1]
    (_, contiguous), (_, per_part) = got.items()
    present = all(contiguous[:2]) and per_part[0] and not per_part[1]
    print("expected: fully_shard over dp keeps what full_tensor() gives: w, before and after, whatever tp's layout")
    print("actual:   " + "; ".join(f"{name}: full_tensor() is w before {said[0]}, after {said[1]} ({said[2]})"
                                   for name, said in got.items()))
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
