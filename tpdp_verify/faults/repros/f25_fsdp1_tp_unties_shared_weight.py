"""Fault 25 (torch 2.13.0): FSDP1 over a TP'd model unties a weight shared by the embedding and the output head.

FlatParamHandle._init_flat_param_and_metadata (torch/distributed/fsdp/_flat_param.py) finds shared
parameters by a memo of those already flattened, but with TP (FSDP1's DTensorExtensions, installed
for FullyShardedDataParallel(model, device_mesh=mesh["dp"])) it keys the memo by
_ext_pre_flatten_transform's output, the DTensor's local tensor, not by the parameter. The second
reference to the tied DTensor (head.weight = embed.weight, re-tied after parallelize_module) misses
the memo and is flattened as a parameter of its own: after wrapping, embed.weight is not head.weight,
each gets only its own use's gradient, and an optimizer steps them apart. FSDP1 without TP keeps the
tie. 4 ranks, a (dp=2, tp=2) mesh: the tie also breaks on (1, 2), but on one dp rank FSDP1 runs
NO_SHARD, which cannot train a TP'd model (another fault). Run: python f25_fsdp1_tp_unties_shared_weight.py
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

WORLD, TIMEOUT_S, GRACE_S = 4, 60, 5
VOCAB, DIM, HIDDEN, TOKENS, LR = 4, 2, 2, [[0, 3, 1]], 0.1


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(h + self.mlp(h))


def whole(t: torch.Tensor) -> list:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).flatten().tolist()


def one_device() -> dict:
    model = TiedLM()
    model(torch.tensor(TOKENS)).pow(2).sum().backward()
    return {"tied": True, "params": [n for n, _ in model.named_parameters()], "grad": whole(model.embed.weight.grad)}


def train(tp: bool) -> dict:
    """FSDP1 on mesh["dp"], over the model TP'd on mesh["tp"] (or not): the tie, one step's gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    model = TiedLM()
    if tp:
        parallelize_module(model, mesh["tp"], {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Replicate())})  # the head's weight: Shard(0), as the embedding's
        model.head.weight = model.embed.weight  # parallelize_module made two DTensors: tie them again
    fsdp = FSDP(model, device_mesh=mesh["dp"], use_orig_params=True, device_id=torch.device("cpu"))
    out = {"tied": model.head.weight is model.embed.weight, "params": [n for n, _ in model.named_parameters()]}
    optim = torch.optim.SGD(fsdp.parameters(), lr=LR)
    logits = fsdp(torch.tensor(TOKENS))  # the same batch on every rank
    (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).pow(2).sum().backward()
    with FSDP.summon_full_params(fsdp, with_grads=True):
        out |= {"embed grad": whole(model.embed.weight.grad), "head grad": whole(model.head.weight.grad)}
    optim.step()
    with FSDP.summon_full_params(fsdp):
        out["apart"] = max(abs(a - b) for a, b in zip(whole(model.embed.weight), whole(model.head.weight)))
    return out


def on_rank(rank: int) -> dict:
    return {"FSDP1 alone": train(tp=False), "FSDP1 over TP": train(tp=True)}


def grad_diff(got: dict, expected: dict) -> dict:
    return {k: max(abs(a - b) for a, b in zip(got[k], expected["grad"])) for k in ("embed grad", "head grad")}


def departs(got: dict, expected: dict) -> bool:
    return (not got["tied"] or got["params"] != expected["params"] or got["apart"] > 0
            or max(grad_diff(got, expected).values()) > 1e-5)


def describe(got: dict, expected: dict) -> str:
    diff = grad_diff(got, expected)
    return (f"embed.weight is head.weight: {got['tied']}; {len(got['params'])} parameters"
            + (f" ({', '.join(got['params'])})" if got["params"] != expected["params"] else "")
            + f"; gradient of embed.weight off by {diff['embed grad']:.3g}, of head.weight by {diff['head grad']:.3g}"
            + f"; after an SGD step they differ by {got['apart']:.3g}")


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    alone, over_tp = results[0][1]["FSDP1 alone"], results[0][1]["FSDP1 over TP"]
    print(f"expected: embed.weight is head.weight: True; {len(expected['params'])} parameters "
          f"({', '.join(expected['params'])}), one gradient for both (one device); "
          f"FSDP1 alone on mesh['dp']: {describe(alone, expected)}")
    print(f"actual:   FSDP1 on mesh['dp'] over TP on mesh['tp'] (rank 0 of {WORLD}): {describe(over_tp, expected)}")
    present = any(departs(v["FSDP1 over TP"], expected) for _, v in results.values())
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
