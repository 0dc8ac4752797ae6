"""Fault 16 (torch 2.13.0): under a float32 reduce_dtype, FSDP2 sums TP's partial gradients in bfloat16.

A SequenceParallel norm's weight is Replicate() over tp while each tp rank sees only its
slice of the sequence, so its gradient is a Partial sum. FSDP2 all-reduces it over tp in
torch/distributed/fsdp/_fully_shard/_fsdp_param.py:FSDPParam._get_grad_inner_tensor
(grad.redistribute to the parameter's placements) in the gradient's dtype, the compute
dtype, before foreach_reduce casts to reduce_dtype: under MixedPrecisionPolicy(
param_dtype=bfloat16, reduce_dtype=float32) the sum runs in bfloat16. A gradient accumulated
under set_requires_gradient_sync(False) is cast first (to_accumulated_grad_if_needed) and
summed in float32. Run: python f16_fsdp2_tp_reduce_dtype.py
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
from torch import nn

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5
HIDDEN, SEQ = 8, 8
POLICY = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # torchtitan's


def batch() -> torch.Tensor:
    return torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(0))


def on_rank(rank: int) -> tuple[list, list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllReduces(TorchDispatchMode):
        """What this rank hands each all-reduce: its partial sum, in the dtype it is summed in."""
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_reduce" in str(func):
                self.seen.append((str(args[0].dtype).removeprefix("torch."), args[0].float().tolist()))
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    norm = parallelize_module(nn.RMSNorm(HIDDEN), mesh["tp"], SequenceParallel())
    fully_shard(norm, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(**POLICY))
    out = norm(batch().chunk(WORLD, dim=1)[rank])  # this rank's half of the sequence
    with AllReduces():
        out.to_local().float().square().sum().backward()
    return norm.weight.grad.full_tensor().tolist(), AllReduces.seen  # plain values: the rank exits once it answers


def partials(answers: list) -> list:
    """Each tp rank's partial gradient of the norm's weight (its half of the sequence), as it
    handed it to the all-reduce over tp, in the dtype it had there."""
    return [torch.tensor(seen[0][1]).to(getattr(torch, seen[0][0])) for _, seen in answers]


def describe(answers: list) -> str:
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in partials(answers)})
    return (f"reduce_dtype=float32 sums the SequenceParallel norm's {', '.join(dtypes)} partial gradients over "
            f"tp in float32: {fmt(sum(p.float() for p in partials(answers)))}")


def judge(answers: list) -> tuple[str, bool]:
    """Present where the sum departs from the float32 sum of what the ranks handed over by
    more than float32's rounding: a sum in bfloat16 is 2^-9 of it off (the values a torch
    computes its partials in are its own; 2.15 hands them over in float32)."""
    summed = partials(answers)
    expected, in_bf16 = sum(p.float() for p in summed), sum(p.bfloat16() for p in summed).float()
    grad, dtypes = torch.tensor(answers[0][0]), [d for d, _ in answers[0][1]]
    error = (grad - expected).abs().max().item()
    how = " (their bfloat16 sum)" * torch.equal(grad, in_bf16)
    return (f"FSDP2 all-reduces them over tp in {', '.join(dtypes)}: {fmt(grad)}{how}, "
            f"max abs difference {error:.3g}, relative {error / expected.abs().max().item():.2g}",
            error > 1e-6 * expected.abs().max().item())


def fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in t[:4].tolist()) + ", ...]"


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    answers = [value for _, value in results.values()]
    if not all(seen for _, seen in answers):  # this torch sums them otherwise: not this fault's question
        print("a rank ran no all-reduce over tp: cannot tell", file=sys.stderr)
        return 2
    actual, present = judge(answers)
    print(f"expected: {describe(answers)}")
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
