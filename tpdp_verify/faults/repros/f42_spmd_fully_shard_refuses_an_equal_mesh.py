"""Fault 42 (torch 2.13.0): fully_shard's SPMD form refuses parameters made on the very mesh it is given, once the process put TP under FSDP2 on an equal mesh.

torch/distributed/fsdp/_fully_shard/_fsdp_param.py:_init_sharding_spec_spmd requires each
parameter's DTensor mesh to be the mesh passed to fully_shard(mesh=..., dp_mesh_dims=...) by
identity (``spmd_mesh is not self.mesh_info.spmd_mesh``), while DTensor treats equal meshes as
one: its sharding propagation caches an op's output spec, mesh object included, under a key that
compares meshes by value, and hands that spec back to the next op on an equal mesh. TP under
FSDP2 on a dp submesh (here FSDP2's replicate) builds a new mesh equal to the whole one for each
parameter (DeviceMesh._concatenate) and makes its parameter there, replicated over dp and sharded
over tp (nn.Parameter, a detach); afterwards nn.Parameter(distribute_tensor(w, mesh, [Replicate(),
Shard(0)])) on the whole mesh returns a DTensor holding that earlier mesh, and fully_shard's SPMD
form raises "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but got
different mesh objects". The same program on a shape the process has not met so passes. 4 ranks,
a (dp=2, tp=2) mesh.
Run: python f42_spmd_fully_shard_refuses_an_equal_mesh.py
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
# the SPMD program on a weight of a shape the process has not met before, then on the shape
# that TP under FSDP2 met before it on an equal mesh
CASES = ("a 4x4 weight, new to the process", "a 6x6 weight, after TP under FSDP2 on a 6x6 one")


def spmd_program(mesh, n: int) -> str:
    """A Linear whose weight is a DTensor on the whole (dp, tp) mesh, replicated over dp and
    sharded over tp, given to fully_shard's SPMD form; "ok" or what it raised."""
    from torch import nn
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = nn.Linear(n, n, bias=False)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate(), Shard(0)]))
    try:
        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def tp_under_fsdp2(mesh, n: int) -> None:
    """TP under FSDP2's replicate (torchtitan's DDP) on the same mesh's submeshes:
    ColwiseParallel on tp, replicate on dp. FSDP2 makes each parameter a DTensor on a new mesh
    equal to the whole one, replicated over dp and sharded over tp."""
    from torch import nn
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = parallelize_module(nn.Linear(n, n, bias=False), mesh["tp"], ColwiseParallel())
    replicate(model, mesh=mesh["dp"])


def on_rank(rank: int) -> dict:
    """{case: "ok" or what fully_shard's SPMD form raised}."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {CASES[0]: spmd_program(mesh, 4)}
    tp_under_fsdp2(mesh, 6)
    out[CASES[1]] = spmd_program(mesh, 6)
    return out


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = results[0][1]
    present = any(said != "ok" for said in got.values())
    print("expected: fully_shard(mesh=mesh, dp_mesh_dims=...) takes parameters distributed on mesh: ok")
    print("actual:   " + "; ".join(f"{case}: {said}" for case, said in got.items()))
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
