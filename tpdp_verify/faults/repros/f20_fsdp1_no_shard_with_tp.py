"""Fault 20 (torch 2.13.0): FSDP1's NO_SHARD cannot train a TP'd model.

FSDP1 with sharding_strategy=NO_SHARD over mesh["dp"] of a model whose parameters TP made
DTensors raises in its first forward: torch/distributed/fsdp/_flat_param.py:
FlatParamHandle._writeback_orig_params runs for NO_SHARD (sharded strategies return early),
takes the DTensor that DTensorExtensions put on the module for a parameter the user replaced
(`getattr(module, param_name) is not param`), and writes back its global-size view where the
flat parameter holds the local shard: _writeback_tensor raises "Cannot writeback when ...".
FULL_SHARD trains the same model; NO_SHARD trains it without TP. 4 ranks: dp and tp of 2
(a dp of 1 switches every strategy to NO_SHARD). Run: python f20_fsdp1_no_shard_with_tp.py
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
STRATEGIES = ("FULL_SHARD", "NO_SHARD")  # FULL_SHARD: the same model, sharded, for contrast


def data() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, 8), torch.randn(4, 4)  # the model, the global batch (2 rows a dp rank)


def step(model: nn.Module, rows: torch.Tensor, optimizer) -> None:
    model(rows).square().mean().backward()
    optimizer.step()


def one_device() -> torch.Tensor:
    model, batch = data()
    step(model, batch, torch.optim.SGD(model.parameters(), lr=0.1))
    return model(batch).detach()


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    got = {}
    for strategy in STRATEGIES:
        model, batch = data()
        model = parallelize_module(model, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
        model = FSDP(model, device_mesh=mesh["dp"], sharding_strategy=ShardingStrategy[strategy],
                     use_orig_params=True, device_id=torch.device("cpu"))
        try:
            step(model, batch.chunk(2)[mesh.get_local_rank("dp")], torch.optim.SGD(model.parameters(), lr=0.1))
            got[strategy] = model(batch).detach().tolist()  # plain values: the rank exits once it answers
        except RuntimeError as exc:
            if not is_fault(exc):
                raise
            got[strategy] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return got


def is_fault(exc: Exception) -> bool:
    return "Cannot writeback when the parameter shape changes" in str(exc)


def describe(expected: torch.Tensor) -> str:
    return f"after one SGD step the output is one device's, max |out| {expected.abs().max():.5f}"


def judge(expected: torch.Tensor, answers: list) -> tuple[str, bool]:
    parts, present = [], False
    for strategy in STRATEGIES:
        got = {a[strategy] if isinstance(a[strategy], str) else "" for a in answers} - {""}
        outs = [torch.tensor(a[strategy]) for a in answers if not isinstance(a[strategy], str)]
        wrong = bool(got) or any(not torch.allclose(o, expected, atol=1e-5) for o in outs)
        present |= wrong and strategy == "NO_SHARD"
        parts.append(f"{strategy} " + (f"raised {got.pop()}" if got else
                                       f"max |out| {max(o.abs().max() for o in outs):.5f}" + " (wrong)" * wrong))
    return "FSDP1 over mesh['dp'] of a ColwiseParallel Linear on a (2, 2) mesh: " + "; ".join(parts), present


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
