"""Fault 17 (torch 2.13.0): over the whole SPMD mesh, FSDP2 scales every gradient by 1/dp.

fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(...)) takes parameters that
are DTensors on the whole mesh, Replicate() on dp. With the batch a DTensor sharded on dp
and the loss a mean over the global batch, autograd gives each parameter a Partial(sum)
gradient over dp that already is one device's gradient once summed (the program without
fully_shard trains exactly). torch/distributed/fsdp/_fully_shard/_fsdp_param.py:
FSDPParam._get_grad_inner_tensor keeps those partial sums pending on the dp dims, and
foreach_reduce then averages them like whole gradients: divided by dp a second time.
Run: python f17_fsdp2_spmd_grad_scale.py
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
FORMS = ("shard", "replicate")  # DataParallelMeshDims(shard="dp"), DataParallelMeshDims(replicate="dp")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 4, generator=gen), torch.randn(4, 4, generator=gen)  # weight, global batch


def one_device() -> torch.Tensor:
    weight, batch = data()
    weight.requires_grad_()
    (batch @ weight.T).square().mean().backward()
    return weight.grad


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    grads = {}
    for form in (None, *FORMS):
        weight, batch = data()
        model = nn.Linear(4, 4, bias=False)
        model.weight = nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))  # an SPMD parameter
        if form:
            fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**{form: "dp"}))
        x = distribute_tensor(batch, mesh, [Shard(0)])  # the global batch, 2 rows a dp rank
        model(x).square().mean().backward()  # the mean over the global batch
        grad = model.weight.grad
        grads[form or "DTensor alone"] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return grads


def is_fault(exc: Exception) -> bool:
    return False  # the fault is silent: scaled gradients


def describe(expected: torch.Tensor) -> str:
    return f"the weight's gradient norm {expected.norm():.6f} (one device), with or without fully_shard"


def judge(expected: torch.Tensor, answers: list) -> tuple[str, bool]:
    grads = answers[0]
    ratio = {form: (g.norm() / expected.norm()).item() for form, g in grads.items()}
    said = [f"DataParallelMeshDims({form}='dp') {grads[form].norm():.6f} ({ratio[form]:.3f} of it)" for form in FORMS]
    alone = grads["DTensor alone"]
    return (f"on dp = {WORLD} ranks, fully_shard with {', with '.join(said)}; the DTensor program alone "
            f"{alone.norm():.6f} ({ratio['DTensor alone']:.3f})", any(abs(r - 1) > 1e-5 for r in ratio.values()))


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
