"""Fault 09 (torch 2.13.0): activation checkpointing, or a block called directly, under DDP with TP.

DDP(device_mesh=mesh["dp"]) runs _pre_dp_module_transform (torch/distributed/tensor/parallel/ddp.py),
whose forward hook _localize_dtensor swaps every DTensor parameter still registered for a
plain local shard *after* the forward. A block checkpointed with
torch.distributed._composable.checkpoint is recomputed in the backward, after that hook, and
meets other parameters than its forward did: CheckpointError. torch 2.13 escapes it on most
models only because its hooks leave the DTensors out of the registry (fault 1); a weight tied
between an embedding and the output head keeps one registered site, and the head's
recomputation breaks. 2 gloo ranks, a (dp=1, tp=2) mesh; init_sync=False skips DDP's broadcast,
which refuses the tied DTensor (fault 3). Run: python f09_checkpoint_under_ddp_tp.py
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
from torch import nn

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5
TOKENS = torch.tensor([[0], [1]])  # (batch, seq): the same batch on every rank


class TiedLM(nn.Module):
    """Embedding and output head share one [vocab, dim] weight, an MLP between them."""

    def __init__(self, vocab: int = 2, dim: int = 1, hidden: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.mlp(h))


def loss_of(model) -> torch.Tensor:
    return F.cross_entropy(model(TOKENS).flatten(0, 1), TOKENS.flatten())


def ddp_tp_loss(mesh, checkpointed: bool) -> str:
    """One forward and backward of the TP'd tied model under DDP: its loss, or the error."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = parallelize_module(TiedLM(), mesh["tp"], {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate())})
    model.head.weight = model.embed.weight  # parallelize_module made two DTensors: tie them again
    if checkpointed:  # every block, after TP and before DP, as torchtitan orders it
        for block in (model.embed, model.mlp, model.head):
            checkpoint(block)
    ddp = DDP(model, device_mesh=mesh["dp"], init_sync=False)
    try:
        loss = loss_of(ddp)
        loss.backward()
    except RuntimeError as exc:  # CheckpointError is one; fault 3 raises in the backward too
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:105]}"
    return f"loss {loss.item():.6f}"


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    return {"one": f"loss {loss_of(TiedLM()).item():.6f}", "plain": ddp_tp_loss(mesh, checkpointed=False),
            "checkpointed": ddp_tp_loss(mesh, checkpointed=True)}


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    results = {rank: value for rank, (_, value) in results.items()}
    r = results[0]
    print(f"expected: DDP + TP with every block checkpointed trains as without checkpointing and as one device "
          f"({r['one']})")
    print(f"actual:   checkpointed: {r['checkpointed']} (without checkpointing: {r['plain']})")
    # The fault is what checkpointing changes; an error both runs share is another fault's (3).
    present = any(v["checkpointed"] != v["plain"] for v in results.values())
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
