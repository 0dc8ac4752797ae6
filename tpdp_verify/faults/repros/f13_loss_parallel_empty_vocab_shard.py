"""Fault 13 (torch 2.13.0): loss_parallel over a vocab that leaves a tp rank no column hangs.

ColwiseParallel shards an output head's vocab like torch.chunk: 5 classes over 4 tp ranks
give 2, 2, 1 and 0 columns. Under loss_parallel(), F.cross_entropy on the rank with no
column skips the max all-reduce (torch/distributed/tensor/parallel/loss.py:_log_softmax,
`if x.numel() == 0`), so its collectives pair with the wrong ones of the other ranks, then
raises in _nll_loss_forward's torch.gather (index 0 is out of bounds for dimension 1 with
size 0); the others wait in _log_softmax's sum all-reduce as long as it lives: in a job, a
hang (here it exits once it has answered: gloo fails some waits, "Connection closed by peer",
the rest hang). One device gives the loss. 4 ranks: on 2 tp ranks only a vocab of 1 empties one.
Run: python f13_loss_parallel_empty_vocab_shard.py
"""

import os
import re
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
import torch.nn.functional as F

WORLD, TIMEOUT_S, GRACE_S = 4, 60, 5
VOCAB, TARGET = 5, [0, 4, 2]


def inputs():
    logits = torch.randn(len(TARGET), VOCAB, generator=torch.Generator().manual_seed(0))
    return logits, torch.tensor(TARGET)


def one_device() -> float:
    return F.cross_entropy(*inputs()).item()


def on_rank(rank: int) -> float | str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    logits, target = inputs()
    sharded = distribute_tensor(logits, mesh, [Shard(1)])  # 2, 2, 1, 0 columns, as ColwiseParallel's
    try:
        with loss_parallel():
            return F.cross_entropy(sharded, target).full_tensor().item()
    except (RuntimeError, IndexError) as exc:  # the fault, on the rank with no column
        if "out of bounds" not in str(exc):
            raise
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def describe(expected: float) -> str:
    return f"cross_entropy over {VOCAB} classes = {expected:.6f} (one device)"


def judge(expected: float, answers: list) -> tuple[str, bool]:
    return (f"cross_entropy under loss_parallel on {WORLD} tp ranks = {', '.join(f'{a:.6f}' for a in answers)}",
            any(abs(a - expected) > 1e-5 for a in answers))


def failures(raised: dict, results: dict) -> str:
    """The ranks that raised the fault, and what the others, left in the all-reduce, did then, in words."""
    said = {}
    for r, value in raised.items():
        said.setdefault(f"raised {value}", []).append(r)
    for r, (status, value) in results.items():
        if r in raised:
            continue
        if status == "hung":
            said.setdefault("hung (no answer; killed)", []).append(r)
        elif status == "aborted":
            said.setdefault(f"aborted with {signal.Signals(-value).name if value < 0 else f'exit code {value}'}",
                            []).append(r)
        elif status == "error":  # gloo's error once the raising rank has left: its path, address and advice cut
            error = re.sub(r"\[/\S*\] | \[[\d.]+\]:\d+", "", value.strip().splitlines()[-1]).split(". ")[0]
            said.setdefault(f"waited in the all-reduce until the raising rank exited, then raised {error}", []).append(r)
        else:
            said.setdefault(f"returned {value:.6f}", []).append(r)
    return "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {what}" for what, rs in said.items())


def main() -> int:
    expected = one_device()
    results = run_ranks()
    raised = {r: v for r, (s, v) in results.items() if s == "ok" and isinstance(v, str)}
    if raised:  # the fault; what the others then did (hang, or fail once it left) is its symptom, not a bug here
        actual, present = failures(raised, results), True
    elif (code := bail_out(results)) is not None:
        return code
    else:
        actual, present = judge(expected, [value for _, value in results.values()])
    print(f"expected: {describe(expected)}")
    print(f"actual:   {actual}")
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
