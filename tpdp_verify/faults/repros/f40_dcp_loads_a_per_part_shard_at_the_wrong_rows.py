"""Fault 40 (torch 2.13.0): DCP loads a checkpoint onto a fused projection sharded per part
over tp at the wrong rows, silently.

A fused projection (gate_up: two parts of rows concatenated) sharded per part over tp, as
public DTensor calls make it: the weight viewed (2, rows, cols), distribute_tensor on Shard(1),
flattened back; each rank holds a block of each part (_StridedShard(0, split_factor=2)). A
checkpoint of the weight saved by torch.distributed.checkpoint from a contiguous layout
(Shard(0), which DCP saves) loads onto it with no error and wrong values: the load plans its
reads from the chunks the target describes, and DTensor.__create_chunk_list__
(planner_helpers.py:_create_chunk_from_dtensor, from compute_local_shape_and_global_offset)
describes each rank's blocks as one contiguous run of rows at its first block's offset, so a
rank reads the rows after that block instead of its block of the next part (fault 35's
chunks, on the load: there nothing validates them). Loaded onto the contiguous layout, the
same checkpoint is right. 2 ranks. Run: python f40_dcp_loads_a_per_part_shard_at_the_wrong_rows.py
"""

import os
import shutil
import socket
import sys
import tempfile
import traceback
import warnings
from datetime import timedelta
from time import monotonic, sleep

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5
PARTS, ROWS, COLS = 2, 4, 3


def on_rank(rank: int) -> dict:
    """{layout: how many values of the weight loaded onto it are wrong}, the checkpoint in a
    directory rank 0 makes."""
    shared = [tempfile.mkdtemp(prefix="f40-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    try:
        return loaded(shared[0])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(shared[0], ignore_errors=True)


def loaded(directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    w = torch.arange(PARTS * ROWS * COLS, dtype=torch.float32).view(PARTS * ROWS, COLS)
    dcp.save({"w": distribute_tensor(w, mesh, [Shard(0)])}, checkpoint_id=directory)
    zeros = torch.zeros_like(w)
    targets = {"contiguous (Shard(0))": distribute_tensor(zeros, mesh, [Shard(0)]),
               "per part": distribute_tensor(zeros.unflatten(0, (PARTS, ROWS)), mesh, [Shard(1)]).flatten(0, 1)}
    out = {}
    for name, t in targets.items():
        state = {"w": t}
        dcp.load(state, checkpoint_id=directory)
        out[name] = int((state["w"].full_tensor() != w).sum())
    return out


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = results[0][1]
    contiguous, per_part = got.values()
    present = contiguous == 0 and per_part > 0
    print(f"expected: a DCP checkpoint of a {PARTS * ROWS}x{COLS} weight loads onto each layout with every value right")
    print("actual:   " + "; ".join(f"{name}: {wrong} values wrong" for name, wrong in got.items()))
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
