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
import queue
import signal
import socket
import sys
import traceback
import warnings
from datetime import timedelta
from time import monotonic

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD, TIMEOUT_S, GRACE_S = 4, 60, 3
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
            got[strategy] = model(batch).detach()
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
        outs = [a[strategy] for a in answers if not isinstance(a[strategy], str)]
        wrong = bool(got) or any(not torch.allclose(o, expected, atol=1e-5) for o in outs)
        present |= wrong and strategy == "NO_SHARD"
        parts.append(f"{strategy} " + (f"raised {got.pop()}" if got else
                                       f"max |out| {max(o.abs().max() for o in outs):.5f}" + " (wrong)" * wrong))
    return "FSDP1 over mesh['dp'] of a ColwiseParallel Linear on a (2, 2) mesh: " + "; ".join(parts), present


# --- the same in every repro: gloo ranks on 127.0.0.1 answer once; a timeout catches hangs ------

def rank_main(rank, port, answers, done):
    warnings.filterwarnings("ignore")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = timedelta(seconds=TIMEOUT_S + 30)  # the parent calls a hang first
    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
        answers.put((rank, "ok", on_rank(rank)))
    except Exception as exc:
        if is_fault(exc):
            answers.put((rank, "raised", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"))
        else:
            answers.put((rank, "error", traceback.format_exc()))
    done.wait()  # stay in the group, as a job's rank would, until every rank has answered


def run_ranks() -> dict:
    """{rank: (status, value)}, status one of ok, raised (the fault), error, hung, aborted."""
    ctx = mp.get_context("spawn")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # a free port, on loopback only
    listener.listen(WORLD + 1)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach(), timeout=timedelta(seconds=TIMEOUT_S))
    answers, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=rank_main, args=(r, port, answers, done)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {}, monotonic() + TIMEOUT_S
    while len(results) < WORLD and monotonic() < deadline:
        try:
            rank, status, value = answers.get(timeout=0.2)
        except queue.Empty:
            results.update({r: ("aborted", p.exitcode) for r, p in enumerate(procs)
                            if r not in results and p.exitcode not in (None, 0)})
            continue
        results[rank] = (status, value)
        if status != "ok":  # the others may be waiting for this rank: a grace, not the timeout
            deadline = min(deadline, monotonic() + GRACE_S)
    done.set()
    for r, p in enumerate(procs):
        p.join(timeout=5 if r in results else 0)
        if p.is_alive():
            p.kill()
            p.join()
    del store
    return {r: results.get(r, ("hung", None)) for r in range(WORLD)}


def failures(results: dict) -> str:
    """The ranks that raised the fault, aborted or hung (and what the others then raised), in words."""
    said = {}
    for kind in ("raised", "aborted", "hung", "error"):
        for r, (status, value) in results.items():
            if status == kind == "raised":
                said.setdefault(f"raised {value}", []).append(r)
            elif status == kind == "aborted":
                name = signal.Signals(-value).name if value < 0 else f"exit code {value}"
                said.setdefault(f"aborted with {name}", []).append(r)
            elif status == kind == "hung":
                said.setdefault("hung (no answer; killed)", []).append(r)
            elif status == kind == "error":
                said.setdefault(f"then raised {value.strip().splitlines()[-1]}", []).append(r)
    return "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {what}" for what, rs in said.items())


def main() -> int:
    expected = one_device()
    results = run_ranks()
    statuses = {status for status, _ in results.values()}
    if "error" in statuses and not statuses & {"raised", "aborted"}:  # a bug in this script, not the fault
        print(next(value for status, value in results.values() if status == "error"), file=sys.stderr)
        return 2
    actual = failures(results)
    present = bool(actual)
    if not present:
        actual, present = judge(expected, [value for _, value in results.values()])
    print(f"expected: {describe(expected)}")
    print(f"actual:   {actual}")
    print("fault present" if present else "fault absent")
    return int(present)


if __name__ == "__main__":
    sys.exit(main())
