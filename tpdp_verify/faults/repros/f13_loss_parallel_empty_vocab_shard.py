"""Fault 13 (torch 2.13.0): loss_parallel over a vocab that leaves a tp rank no column hangs.

ColwiseParallel shards an output head's vocab like torch.chunk: 5 classes over 4 tp ranks
give 2, 2, 1 and 0 columns. Under loss_parallel(), F.cross_entropy on the rank with no
column skips the max all-reduce (torch/distributed/tensor/parallel/loss.py:_log_softmax,
`if x.numel() == 0`), so its collectives pair with the wrong ones of the other ranks, then
raises in _nll_loss_forward's torch.gather (index 0 is out of bounds for dimension 1 with
size 0); the other ranks wait forever in _log_softmax's sum all-reduce: in a job, a hang.
One device gives the loss. 4 ranks: on 2 tp ranks only a vocab of 1 leaves a rank empty.
Run: python f13_loss_parallel_empty_vocab_shard.py
"""

import os
import queue
import signal
import socket
import sys
import traceback
import warnings
from datetime import timedelta
from time import monotonic

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD, TIMEOUT_S, GRACE_S = 4, 60, 3
VOCAB, TARGET = 5, [0, 4, 2]


def inputs():
    logits = torch.randn(len(TARGET), VOCAB, generator=torch.Generator().manual_seed(0))
    return logits, torch.tensor(TARGET)


def one_device() -> float:
    return F.cross_entropy(*inputs()).item()


def on_rank(rank: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    logits, target = inputs()
    sharded = distribute_tensor(logits, mesh, [Shard(1)])  # 2, 2, 1, 0 columns, as ColwiseParallel's
    with loss_parallel():
        return F.cross_entropy(sharded, target).full_tensor().item()


def is_fault(exc: Exception) -> bool:
    return isinstance(exc, (RuntimeError, IndexError)) and "out of bounds" in str(exc)


def describe(expected: float) -> str:
    return f"cross_entropy over {VOCAB} classes = {expected:.6f} (one device)"


def judge(expected: float, answers: list) -> tuple[str, bool]:
    return (f"cross_entropy under loss_parallel on {WORLD} tp ranks = {', '.join(f'{a:.6f}' for a in answers)}",
            any(abs(a - expected) > 1e-5 for a in answers))


# --- the same in every repro: gloo ranks on 127.0.0.1 answer once; a timeout catches hangs ------

def rank_main(rank, port, answers, done):
    warnings.filterwarnings("ignore")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = timedelta(seconds=TIMEOUT_S + 30)  # the parent calls a hang first
    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
        answers.put((rank, "ok", on_rank(rank)))
    except Exception as exc:
        if is_fault(exc):
            answers.put((rank, "raised", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"))
        else:
            answers.put((rank, "error", traceback.format_exc()))
    done.wait()  # stay in the group, as a job's rank would, until every rank has answered


def run_ranks() -> dict:
    """{rank: (status, value)}, status one of ok, raised (the fault), error, hung, aborted."""
    ctx = mp.get_context("spawn")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # a free port, on loopback only
    listener.listen(WORLD + 1)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach(), timeout=timedelta(seconds=TIMEOUT_S))
    answers, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=rank_main, args=(r, port, answers, done)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {}, monotonic() + TIMEOUT_S
    while len(results) < WORLD and monotonic() < deadline:
        try:
            rank, status, value = answers.get(timeout=0.2)
        except queue.Empty:
            results.update({r: ("aborted", p.exitcode) for r, p in enumerate(procs)
                            if r not in results and p.exitcode not in (None, 0)})
            continue
        results[rank] = (status, value)
        if status != "ok":  # the others may be waiting for this rank: a grace, not the timeout
            deadline = min(deadline, monotonic() + GRACE_S)
    done.set()
    for r, p in enumerate(procs):
        p.join(timeout=5 if r in results else 0)
        if p.is_alive():
            p.kill()
            p.join()
    del store
    return {r: results.get(r, ("hung", None)) for r in range(WORLD)}


def failures(results: dict) -> str:
    """The ranks that raised the fault, aborted or hung (and what the others then raised), in words."""
    said = {}
    for kind in ("raised", "aborted", "hung", "error"):
        for r, (status, value) in results.items():
            if status == kind == "raised":
                said.setdefault(f"raised {value}", []).append(r)
            elif status == kind == "aborted":
                name = signal.Signals(-value).name if value < 0 else f"exit code {value}"
                said.setdefault(f"aborted with {name}", []).append(r)
            elif status == kind == "hung":
                said.setdefault("hung (no answer; killed)", []).append(r)
            elif status == kind == "error":
                said.setdefault(f"then raised {value.strip().splitlines()[-1]}", []).append(r)
    return "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {what}" for what, rs in said.items())


def main() -> int:
    expected = one_device()
    results = run_ranks()
    statuses = {status for status, _ in results.values()}
    if "error" in statuses and not statuses & {"raised", "aborted"}:  # a bug in this script, not the fault
        print(next(value for status, value in results.values() if status == "error"), file=sys.stderr)
        return 2
    actual = failures(results)
    present = bool(actual)
    if not present:
        actual, present = judge(expected, [value for _, value in results.values()])
    print(f"expected: {describe(expected)}")
    print(f"actual:   {actual}")
    print("fault present" if present else "fault absent")
    return int(present)


if __name__ == "__main__":
    sys.exit(main())
