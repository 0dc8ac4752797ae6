"""Fault 23 (torch 2.13.0): A vocab-sharded embedding that leaves a tp rank no rows raises there; the others hang.

RowwiseParallel on an nn.Embedding (torchtitan's plan for tok_embeddings) shards the vocab rows
like torch.chunk: a vocab of 5 over 4 tp ranks gives 2, 2, 1 and 0 rows. Its
forward masks the token ids a rank does not hold to 0 (torch/distributed/tensor/placement_types.py:
_MaskPartial._partition_value, _mask_tensor) and looks them up in the local table; on the rank with
an empty table, row 0 does not exist, and aten.embedding's index_select raises RuntimeError
"index_select(): self indexing axis dim should be positive" (in nn.Embedding.forward), while the
other ranks wait in the _MaskPartial all-reduce until that rank's exit breaks their connection
(gloo; here) or the collective times out. 4 ranks, a (tp=4) mesh, no DP:
on 2 ranks only a vocab of 1 leaves a rank empty, and there DTensor gathers the table instead.
Run: python f23_embedding_empty_vocab_shard.py
"""

import os
import re
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
VOCAB, DIM, TOKENS = 5, 2, [0, 4, 2]  # vocab 5 over tp 4: rank 3 holds no row
FAULT = "index_select(): self indexing axis dim should be positive"


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Embedding(VOCAB, DIM)


def rows(t: torch.Tensor) -> list:
    return [[round(x, 4) for x in row] for row in t.tolist()]


def one_device() -> list:
    return rows(model()(torch.tensor(TOKENS)))


def on_rank(rank: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    embed = parallelize_module(model(), mesh, RowwiseParallel(input_layouts=Replicate()))
    return rows(embed(torch.tensor(TOKENS)))  # the fault raises here, out of on_rank


def last_line(tb: str) -> str:
    return re.sub(r"\[/\S*\] ", "", tb.strip().splitlines()[-1])  # without gloo's source path


def main() -> int:
    expected = one_device()
    results = run_ranks()
    raised = {r: last_line(v) for r, (s, v) in results.items() if s == "error" and FAULT in v}
    if not raised and (code := bail_out(results)) is not None:  # no fault: any failure is this script's
        return code
    print(f"expected: nn.Embedding({VOCAB}, {DIM})({TOKENS}) = {expected} (one device)")
    if raised:
        said = {f"raised {m}": [r] for r, m in raised.items()}
        for r, (status, value) in results.items():  # the others: waiting on it, or failing once it left
            if r not in raised:
                what = f"then raised {last_line(value).split(' [')[0]} (in the all-reduce)" if status == "error" else \
                    "hung in the all-reduce (killed)" if status == "hung" else status
                said.setdefault(what, []).append(r)
        print(f"actual:   RowwiseParallel embedding on {WORLD} tp ranks: "
              + "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {what}" for what, rs in said.items()))
    else:
        print(f"actual:   RowwiseParallel embedding on {WORLD} tp ranks = "
              f"{', '.join(str(v) for _, v in results.values())}")
    present = bool(raised) or any(v != expected for _, v in results.values())
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
