"""Fault 03 (torch 2.13.0): Tied parameters come apart, and DDP cannot wrap them.

An embedding tied to the output head shares one DTensor after parallelize_module (re-tied).
DistributedDataParallel(model, device_mesh=mesh["dp"]) localizes it in torch/distributed/
tensor/parallel/ddp.py:_localize_dtensor, which walks the deduplicated named_parameters():
embed.weight becomes the local shard, head.weight keeps the DTensor, the tie is gone, and
DDP's initial broadcast of the parameters (distributed/utils.py:_sync_module_states) meets
the DTensor and raises. 2 ranks, a (dp=1, tp=2) mesh. Run: python f03_ddp_tp_tied_params.py
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
VOCAB, DIM = 8, 4


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def tokens() -> torch.Tensor:
    return torch.tensor([[1, 5, 7, 2]])


def one_device() -> torch.Tensor:
    return TiedLM()(tokens()).detach()


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate())}  # both shard the weight's vocab rows
    tp = parallelize_module(TiedLM(), mesh["tp"], plan)
    tp.head.weight = tp.embed.weight  # parallelize_module made two DTensors: tie them again
    try:
        ddp = DDP(tp, device_mesh=mesh["dp"])  # runs _pre_dp_module_transform(tp)
    except (NotImplementedError, RuntimeError) as exc:
        if not reached_broadcast(exc):
            raise
        sites = ", ".join(f"{n}.weight a {type(getattr(tp, n).weight).__name__}" for n in ("embed", "head"))
        return {"raised": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "sites": sites}
    return {"raised": None, "tied": tp.head.weight is tp.embed.weight,
            "logits": ddp(tokens()).detach().tolist()}  # a list: a tensor would travel by shared memory


def reached_broadcast(exc: Exception) -> bool:
    """The fault: the DTensor left at head.weight reached DDP's broadcast of the parameters.

    Bucketed with the local shard, torch.cat raises (RuntimeError: mixed torch.Tensor and
    DTensor); c10d.broadcast_ on a DTensor would raise NotImplementedError (no sharding strategy).
    """
    text = str(exc)
    return "mixed torch.Tensor and DTensor" in text or "does not have a sharding strategy" in text


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    answers = [v for _, v in results.values()]
    print(f"expected: DDP wraps, embed.weight is head.weight, logits as on one device "
          f"(shape {list(expected.shape)})")
    got = answers[0]
    if got["raised"]:
        print(f"actual:   DDP(device_mesh=mesh['dp']) raised {got['raised']} "
              f"(rank 0 of {WORLD}; the transform left {got['sites']})")
    else:
        diff = max((torch.tensor(v["logits"]) - expected).abs().max().item() for v in answers)
        print(f"actual:   DDP wraps, embed.weight is head.weight = {got['tied']}, "
              f"logits max abs diff {diff:.3g}")
    present = any(v["raised"] or not v["tied"] or not torch.allclose(torch.tensor(v["logits"]), expected)
                  for v in answers)
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
