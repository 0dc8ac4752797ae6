"""Fault 41 (torch 2.13.0): the backward of an index_put (``y[mask] = v``) on DTensors raises: it mixes in a plain tensor.

A masked assignment ``y[mask] = values`` on DTensors runs forward and records
IndexPutBackward0. Autograd's generated node keeps only the shape and options of ``values``
(``TypeAndSize values_info``) and computes the gradient of ``y`` as
``grad.index_put(indices, values_info.zeros(), accumulate)``: ``values_info.zeros()`` is a
plain tensor whatever ``values`` was, so with a DTensor gradient DTensor's dispatch refuses
the mix ("aten.index_put.default got mixed torch.Tensor and DTensor"), though every tensor
of the program is a DTensor. The same program on plain tensors steps, and so does the
DTensor program written with ``torch.where``. Known upstream: pytorch/pytorch#118461.
transformers' T5Gemma 2 text encoder meets it under its own TP: its scaled word embedding
(sharded, ``embedding_rowwise``) writes its end-of-image embedding so, and the backward
raises even where no token is that one. 2 ranks, every tensor replicated.
Run: python f41_index_put_backward_mixes_a_plain_tensor.py
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


def inputs():
    torch.manual_seed(0)
    return torch.randn(2, 3, 4), torch.tensor([[True, False, False], [False, False, True]]), torch.randn(4)


def steps(x, mask, values) -> dict:
    """Each way of writing ``values`` where ``mask`` holds: "ran" or what it raised (first line)."""
    out = {}
    for way, write in (("index_put", _index_put), ("where", _where)):
        try:
            write(x, mask, values).sum().backward()
            out[way] = "ran"
        except RuntimeError as exc:
            out[way] = f"raised RuntimeError: {str(exc).splitlines()[0]}"
    return out


def _index_put(x, mask, values):
    y = x * 1.0
    y[mask] = values
    return y


def _where(x, mask, values):
    return torch.where(mask[..., None], values, x * 1.0)


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    x, mask, values = (distribute_tensor(t, mesh, [Replicate()]) for t in inputs())
    return steps(x.requires_grad_(), mask, values)


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    x, mask, values = inputs()
    plain = steps(x.requires_grad_(), mask, values)
    got = {rank: value for rank, (_, value) in results.items()}
    print(f"expected: the DTensor program steps either way, as the plain one does (plain tensors: index_put "
          f"{plain['index_put']}, where {plain['where']})")
    print("actual:   " + "; ".join(f"rank {rank}: index_put {s['index_put']}, where {s['where']}"
                                   for rank, s in sorted(got.items())))
    present = all(s["where"] == "ran" and "got mixed torch.Tensor and DTensor" in s["index_put"]
                  for s in got.values()) and plain == {"index_put": "ran", "where": "ran"}
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
