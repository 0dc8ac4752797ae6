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

import datetime
import os
import signal
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD, TIMEOUT = 2, 60
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


def on_rank(rank: int, send) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    send("one", f"loss {loss_of(TiedLM()).item():.6f}")
    send("plain", ddp_tp_loss(mesh, checkpointed=False))
    send("checkpointed", ddp_tp_loss(mesh, checkpointed=True))


# --- boilerplate: gloo ranks on loopback, joined with a timeout --------------------------

def rank_entry(rank: int, port: int, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo listens on loopback only
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    # on_rank sends plain values (no tensors) as it goes; an exception it lets out is a bug of this file
    on_rank(rank, lambda key, value: queue.put((rank, key, value)))
    queue.put((rank, "done", True))
    dist.destroy_process_group()


def launch() -> tuple[dict, dict]:
    """Run on_rank on WORLD ranks: ({rank: {key: value}}, {rank: 'hung' | 'aborted with SIG..' | 'raised'}),
    the second for ranks that did not finish on_rank."""
    listener = socket.create_server(("127.0.0.1", 0))  # a free port, loopback only
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], WORLD + 1, is_master=True,
                          wait_for_workers=False, master_listen_fd=listener.detach())
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_entry, args=(r, store.port, queue), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {r: {} for r in range(WORLD)}, time.monotonic() + TIMEOUT

    def drain():
        while not queue.empty():
            rank, key, value = queue.get()
            results[rank][key] = value

    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        drain()
        if any(p.exitcode for p in procs) or all("done" in r for r in results.values()):
            deadline = min(deadline, time.monotonic() + 5)  # a rank died, or all finished: 5 s more
        time.sleep(0.05)
    drain()
    failed = {}
    for rank, p in enumerate(procs):
        if p.exitcode is None:
            failed[rank] = "hung"
            p.kill()
            p.join()
        elif p.exitcode != 0:
            failed[rank] = f"aborted with {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else "raised"
        if results[rank].pop("done", False) and rank in failed:  # in teardown, after its work: not ours
            print(f"note: rank {rank} {failed.pop(rank)} after finishing on_rank", file=sys.stderr)
    return results, failed


def main() -> int:
    results, failed = launch()
    if failed:
        print(f"repro error: ranks {failed} (see stderr)", file=sys.stderr)
        return 2
    r = results[0]
    print(f"expected: DDP + TP with every block checkpointed trains as without checkpointing and as one device "
          f"({r['one']})")
    print(f"actual:   checkpointed: {r['checkpointed']} (without checkpointing: {r['plain']})")
    # The fault is what checkpointing changes; an error both runs share is another fault's (3).
    present = any(v["checkpointed"] != v["plain"] for v in results.values())
    print("fault present" if present else "fault absent")
    return 1 if present else 0


if __name__ == "__main__":
    sys.exit(main())
