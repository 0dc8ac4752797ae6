"""Fault 33 (torch 2.13.0): DDP with TP cannot wrap a model holding a DTensor buffer.

A TP model whose buffer is a DTensor replicated over tp (torchtitan's RoPE cache, its
rotations, is one) cannot be wrapped by DistributedDataParallel(model, device_mesh=mesh["dp"]):
torch/distributed/tensor/parallel/ddp.py:_pre_dp_module_transform turns the DTensor parameters
into local tensors for DDP, but not the buffers, and DDP's initial sync of the module's states
(_sync_module_states) then broadcasts a DTensor: "Operator c10d.broadcast_.default does not have
a sharding strategy registered" (or, coalesced with plain tensors, "aten.cat.default got mixed
torch.Tensor and DTensor"). The same model with a plain buffer wraps
and trains; FSDP1 and FSDP2 take the DTensor buffer. 2 ranks, a (dp=2, tp=1) mesh, a Linear
under ColwiseParallel and a complex64 rotation buffer. Run: python f33_ddp_tp_dtensor_buffer.py
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
CASES = ("a plain buffer", "a DTensor buffer replicated over tp")


class Rotated(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("rotation", torch.polar(torch.ones(4), torch.arange(4.0)))

    def forward(self, x):
        rotation = self.rotation.to_local() if hasattr(self.rotation, "to_local") else self.rotation
        turned = x.to(rotation.dtype) * rotation
        return self.proj(turned.real + turned.imag)


def on_rank(rank: int) -> dict:
    """{case: "wrapped" (DDP took the model, and a step ran), or what DDP raised}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
    out = {}
    for case in CASES:
        torch.manual_seed(0)
        model = parallelize_module(Rotated(), mesh["tp"], {"proj": ColwiseParallel()})
        if case == CASES[1]:
            model._buffers["rotation"] = distribute_tensor(model.rotation, mesh["tp"], [Replicate()])
        try:
            wrapped = DDP(model, device_mesh=mesh["dp"])
        except RuntimeError as exc:
            out[case] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            continue
        wrapped(torch.ones(2, 4)).sum().backward()
        out[case] = "wrapped"
    return out


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    got = results[0][1]
    present = got[CASES[0]] == "wrapped" and got[CASES[1]] != "wrapped"
    print("expected: DistributedDataParallel(model, device_mesh=mesh['dp']) wraps a TP model, and a step runs, "
          "whatever its buffers are")
    print("actual:   " + "; ".join(f"{case}: {got[case]}" for case in CASES))
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
