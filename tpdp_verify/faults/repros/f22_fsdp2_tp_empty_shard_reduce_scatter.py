"""Fault 22 (torch 2.13.0): FSDP2 cannot backpropagate through a TP'd layer that leaves a tp rank no rows.

ColwiseParallel splits a Linear's output rows like torch.chunk: a hidden width of 1 over 2 tp
ranks leaves rank 1 an empty shard ([0, 1] weight, [0] bias). TP alone trains such a model.
Under fully_shard(model, mesh=mesh["dp"]) or FSDP2's replicate (torch.distributed._composable.
replicate_with_fsdp), the backward's reduce-scatter copy-in
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:foreach_reduce_scatter_copy_in,
called by foreach_reduce) hands that rank's empty gradients to torch._chunk_cat, which refuses
them: RuntimeError "_chunk_cat expects non-empty tensor". 2 ranks, a (dp=1, tp=2) mesh.
Run: python f22_fsdp2_tp_empty_shard_reduce_scatter.py
"""

import logging
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
DIM, HIDDEN = 1, 1  # hidden 1 over tp 2: rank 1's w1 shard is empty
FAULT = "_chunk_cat expects non-empty tensor"


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))


def backward(m: nn.Module) -> None:
    m(torch.ones(2, DIM)).pow(2).sum().backward()  # one backward on a fixed batch


def whole_grads(m: nn.Module) -> dict:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten().tolist()
            for n, p in m.named_parameters()}


def one_device() -> dict:
    m = model()
    backward(m)
    return whole_grads(m)


def tp_model(mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # use_local_output=False: Rowwise gets the DTensor with its true (uneven) global width
    return parallelize_module(model(), mesh["tp"], {"0": ColwiseParallel(use_local_output=False),
                                                    "2": RowwiseParallel()})


def on_rank(rank: int) -> dict:
    """{"TP alone" | "fully_shard" | "replicate (FSDP2)": whole gradients, or the fault's message}."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # full_tensor()'s notes
    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, wrap in (("TP alone", None), ("fully_shard", fully_shard), ("replicate (FSDP2)", replicate)):
        m, said = tp_model(mesh), None
        if wrap is not None:
            wrap(m, mesh=mesh["dp"])
        try:
            backward(m)
        except RuntimeError as exc:  # the fault; dp has one rank, so no rank waits on this one
            if FAULT not in str(exc):
                raise
            said = f"{type(exc).__name__}: {FAULT}"
        # gather the gradients (tp collectives) only where no rank raised
        someone_raised = anyone(said is not None)
        out[name] = said or ("(another rank raised)" if someone_raised else whole_grads(m))
    return out


def anyone(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t)
    return bool(t.item())


def max_diff(got: dict, want: dict) -> float:
    return max(abs(a - b) for n in want for a, b in zip(got[n], want[n]))


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    shown = {n: [round(x, 4) for x in g] for n, g in expected.items()}
    print(f"expected: gradients {shown} (one device); TP alone on {WORLD} tp ranks gives them "
          f"(max abs difference {max(max_diff(v['TP alone'], expected) for _, v in results.values()):.3g})")
    said = []
    for entry in ("fully_shard", "replicate (FSDP2)"):
        raised = {r: v[entry] for r, (_, v) in results.items() if isinstance(v[entry], str) and "another" not in v[entry]}
        said.append(f"{entry} on mesh['dp']: " + ("; ".join(f"rank {r} raised {m} in backward" for r, m in raised.items())
                    if raised else "max abs difference "
                    f"{max(max_diff(v[entry], expected) for _, v in results.values()):.3g}"))
    print(f"actual:   {'; '.join(said)}")
    present = any(isinstance(g, str) or max_diff(g, expected) > 1e-6
                  for _, v in results.values() for g in v.values())
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
