"""Fault 39 (torch 2.13.0): the optimizer's in-place step raises on a DTensor with fewer rows than ranks.

A parameter sharded Shard(0) over 4 ranks with 3 or 2 rows (as TP over 4 ranks shards a width
of 2 or 3) runs its forward and backward, and its gradient is Shard(0) like it. The optimizer's
step then raises on every rank: SGD's param.add_(grad) and Adam's exp_avg.lerp_(grad) are
in-place pointwise ops, and DTensor's sharding propagation keeps no strategy with Shard(0) on a
dim smaller than the mesh dim ("in-place operations that require placement changes are not
supported"). With 4 rows, and with 5 (where torch.chunk leaves rank 3 none too), the same
steps train. 4 ranks. Run: python f39_inplace_step_on_fewer_rows_than_ranks.py
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
STEPS, RAISES = (4, 5), (3, 2)  # rows: at least a row a rank; fewer rows than ranks
ROWS = STEPS + RAISES
OPTIMIZERS = ("SGD", "Adam")


def on_rank(rank: int) -> dict:
    """{(rows, optimizer): None where the step ran, else what it raised}."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    out = {}
    for rows in ROWS:
        for name in OPTIMIZERS:
            torch.manual_seed(0)
            weight = nn.Parameter(distribute_tensor(torch.randn(rows, 3), mesh, (Shard(0),)))
            x = distribute_tensor(torch.randn(5, 3), mesh, (Replicate(),))
            optimizer = getattr(torch.optim, name)([weight], lr=0.1)
            (x @ weight.t()).sum().backward()
            try:
                optimizer.step()
                out[(rows, name)] = None
            except RuntimeError as e:
                out[(rows, name)] = str(e).splitlines()[0][:160]
    return out


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = results[0][1]
    present = all(got[(rows, n)] is None for rows in STEPS for n in OPTIMIZERS) and all(
        got[(rows, n)] and "in-place operations that require placement changes" in got[(rows, n)]
        for rows in RAISES for n in OPTIMIZERS)
    print("expected: the optimizer steps a parameter sharded over 4 ranks whatever its rows, as it steps the "
          "unsharded one")
    for (rows, name), raised in got.items():
        print(f"actual:   {rows} rows, {name}: {'stepped' if raised is None else 'raised ' + raised}")
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
