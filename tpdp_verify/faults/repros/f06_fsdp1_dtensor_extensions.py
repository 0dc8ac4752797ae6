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

import datetime
import logging
import os
import signal
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD, TIMEOUT = 4, 60


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


def on_rank(rank: int, send) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    send("chunk_tensor", chunk_tensor(mesh))
    send("state_dict", sharded_state_dict(mesh))  # last: tp rank 1 aborts in it


# --- boilerplate: gloo ranks on loopback, joined with a timeout --------------------------

def rank_entry(rank: int, port: int, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo listens on loopback only
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    # on_rank sends plain values (no tensors) as it goes; an exception it lets out is a bug of this file
    on_rank(rank, lambda key, value: queue.put((rank, key, value)))
    queue.put((rank, "done", True))
    dist.destroy_process_group()


def launch() -> tuple[dict, dict]:
    """Run on_rank on WORLD ranks: ({rank: {key: value}}, {rank: 'hung' | 'aborted with SIG..' | 'raised'}),
    the second for ranks that did not finish on_rank."""
    listener = socket.create_server(("127.0.0.1", 0))  # a free port, loopback only
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], WORLD + 1, is_master=True,
                          wait_for_workers=False, master_listen_fd=listener.detach())
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_entry, args=(r, store.port, queue), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {r: {} for r in range(WORLD)}, time.monotonic() + TIMEOUT

    def drain():
        while not queue.empty():
            rank, key, value = queue.get()
            results[rank][key] = value

    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        drain()
        if any(p.exitcode for p in procs) or all("done" in r for r in results.values()):
            deadline = min(deadline, time.monotonic() + 5)  # a rank died, or all finished: 5 s more
        time.sleep(0.05)
    drain()
    failed = {}
    for rank, p in enumerate(procs):
        if p.exitcode is None:
            failed[rank] = "hung"
            p.kill()
            p.join()
        elif p.exitcode != 0:
            failed[rank] = f"aborted with {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else "raised"
        if results[rank].pop("done", False) and rank in failed:  # in teardown, after its work: not ours
            print(f"note: rank {rank} {failed.pop(rank)} after finishing on_rank", file=sys.stderr)
    return results, failed


def main() -> int:
    results, failed = launch()
    if "raised" in failed.values() or "hung" in failed.values():
        print(f"repro error: ranks {failed} (see stderr)", file=sys.stderr)
        return 2
    print("expected: FSDP.state_dict() under SHARDED_STATE_DICT gives every rank DTensors of the global "
          "shapes {'0.weight': (3, 4), '0.bias': (3,)}, full tensors off by 0; chunk_tensor gives every "
          "rank a ShardedTensor listing its own block under its rank")
    said = [f"rank {r} {how}" for r, how in failed.items()]
    said += [f"rank {r} raised {v['state_dict']}" if "Error" in v["state_dict"] else f"rank {r} {v['state_dict']}"
             for r, v in results.items() if "state_dict" in v]
    wrong = [f"rank {r} {v['chunk_tensor']}" for r, v in results.items() if v.get("chunk_tensor") != "ok"]
    print(f"actual:   state_dict(): {'; '.join(said)}. chunk_tensor: {'; '.join(wrong) or 'ok'}")
    present = bool(failed or wrong) or any("off by 0" not in v.get("state_dict", "") for v in results.values())
    print("fault present" if present else "fault absent")
    return 1 if present else 0


if __name__ == "__main__":
    sys.exit(main())
