"""Fault 05 (torch 2.13.0): entry points that depart whatever the transform.

Three checks on 2 gloo ranks, a (dp=1, tp=2) mesh for the TP ones:
1. replicate(model, device_mesh=mesh["dp"]) with TP: _ReplicateState.init
   (torch/distributed/_composable/replicate.py) localizes the DTensor parameters lazily, in
   the first forward, so an optimizer built after replicate() holds DTensors that are no longer
   the module's: none gets a gradient, the model never trains.
2. DDP(model, device_mesh=mesh["dp"]) with TP and the optimizer built before wrapping:
   _localize_dtensor (torch/distributed/tensor/parallel/ddp.py) swaps every DTensor parameter
   for a new Parameter, so the optimizer's get no gradient (plain DDP allows this order).
3. FSDP.optim_state_dict (plain FSDP1, no TP, on the CPU) hands out Adam's exp_avg holding
   exp_avg_sq: _allgather_orig_param_states reuses one gather buffer for every state, and
   _unflatten_orig_param_states "offloads" views of it with .cpu(), a no-op on the CPU.
Run: python f05_entry_points_depart.py
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


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))


def tp_mlp(mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})


def graded(optimizer) -> int:
    return sum(p.grad is not None for p in optimizer.param_groups[0]["params"])


def replicate_then_optimizer(mesh) -> int:
    """replicate() first, then the optimizer: how many of its 4 parameters get a gradient."""
    from torch.distributed._composable.replicate import replicate

    model = replicate(tp_mlp(mesh), device_mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    return graded(optimizer)


def optimizer_then_ddp(mesh, tp: bool) -> int:
    """The optimizer built before DDP wraps the model: how many of 4 parameters get a gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tp_mlp(mesh) if tp else mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = DDP(model, device_mesh=mesh["dp"]) if tp else DDP(model)
    ddp(torch.ones(2, 4)).sum().backward()
    return graded(optimizer)


def adam_state(fsdp: bool) -> dict:
    """Adam's state after one step, by parameter name: {name: (exp_avg, exp_avg_sq)} as lists."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(mlp(), use_orig_params=True, device_id=torch.device("cpu")) if fsdp else mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()  # the same batch on every rank
    optimizer.step()
    if fsdp:
        state = FSDP.optim_state_dict(model, optimizer)["state"]
    else:
        state = {n: optimizer.state[p] for n, p in model.named_parameters()}
    return {n: (s["exp_avg"].flatten().tolist(), s["exp_avg_sq"].flatten().tolist()) for n, s in state.items()}


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    return {"replicate": replicate_then_optimizer(mesh), "ddp_tp": optimizer_then_ddp(mesh, tp=True),
            "ddp_plain": optimizer_then_ddp(mesh, tp=False), "adam_one": adam_state(fsdp=False),
            "adam_fsdp": adam_state(fsdp=True)}


def max_diff(a: dict, b: dict, which: int) -> float:
    return max(abs(x - y) for n in a for x, y in zip(a[n][which], b[n][which]))


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    results = {rank: value for rank, (_, value) in results.items()}
    r = results[0]
    one, fsdp = r["adam_one"], r["adam_fsdp"]
    avg, avg_sq = (max(abs(x) for v in one.values() for x in v[i]) for i in (0, 1))
    print(f"expected: optimizer after replicate(): 4 of 4 parameters get a gradient; optimizer before DDP: 4 of 4 "
          f"(plain DDP: {r['ddp_plain']} of 4); FSDP.optim_state_dict's exp_avg is one device's (max |exp_avg| "
          f"{avg:.3g}, |exp_avg_sq| {avg_sq:.3g})")
    print(f"actual:   replicate + TP: {r['replicate']} of 4; DDP + TP: {r['ddp_tp']} of 4; FSDP1 exp_avg is off one "
          f"device's by up to {max_diff(fsdp, one, 0):.3g} and off its exp_avg_sq by {max_diff(fsdp, one, 1):.3g} "
          f"(exp_avg == exp_avg_sq: {all(fsdp[n][0] == fsdp[n][1] for n in fsdp)})")
    present = any(res["replicate"] < 4 or res["ddp_tp"] < 4
                  or max(max_diff(res["adam_fsdp"], res["adam_one"], i) for i in (0, 1)) > 1e-6
                  for res in results.values())
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
