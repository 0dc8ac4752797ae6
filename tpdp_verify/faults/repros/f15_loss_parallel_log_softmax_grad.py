"""Fault 15 (torch 2.13.0): under loss_parallel, log_softmax backpropagates as if nll_loss came next.

loss_parallel() replaces the backward of log_softmax over vocab-sharded logits by the
identity (torch/distributed/tensor/parallel/loss.py:_log_softmax_backward_handler returns
grad_output), relying on _nll_loss_and_log_softmax_backward to have produced the fused
cross-entropy gradient already. Cross entropy is right; any other loss over the
log-probabilities (here a distillation KL divergence to a teacher) gets the gradient with
respect to the log-probabilities as the logits', silently. Run: python f15_loss_parallel_log_softmax_grad.py
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

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 3


def inputs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=gen, dtype=torch.float64)
    teacher = torch.randn(3, 8, generator=gen, dtype=torch.float64).softmax(-1)
    return logits, teacher


def distillation_loss(logits, teacher):
    return F.kl_div(F.log_softmax(logits, -1), teacher, reduction="batchmean")


def one_device() -> torch.Tensor:
    logits, teacher = inputs()
    logits.requires_grad_()
    distillation_loss(logits, teacher).backward()
    return logits.grad


def on_rank(rank: int) -> torch.Tensor:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    logits, teacher = inputs()
    logits = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()  # vocab-sharded, as ColwiseParallel's
    with loss_parallel():
        loss = distillation_loss(logits, distribute_tensor(teacher, mesh, [Shard(1)]))
        loss.full_tensor().backward()
    return logits.grad.full_tensor()


def is_fault(exc: Exception) -> bool:
    return False  # the fault is silent: wrong gradients, no exception


def describe(expected: torch.Tensor) -> str:
    return f"d kl_div(log_softmax(logits), teacher) / d logits, max |grad| {expected.abs().max():.4f} (one device)"


def judge(expected: torch.Tensor, answers: list) -> tuple[str, bool]:
    error = max((a - expected).abs().max().item() for a in answers)
    _, teacher = inputs()
    identity = all(torch.allclose(a, -teacher / len(teacher)) for a in answers)  # d loss / d log-probs
    how = ": it is d loss / d log-probabilities, as if log_softmax's backward were the identity" * identity
    return f"under loss_parallel on {WORLD} tp ranks it departs by {error:.4g} (max abs difference){how}", error > 1e-12


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
