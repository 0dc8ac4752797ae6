"""Fault 34 (torch 2.13.0): a nested, uneven shard gathers wrong once its mesh dims were flattened.

A tensor whose dim 0 is sharded over two mesh dims, Shard(0), Shard(0), and does not divide
over both (2 rows on a 2 x 2 mesh, 6 on it) reads back right by full_tensor(),
redistribute(Replicate()) and get_model_state_dict(full_state_dict=True). Once the submesh of
those two dims has been flattened, as HSDP, fully_shard(mesh, dp_mesh_dims=...) over two dp dims
and any flattened dp group do, torch/distributed/tensor/_redistribute.py:_optimize_transform_infos
merges the two all-gathers into one over the flattened mesh. It pads and unpads as for one
Shard(0) over 4 ranks, whose chunk sizes are not the nested ones, and the values come back
misplaced, with zeros in the holes. It checks that a merged reduce-scatter divides evenly;
not a merged all-gather. 4 ranks. Run: python f34_nested_uneven_gather_over_flattened_mesh.py
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
ROWS = (2, 6)  # dim 0's sizes: neither splits over the two mesh dims as chunks of chunks


def on_rank(rank: int) -> dict:
    """{(rows, flattened): (full_tensor(), redistribute(Replicate()), full state_dict) equal t}."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for flattened in (False, True):
        names = ("dp_replicate", "dp_shard") if flattened else ("a", "b")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        if flattened:
            mesh[names]._flatten()
        for rows in ROWS:
            full = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
            holder = nn.Module()
            holder.t = nn.Parameter(distribute_tensor(full, mesh, (Shard(0), Shard(0))))
            state = get_model_state_dict(holder, options=StateDictOptions(full_state_dict=True))
            read = (holder.t.full_tensor(), holder.t.redistribute(mesh, (Replicate(), Replicate())).to_local(),
                    state["t"])
            out[(rows, flattened)] = tuple(torch.equal(r.detach(), full) for r in read)
    return out


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = results[0][1]
    right = all(all(got[(rows, False)]) for rows in ROWS)
    present = right and not all(all(got[(rows, True)]) for rows in ROWS)
    print("expected: full_tensor(), redistribute(Replicate()) and a full state_dict give t back, "
          "whether or not the mesh dims were flattened")
    for (rows, flattened), same in got.items():
        print(f"actual:   {rows} rows, {'flattened' if flattened else 'not flattened'}: (full_tensor, "
              f"redistribute, state_dict) equal t: {same}")
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
