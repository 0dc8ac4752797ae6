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
from torch import nn

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 3
HIDDEN, SEQ = 8, 8
POLICY = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # torchtitan's


def batch() -> torch.Tensor:
    return torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(0))


def one_device() -> list:
    """Each tp rank's bfloat16 partial gradient of the norm's weight: its half of the sequence."""
    partials = []
    for x in batch().bfloat16().chunk(WORLD, dim=1):
        weight = torch.ones(HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        nn.functional.rms_norm(x, (HIDDEN,), weight).float().square().sum().backward()
        partials.append(weight.grad)
    return partials


def on_rank(rank: int) -> tuple[torch.Tensor, list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllReduceDtypes(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_reduce" in str(func):
                self.seen.append(str(args[0].dtype).removeprefix("torch."))
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    norm = parallelize_module(nn.RMSNorm(HIDDEN), mesh["tp"], SequenceParallel())
    fully_shard(norm, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(**POLICY))
    out = norm(batch().chunk(WORLD, dim=1)[rank])  # this rank's half of the sequence
    with AllReduceDtypes():
        out.to_local().float().square().sum().backward()
    return norm.weight.grad.full_tensor(), AllReduceDtypes.seen


def is_fault(exc: Exception) -> bool:
    return False  # the fault is silent: a less precise sum


def describe(partials: list) -> str:
    return ("reduce_dtype=float32 sums the SequenceParallel norm's bfloat16 partial gradients over tp "
            f"in float32: {fmt(sum(p.float() for p in partials))}")


def judge(partials: list, answers: list) -> tuple[str, bool]:
    expected, in_bf16 = sum(p.float() for p in partials), sum(partials).float()
    grad, dtypes = answers[0]
    error = (grad - expected).abs().max().item()
    how = " (their bfloat16 sum)" * torch.equal(grad, in_bf16)
    return (f"FSDP2 all-reduces them over tp in {', '.join(dtypes)}: {fmt(grad)}{how}, "
            f"max abs difference {error:.3g}, relative {error / expected.abs().max().item():.2g}",
            error > 1e-6 * expected.abs().max().item())


def fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in t[:4].tolist()) + ", ...]"


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
