"""Fault 37 (torch 2.13.0): a fused weight of one-row, one-column parts, sharded per part, gets shards of the wrong shape.

A fused projection sharded per part over tp by public DTensor calls: the weight viewed
(parts, rows, cols), distribute_tensor on Shard(1), flattened back. Where each part is one row
of one column, (2, 1, 1), the rank that holds no row of a part should hold a (0, 1) shard. The
flatten's sharding propagation (torch/distributed/tensor/_ops/_view_ops.py) gives it a (2, 0)
one instead: the DTensor's shape says (2, 1) while its shards do not tile it, and FSDP2's
gathers over it hang. With two columns or more, the same view is refused ("This operation
would remove or reshape sharded dimension"); with two rows or more, it is right. 2 ranks.
Run: python f37_view_of_parts_of_one_row.py
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

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5
PARTS = 2


def on_rank(rank: int) -> dict:
    """{rows: (this rank's shard's shape, the shape its block of each part has)}, one column."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    out = {}
    for rows in (1, 2):
        w = torch.arange(PARTS * rows, dtype=torch.float32).view(PARTS * rows, 1)
        t = distribute_tensor(w.unflatten(0, (PARTS, rows)), mesh, [Shard(1)]).flatten(0, 1)
        blocks = [torch.chunk(part, WORLD)[rank] if rank < len(torch.chunk(part, WORLD)) else part[:0]
                  for part in w.unflatten(0, (PARTS, rows))]
        out[rows] = (tuple(t.to_local().shape), tuple(torch.cat(blocks).shape))
    return out


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = {rank: value for rank, (_, value) in results.items()}
    wrong = {rank: said[1] for rank, said in got.items() if said[1][0] != said[1][1]}
    present = bool(wrong) and all(said[2][0] == said[2][1] for said in got.values())
    print("expected: each rank's shard has the shape of its block of each part (two one-row parts over 2 ranks: "
          "(2, 1) on rank 0, (0, 1) on rank 1)")
    print("actual:   " + "; ".join(f"rank {rank}: {said[1][0]} where {said[1][1]} is right"
                                   for rank, said in sorted(got.items())))
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
