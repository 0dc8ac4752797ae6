"""Fault 15 (torch 2.13.0): under loss_parallel, log_softmax backpropagates as if nll_loss came next.

loss_parallel() replaces the backward of log_softmax over vocab-sharded logits by the
identity (torch/distributed/tensor/parallel/loss.py:_log_softmax_backward_handler returns
grad_output), relying on _nll_loss_and_log_softmax_backward to have produced the fused
cross-entropy gradient already. Cross entropy is right; any other loss over the
log-probabilities (here a distillation KL divergence to a teacher) gets the gradient with
respect to the log-probabilities as the logits', silently. Run: python f15_loss_parallel_log_softmax_grad.py
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
import torch.nn.functional as F

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5


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


def on_rank(rank: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    logits, teacher = inputs()
    logits = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()  # vocab-sharded, as ColwiseParallel's
    with loss_parallel():
        loss = distillation_loss(logits, distribute_tensor(teacher, mesh, [Shard(1)]))
        loss.full_tensor().backward()
    return logits.grad.full_tensor().tolist()  # plain values: the rank exits once it answers


def describe(expected: torch.Tensor) -> str:
    return f"d kl_div(log_softmax(logits), teacher) / d logits, max |grad| {expected.abs().max():.4f} (one device)"


def judge(expected: torch.Tensor, answers: list) -> tuple[str, bool]:
    answers = [torch.tensor(a, dtype=expected.dtype) for a in answers]
    error = max((a - expected).abs().max().item() for a in answers)
    _, teacher = inputs()
    identity = all(torch.allclose(a, -teacher / len(teacher)) for a in answers)  # d loss / d log-probs
    how = ": it is d loss / d log-probabilities, as if log_softmax's backward were the identity" * identity
    return f"under loss_parallel on {WORLD} tp ranks it departs by {error:.4g} (max abs difference){how}", error > 1e-12


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
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
