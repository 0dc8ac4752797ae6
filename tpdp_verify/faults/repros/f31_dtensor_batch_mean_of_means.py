"""Fault 31 (torch 2.13.0): a mean of cross entropy over batch-sharded DTensor logits averages the ranks' means.

F.cross_entropy(logits, target, reduction="mean") (and F.nll_loss) over logits that are a
DTensor sharded on the batch over dp, as the SPMD form's users hold them, with its targets
sharded alike: DTensor's nll_loss_forward_strategy (torch/distributed/tensor/_ops/_math_ops.py)
makes the loss Partial("avg") of each rank's local mean, and each local mean divides by that
rank's own total weight (its count of targets not ignored, or its targets' class weights).
The mean of the ranks' means is the batch's mean only where every rank's total weight is the
same: with ignored targets spread unevenly over the ranks, or class weights, the loss is wrong,
and a rank whose targets are all ignored makes it nan (0/0) on every rank. Its check,
is_tensor_evenly_shardable, looks at shapes only. The gradients are right: the backward
divides by the summed total weight. 2 ranks, a (dp=2) mesh, 4 samples of 3 tokens over 5
classes, no loss_parallel. Run: python f31_dtensor_batch_mean_of_means.py
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
SAMPLES, TOKENS, CLASSES, IGNORE = 4, 3, 5, -100  # rank 0 holds samples 0-1, rank 1 samples 2-3
CASES = {  # name: (which targets are ignored, class weights?)
    "some of rank 1's targets ignored": ([(2, 0), (2, 1), (3, 2)], False),
    "all of rank 1's targets ignored": ([(2, t) for t in range(TOKENS)] + [(3, t) for t in range(TOKENS)], False),
    "class weights": ([], True),
    "no target ignored, no class weights": ([], False),  # every rank's total weight alike: right
}


def inputs(case: str):
    ignored, weighted = CASES[case]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(SAMPLES, TOKENS, CLASSES, generator=gen, dtype=torch.float64)
    target = torch.randint(CLASSES, (SAMPLES, TOKENS), generator=gen)
    for sample, token in ignored:
        target[sample, token] = IGNORE
    weight = torch.linspace(0.5, 2.5, CLASSES, dtype=torch.float64) if weighted else None
    return logits, target, weight


def loss_of(logits, target, weight):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1), weight=weight, ignore_index=IGNORE)


def one_device(case: str) -> tuple[float, list]:
    logits, target, weight = inputs(case)
    logits.requires_grad_()
    loss = loss_of(logits, target, weight)
    loss.backward()
    return loss.item(), logits.grad.tolist()


def on_rank(rank: int) -> dict:
    """{case: (loss, logits' gradient)}, the batch sharded on dp as DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    out = {}
    for case in CASES:
        logits, target, weight = inputs(case)
        logits = distribute_tensor(logits, mesh, [Shard(0)]).requires_grad_()
        target = distribute_tensor(target, mesh, [Shard(0)])
        weight = None if weight is None else distribute_tensor(weight, mesh, [Replicate()])
        loss = loss_of(logits, target, weight)
        loss.backward()
        out[case] = (loss.full_tensor().item(), logits.grad.full_tensor().tolist())
    return out


def main() -> int:
    expected = {case: one_device(case) for case in CASES}
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    said, present = [], False
    for case, (loss, grad) in expected.items():
        got = [v[case] for _, v in results.values()]
        loss_diff = max(abs(g[0] - loss) if g[0] == g[0] else float("nan") for g in got)
        grad_diff = max((torch.tensor(g[1]) - torch.tensor(grad)).abs().max().item() for g in got)
        said.append(f"{case}: loss {got[0][0]:.6f} (one device {loss:.6f}), gradient off by {grad_diff:.3g}")
        present |= case != "no target ignored, no class weights" and not loss_diff <= 1e-12
    print(f"expected: F.cross_entropy(reduction='mean') over {SAMPLES}x{TOKENS} tokens of {CLASSES} classes on one device")
    print(f"actual:   over DTensors sharded on the batch over {WORLD} ranks: {'; '.join(said)}")
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
