"""Fault 38 (torch 2.13.0): the output of a vocab-sharded embedding can be reduced once: its second use raises.

An embedding whose weight is sharded on the vocabulary (Shard(0), as a vocab-parallel input
embedding is) looks up each rank's rows and leaves its output _MaskPartial: a partial sum whose
mask of looked-up rows waits in a MaskBuffer for the reduction. _MaskPartial._reduce_value
applies the mask, releases the buffer, and all-reduces. A program that uses the output twice
before reducing it, as an RMSNorm of the embedding does (x * rsqrt(mean(x ** 2))), reduces it
twice, and the second finds no mask: a bare AssertionError in
torch/distributed/tensor/placement_types.py:_reduce_value. One use works. transformers'
normed embeddings (Inkling's, MuseGlimmer's) meet it under their own TP. 2 ranks.
Run: python f38_mask_partial_reduced_once.py
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
VOCAB, DIM = 8, 4


def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def inputs():
    torch.manual_seed(0)
    return torch.randn(VOCAB, DIM), torch.tensor([[1, 6, 3]])


def on_rank(rank: int) -> dict:
    """{"once": the mean square of the looked-up rows, "twice": their RMSNorm}: each a list, or
    what it raised."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    weight, ids = inputs()
    out = {}
    for uses, f in (("once", lambda x: x.pow(2).mean(-1)), ("twice", rms_norm)):
        x = F.embedding(DTensor.from_local(ids, mesh, [Replicate()], run_check=False),
                        distribute_tensor(weight, mesh, [Shard(0)]))
        try:
            out[uses] = f(x).full_tensor().tolist()
        except AssertionError:
            where = traceback.extract_tb(sys.exc_info()[2])[-1]
            out[uses] = f"AssertionError in {os.path.basename(where.filename)}:{where.name}"
    return out


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    weight, ids = inputs()
    x = torch.nn.functional.embedding(ids, weight)
    expected = {"once": x.pow(2).mean(-1), "twice": rms_norm(x)}
    got = {rank: value for rank, (_, value) in results.items()}

    def said(uses: str, value) -> str:
        return value if isinstance(value, str) else "right" if torch.allclose(torch.tensor(value), expected[uses]) \
            else "wrong"

    print("expected: the looked-up rows' mean square (used once) and their RMSNorm (used twice) as one device "
          "computes them")
    print("actual:   " + "; ".join(f"rank {rank}: once {said('once', s['once'])}, twice {said('twice', s['twice'])}"
                                   for rank, s in sorted(got.items())))
    present = all(said("once", s["once"]) == "right" and "AssertionError" in said("twice", s["twice"])
                  for s in got.values())
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
