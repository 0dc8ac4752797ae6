"""Fault 06 (torch 2.13.0): FSDP1's tensor-parallel extension (DTensorExtensions).

torch/distributed/tensor/parallel/fsdp.py, on 4 gloo ranks, a (dp=2, tp=2) mesh: the smallest
on which FSDP1 shards (dp >= 2) a TP'd (tp >= 2) model.
1. _chunk_dtensor (DTensorExtensions.chunk_dtensor, what FSDP1's SHARDED_STATE_DICT calls) builds
   DTensor.from_local(local shard, ...) without the global shape: with an unevenly sharded tp
   dimension (3 rows over tp 2) the tp ranks infer (4, 4) and (2, 4), and the redistribute that
   follows mismatches sizes in gloo: FSDP.state_dict() aborts tp rank 1 (SIGABRT).
2. _chunk_tensor (DTensorExtensions.chunk_tensor) places the outer shard on "rank:<rank in the tp
   group>", which ShardedTensor reads as a global rank: ranks 2 and 3 raise; and
   _create_sharded_tensor_md_from_dt lists tp rank 1's own block under rank 0. (FSDP1's own
   state dicts never reach it: with a device mesh they take chunk_dtensor; called directly here.)
Run: python f06_fsdp1_dtensor_extensions.py
"""

import logging
import os
import signal
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

WORLD, TIMEOUT_S, GRACE_S = 4, 60, 5


def chunk_tensor(mesh) -> str:
    """chunk_tensor of a tp-sharded (4, 2) DTensor, as FSDP1 calls it (dp rank, dp size, dp group):
    'ok', or how the ShardedTensor it builds is wrong."""
    import torch.distributed.fsdp  # noqa: F401  (first, or importing the extension below is circular)
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel.fsdp import DTensorExtensions

    t = distribute_tensor(torch.arange(8.0).view(4, 2), mesh["tp"], [Shard(0)])
    dp = mesh["dp"]
    try:
        st = DTensorExtensions(torch.cpu).chunk_tensor(t, dp.get_local_rank(), dp.size(), 1, dp.get_group())
    except ValueError as exc:  # the fault: a tp-group rank read as a global one
        return f"{type(exc).__name__}: {exc}"
    mine = st.local_shards()[0].metadata
    if mine not in st.metadata().shards_metadata:
        owner = [m.placement for m in st.metadata().shards_metadata if m.shard_offsets == mine.shard_offsets]
        return f"its block at offset {tuple(mine.shard_offsets)} is listed on {owner[0]}, not on {mine.placement}"
    return "ok"


def sharded_state_dict(mesh) -> str:
    """FSDP1's SHARDED_STATE_DICT of a Linear TP shards 3 rows over tp 2: each value's global
    shape and how far its full tensor is from the parameter, or the error."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    one = nn.Sequential(nn.Linear(4, 3))
    model = nn.Sequential(nn.Linear(4, 3))
    model.load_state_dict(one.state_dict())
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fsdp = FSDP(model, device_mesh=mesh["dp"], use_orig_params=True, device_id=torch.device("cpu"))
    try:
        with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            state = fsdp.state_dict()
    except RuntimeError as exc:  # the fault: a peer aborted in the mismatched redistribute
        return f"{type(exc).__name__} ({str(exc).split('. ')[0].rsplit(': ', 1)[-1]})"
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, shapes)
    if any(s != {k: tuple(v.shape) for k, v in one.state_dict().items()} for s in everyone):
        return f"global shapes {shapes}"
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # its advice on 2-D gathers
    error = max((state[k].full_tensor() - v).abs().max().item() for k, v in one.state_dict().items())
    return f"global shapes {shapes}, full tensors off by {error:.3g}"


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    chunked = [None] * WORLD  # every rank's, so that the ranks that survive state_dict() tell them all
    dist.all_gather_object(chunked, chunk_tensor(mesh))
    return {"chunk_tensor": chunked, "state_dict": sharded_state_dict(mesh)}  # last: tp rank 1 aborts in it


def main() -> int:
    results = run_ranks()
    # A rank killed by a signal (gloo's SIGABRT on the mismatched sizes) is the fault's symptom.
    failed = {r: f"aborted with {signal.Signals(-v).name}" for r, (s, v) in results.items() if s == "aborted" and v < 0}
    if (code := bail_out({r: sv for r, sv in results.items() if r not in failed})) is not None:
        return code
    results = {r: v for r, (s, v) in results.items() if s == "ok"}
    chunked = next(iter(results.values()))["chunk_tensor"] if results else ["no answer"] * WORLD
    print("expected: FSDP.state_dict() under SHARDED_STATE_DICT gives every rank DTensors of the global "
          "shapes {'0.weight': (3, 4), '0.bias': (3,)}, full tensors off by 0; chunk_tensor gives every "
          "rank a ShardedTensor listing its own block under its rank")
    said = [f"rank {r} {how}" for r, how in failed.items()]
    said += [f"rank {r} raised {v['state_dict']}" if "Error" in v["state_dict"] else f"rank {r} {v['state_dict']}"
             for r, v in results.items()]
    wrong = [f"rank {r} {v}" for r, v in enumerate(chunked) if v != "ok"]
    print(f"actual:   state_dict(): {'; '.join(said)}. chunk_tensor: {'; '.join(wrong) or 'ok'}")
    present = bool(failed or wrong) or any("off by 0" not in v["state_dict"] for v in results.values())
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
