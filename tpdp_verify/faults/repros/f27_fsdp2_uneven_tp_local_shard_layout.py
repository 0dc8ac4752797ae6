"""Fault 27 (torch 2.13.0): FSDP2 over an uneven TP shard holds rows other than its placements say.

ColwiseParallel splits Linear(2, 7).weight's 7 rows 4 + 3 over tp 2; fully_shard(mesh=mesh["dp"])
then chunks each TP shard over dp 3 (FSDPParam._init_sharded_param, torch/distributed/fsdp/
_fully_shard/_fsdp_param.py: 4 -> 2, 2, 0 and 3 -> 1, 1, 1) but labels the result
(_StridedShard(0, split_factor=2), Shard(0)) (FSDPParam._init_sharding_spec_tp). Read left to right
(_StridedShard._split_tensor, then Shard(0) over tp, as compute_local_shape_and_global_offset and
distribute_tensor read it), those placements give rank 4 row 6 and rank 5 none; FSDP2 put row 6 on
rank 5 and none on rank 4. full_tensor() is still right; what trusts the layout (a DCP shard's
offsets, distribute_tensor of a full state dict) is not. 6 ranks, a (dp=3, tp=2) mesh: on (2, 2) the
two orders agree for every width. Run: python f27_fsdp2_uneven_tp_local_shard_layout.py
"""

import logging
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

WORLD, TIMEOUT_S, GRACE_S = 6, 60, 5
DP, TP, ROWS = 3, 2, 7  # 7 rows over tp 2: 4 + 3; over dp 3: 2, 2, 0 and 1, 1, 1


def model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(2, ROWS, bias=False)


def one_device() -> list:
    return model().weight.tolist()


def rows_of(local: torch.Tensor, weight: torch.Tensor) -> list:
    """Which of the one-device weight's rows a local shard holds (they are all distinct)."""
    return [next(i for i, w in enumerate(weight) if torch.equal(row, w)) for row in local]


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # its advice on 2-D gathers
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    weight = model().weight.detach()
    linear = fully_shard(parallelize_module(model(), mesh["tp"], ColwiseParallel()), mesh=mesh["dp"])
    param = linear.weight
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    # DTensor's own reading of the placements (split locally: its scatter refuses uneven _StridedShard)
    spread = distribute_tensor(weight, param.device_mesh, param.placements, src_data_rank=None)
    return {"holds": rows_of(param.to_local().detach(), weight),
            "layout": list(range(offset[0], offset[0] + shape[0])),
            "distribute_tensor": rows_of(spread.to_local(), weight),
            "placements": str(tuple(param.placements)),
            "full": param.full_tensor().tolist()}


def said(rows: list) -> str:
    return "no row" if not rows else f"row {rows[0]}" if len(rows) == 1 else f"rows {rows[0]}-{rows[-1]}"


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = {r: v for r, (_, v) in results.items()}
    off = max(abs(a - b) for v in got.values() for x, y in zip(v["full"], expected) for a, b in zip(x, y))
    wrong = [r for r, v in got.items() if v["holds"] != v["layout"]]
    print(f"expected: after ColwiseParallel on tp {TP} and fully_shard on dp {DP}, each rank holds the rows of "
          f"Linear(2, {ROWS}).weight its placements {got[0]['placements']} give "
          f"(compute_local_shape_and_global_offset): "
          + ", ".join(f"rank {r} {said(v['layout'])}" for r, v in got.items())
          + "; full_tensor() is one device's weight")
    held = "; ".join(f"rank {r} holds {said(got[r]['holds'])} where the layout says {said(got[r]['layout'])} "
                     f"(distribute_tensor puts {said(got[r]['distribute_tensor'])} there)" for r in wrong)
    print(f"actual:   {held + '; the other ranks agree' if wrong else 'every rank holds the rows the layout says'}; "
          f"full_tensor() is off one device's weight by {off:.3g}")
    present = bool(wrong) or off > 0
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
