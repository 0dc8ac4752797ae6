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
        grads[form or "DTensor alone"] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).tolist()
    return grads  # plain values: the rank exits once it answers


def describe(expected: torch.Tensor) -> str:
    return f"the weight's gradient norm {expected.norm():.6f} (one device), with or without fully_shard"


def judge(expected: torch.Tensor, answers: list) -> tuple[str, bool]:
    grads = {form: torch.tensor(g) for form, g in answers[0].items()}
    ratio = {form: (g.norm() / expected.norm()).item() for form, g in grads.items()}
    said = [f"DataParallelMeshDims({form}='dp') {grads[form].norm():.6f} ({ratio[form]:.3f} of it)" for form in FORMS]
    alone = grads["DTensor alone"]
    return (f"on dp = {WORLD} ranks, fully_shard with {', with '.join(said)}; the DTensor program alone "
            f"{alone.norm():.6f} ({ratio['DTensor alone']:.3f})", any(abs(r - 1) > 1e-5 for r in ratio.values()))


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
