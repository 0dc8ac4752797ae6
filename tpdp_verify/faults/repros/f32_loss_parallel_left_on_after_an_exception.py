"""Fault 32 (torch 2.13.0): an exception inside loss_parallel() leaves its loss handlers on for the whole process.

torch/distributed/tensor/parallel/loss.py:loss_parallel is a generator context manager that
calls _enable_custom_loss_ops(), yields, then _disable_custom_loss_ops(), with no try/finally:
when its body raises (a batch that fails, a loss torch refuses, such as a mean on a mesh of two
dims, an interrupt a training loop catches to skip a step), the parallel handlers of log_softmax
and nll_loss stay registered in DTensor's dispatcher after the block. Every later cross entropy
over a DTensor in that process, outside any loss_parallel(), goes through them: over replicated
logits (an evaluation loop's) it raises "loss_parallel() requires exactly one mesh dim to shard
tensor dimension 1". After a clean exit the same call matches one device. 2 ranks, a (tp=2)
mesh. Run: python f32_loss_parallel_left_on_after_an_exception.py
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
CASES = ("after loss_parallel() exited cleanly", "after an exception inside loss_parallel()")


def inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randint(4, (6,), generator=gen)


def one_device() -> float:
    return F.cross_entropy(*inputs()).item()


def on_rank(rank: int) -> dict:
    """{case: the loss over replicated logits outside loss_parallel(), or what it raised}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    logits, target = inputs()
    out = {}
    for case in CASES:
        try:
            with loss_parallel():  # a training step's loss over vocab-sharded logits
                F.cross_entropy(distribute_tensor(logits, mesh, [Shard(1)]), target).full_tensor()
                if case == CASES[1]:
                    raise KeyError("a batch the loop skips")
        except KeyError:
            pass
        try:  # then an evaluation over replicated logits, outside loss_parallel()
            whole = [Replicate()]
            out[case] = F.cross_entropy(distribute_tensor(logits, mesh, whole),
                                        distribute_tensor(target, mesh, whole)).full_tensor().item()
        except Exception as exc:
            out[case] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return out


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = results[0][1]
    present = any(got[case] != expected and not (isinstance(got[case], float) and abs(got[case] - expected) < 1e-12)
                  for case in CASES)
    print(f"expected: F.cross_entropy over replicated DTensor logits outside loss_parallel(): {expected:.6f} (one device)")
    print("actual:   " + "; ".join(f"{case}: {got[case] if isinstance(got[case], str) else f'{got[case]:.6f}'}"
                                   for case in CASES))
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
