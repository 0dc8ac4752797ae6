"""Fault 35 (torch 2.13.0): DCP cannot save a fused projection sharded per part over tp.

A fused projection (gate_up: two parts of rows concatenated) sharded per part over tp, as
public DTensor calls make it: the weight viewed (2, rows, cols), distribute_tensor on Shard(1),
flattened back. Each rank holds a block of each part (_StridedShard(0, split_factor=2)), and
full_tensor() gives the weight back. torch.distributed.checkpoint.save refuses it: "Failed to
validate global plan: key:w has overlapping chunks". DTensor.__create_chunk_list__
(torch/distributed/checkpoint/planner_helpers.py:_create_chunk_from_dtensor) describes each
rank's shard as one contiguous chunk, from compute_local_shape_and_global_offset, where it is
two blocks apart; the chunks then overlap. The same weight sharded contiguously (Shard(0))
saves. 2 ranks. Run: python f35_dcp_saves_a_per_part_shard_as_one_chunk.py
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
    """{layout: "saved and loaded back" or what DCP raised}, in a directory rank 0 makes."""
    shared = [tempfile.mkdtemp(prefix="f35-") if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    try:
        return saved_and_loaded(shared[0])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(shared[0], ignore_errors=True)


def saved_and_loaded(directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    w = torch.arange(PARTS * ROWS * COLS, dtype=torch.float32).view(PARTS * ROWS, COLS)
    layouts = {"contiguous (Shard(0))": distribute_tensor(w, mesh, [Shard(0)]),
               "per part": distribute_tensor(w.unflatten(0, (PARTS, ROWS)), mesh, [Shard(1)]).flatten(0, 1)}
    out = {}
    for name, t in layouts.items():
        path = os.path.join(directory, name.split()[0])
        assert torch.equal(t.full_tensor(), w)
        try:
            dcp.save({"w": t}, checkpoint_id=path)
            plain = {"w": torch.zeros_like(w)}
            dcp.load(plain, checkpoint_id=path)
            out[name] = "saved and loaded back" if torch.equal(plain["w"], w) else "saved, loaded back wrong"
        except (Exception, CheckpointException) as exc:
            out[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"
    return out


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = results[0][1]
    names = list(got)
    present = got[names[0]] == "saved and loaded back" and got[names[1]] != "saved and loaded back"
    print("expected: torch.distributed.checkpoint saves a DTensor and loads it back, whatever its layout")
    print("actual:   " + "; ".join(f"{name}: {said}" for name, said in got.items()))
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
