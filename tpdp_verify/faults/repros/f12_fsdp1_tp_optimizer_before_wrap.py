"""Fault 12 (torch 2.13.0): with TP, FSDP1 trains nothing an optimizer built before wrapping holds.

FSDP1 with use_orig_params=True keeps the user's parameter objects, so an optimizer built
before wrapping trains the model: plain FSDP1 does. With TP the parameters are DTensors;
FlatParamHandle._init_flat_param_and_metadata (torch/distributed/fsdp/_flat_param.py) flattens
each one's local shard (DTensorExtensions.pre_flatten_transform) and keeps *that* as the
original parameter (_convert_to_params), so the module computes with new tensors and the
optimizer's DTensors get no gradient: the step moves nothing. A (dp=2, tp=1) mesh is the
smallest world; a (2, 2) mesh on 4 ranks does the same. Run: python f12_fsdp1_tp_optimizer_before_wrap.py
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


def one_step(model, fsdp_kwargs=None) -> tuple[float, list[bool]]:
    """Build SGD on `model`, wrap it in FSDP1 (unless fsdp_kwargs is None: one device) and
    take one step: (largest change of a parameter the model computes with, for each
    parameter the optimizer holds whether it got a gradient)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # before wrapping, as plain FSDP1 allows
    if fsdp_kwargs is not None:
        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"), **fsdp_kwargs)
    local = lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    before = [local(p) for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()  # the same batch on every rank
    optimizer.step()
    moved = max((local(p) - b).abs().max().item() for p, b in zip(model.parameters(), before) if b.numel())
    return moved, [p.grad is not None for p in optimizer.param_groups[0]["params"]]


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    models = {k: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)) for k in ("one", "plain", "tp")}
    for model in models.values():
        model.load_state_dict(models["one"].state_dict())
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
    parallelize_module(models["tp"], mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return {"one": one_step(models["one"]), "plain": one_step(models["plain"], {"process_group": dist.group.WORLD}),
            "tp": one_step(models["tp"], {"device_mesh": mesh["dp"]})}


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    results = {rank: value for rank, (_, value) in results.items()}

    def over_ranks(key):  # (largest change on any rank, parameters that got a gradient on some rank, held)
        graded = [any(g) for g in zip(*(r[key][1] for r in results.values()))]
        return max(r[key][0] for r in results.values()), sum(graded), len(graded)

    one, plain, tp = over_ranks("one"), over_ranks("plain"), over_ranks("tp")
    print(f"expected: one SGD step, the optimizer built before wrapping, moves a parameter by up to {one[0]:.4f} "
          f"on one device and {plain[0]:.4f} under plain FSDP1 ({plain[1]} of {plain[2]} held got a gradient)")
    print(f"actual:   FSDP1 + TP (FSDP1 on mesh['dp'] of a ({WORLD}, 1) mesh): it moves a parameter by up to "
          f"{tp[0]:.4f}; {tp[1]} of the {tp[2]} parameters the optimizer holds got a gradient")
    present = tp[1] < tp[2] or abs(tp[0] - one[0]) > 1e-6
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
