"""Fault 26 (torch 2.13.0): FSDP1 cannot wrap a TP'd module that leaves a tp rank no parameter element.

ColwiseParallel splits a Linear's output rows like torch.chunk: Linear(1, 1) over 2 tp ranks
leaves tp rank 1 a [0, 1] weight and a [0] bias. Wrapped as an FSDP1 unit of its own (an
auto_wrap_policy, as users wrap each block), that rank's FlatParameter has no element:
FlatParamHandle.shard (torch/distributed/fsdp/_flat_param.py) passes unsharded_end_idx -1 to
_init_shard_metadata, whose _p_assert raises AssertionError "unsharded_start_idx: 0
unsharded_end_idx: -1" in FullyShardedDataParallel.__init__, on that rank only. The same TP'd model
wrapped as one unit trains like one device. 4 ranks, a (dp=2, tp=2) mesh: on (1, 2) the wrap
raises too, but one dp rank runs NO_SHARD, which cannot train a TP'd model (another fault).
Run: python f26_fsdp1_tp_empty_unit_assert.py
"""

import io
import os
import socket
import sys
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from datetime import timedelta
from time import monotonic, sleep

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD, TIMEOUT_S, GRACE_S = 4, 60, 5
DIM, HIDDEN = 1, 1  # hidden 1 over tp 2: tp rank 1 holds none of the first Linear
FAULT = "unsharded_start_idx: 0 unsharded_end_idx: -1"


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))


def one_device() -> dict:
    m = model()
    m(torch.ones(2, DIM)).pow(2).sum().backward()
    return {n: p.grad.flatten().tolist() for n, p in m.named_parameters()}


def wrap(mesh, per_linear: bool):
    """The TP'd model in FSDP1 on mesh["dp"]: as one unit, or each Linear a unit of its own."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # use_local_output=False: Rowwise gets the DTensor with its true (uneven) global width
    tp = parallelize_module(model(), mesh["tp"], {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel()})
    policy = {"auto_wrap_policy": ModuleWrapPolicy({nn.Linear})} if per_linear else {}
    return FSDP(tp, device_mesh=mesh["dp"], use_orig_params=True, device_id=torch.device("cpu"), **policy)


def whole_grads(fsdp) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fsdp(torch.ones(2, DIM)).pow(2).sum().backward()  # the same batch on every rank
    with FSDP.summon_full_params(fsdp, with_grads=True):
        return {n.replace("_fsdp_wrapped_module.", ""): p.grad.full_tensor().flatten().tolist()
                for n, p in fsdp.named_parameters()}


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    out = {"one unit": whole_grads(wrap(mesh, per_linear=False))}
    try:  # only wrapped: no collective after it, so ranks that raise leave none waiting
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):  # _p_assert prints a stack first
            wrap(mesh, per_linear=True)
        out["per Linear"] = "wrapped"
    except AssertionError as exc:
        if FAULT not in str(exc):
            raise
        out["per Linear"] = f"{type(exc).__name__}: {FAULT}"
    return out


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    diff = max(abs(a - b) for _, v in results.values() for n, g in expected.items()
               for a, b in zip(v["one unit"][n], g))
    print(f"expected: FSDP1 wraps the TP'd Linear({DIM}, {HIDDEN}) -> Linear({HIDDEN}, {DIM}) each Linear a unit, "
          f"as it wraps it as one unit, which trains like one device (max abs gradient difference {diff:.3g})")
    said = {}
    for r, (_, v) in results.items():
        said.setdefault(v["per Linear"], []).append(r)
    print("actual:   FullyShardedDataParallel(auto_wrap_policy=ModuleWrapPolicy({nn.Linear})) on a (dp=2, tp=2) mesh: "
          + "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} "
                      + ("raised " if what != "wrapped" else "") + what for what, rs in said.items()))
    present = diff > 1e-6 or any(v["per Linear"] != "wrapped" for _, v in results.values())
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
