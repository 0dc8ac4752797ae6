"""Benchmark: what a persistent RankPool saves over fresh processes per example.

Run as ``.venv/bin/python bench/bench_pool.py [--examples N] [--fresh-examples M]``.
One TP+DDP gradient check (4 gloo ranks, 2x2 mesh "dp" x "tp") is timed three ways:

  (a) pool   -- N calls of ``RankPool(4).run(check, seed)``: one example per call;
  (b) floor  -- one ``run`` whose ranks loop over the same N checks and time themselves,
                i.e. the same work with no parent round trips;
  (c) fresh  -- M examples, each on 4 newly spawned processes that import torch, join a
                new gloo group, run the check once and exit (MultiProcessTestCase style).

Targets: a/b <= 1.25 (the pool adds little over the bare loop) and c/a >= 100.
Exits 0 whatever the ratios are; exits 1 if the check itself fails, so a broken check
can never be what got timed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import multiprocessing
import os
import platform
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

from tpdp_verify.errors import RankFailed
from tpdp_verify.ranks.pool import RankPool
from tpdp_verify.ranks.rank import device_mesh

WORLD = 4
MESH_SHAPE, MESH_NAMES = (2, 2), ("dp", "tp")
BATCH, D_IN, D_HIDDEN = 8, 16, 32
TOLERANCE = 1e-5
N_PARAMS = 4  # in_proj.{weight,bias}, out_proj.{weight,bias}
TARGET_A_OVER_B, TARGET_C_OVER_A = 1.25, 100.0


# ---------------------------------------------------------------------------
# The check: runs on every rank, identically, so all ranks meet in the same collectives.
# ---------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(D_IN, D_HIDDEN)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(D_HIDDEN, D_IN)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


def _weighted_loss(out, weights, target):
    # Per-sample weights, so a gradient that mixed up which rows a dp rank owns,
    # or summed instead of averaged, would show up (a plain .sum() could hide that).
    return (weights[:, None] * (out - target) ** 2).sum()


def tp_ddp_check(seed: int) -> tuple[int, float]:
    """Gradients of TP+DDP vs the unsharded model; returns (params compared, max |diff|)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = device_mesh(MESH_SHAPE, MESH_NAMES)
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]

    torch.manual_seed(seed)  # same seed on every rank: identical model and batch
    model = MLP()
    reference = copy.deepcopy(model)
    x = torch.randn(BATCH, D_IN)
    target = torch.randn(BATCH, D_IN)
    weights = torch.rand(BATCH)

    parallelize_module(model, tp_mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    ddp = DDP(model, device_mesh=dp_mesh)  # slices a 2-D mesh: calls _pre_dp_module_transform
    # The transform swaps every DTensor parameter for a plain local Parameter tagged with
    # `_st_info` (its DTensorSpec).  Its pre-forward hook then sets the attributes to
    # non-Parameter DTensors, so after forward the module has no parameters left
    # (cf. pytorch/pytorch#152712).  Keep the handles DDP registered now: they are the
    # leaves the gradients, and DDP's all-reduce, land on.
    handles = dict(model.named_parameters())

    rows = BATCH // dp_mesh.size()
    mine = slice(dp_mesh.get_local_rank() * rows, (dp_mesh.get_local_rank() + 1) * rows)
    _weighted_loss(ddp(x[mine]), weights[mine], target[mine]).backward()

    # DDP averages over the dp ranks, so the reference loss is the global sum / dp size.
    (_weighted_loss(reference(x), weights, target) / dp_mesh.size()).backward()
    expected = dict(reference.named_parameters())

    compared, worst = 0, 0.0
    for name, p in handles.items():
        if p.grad is None:
            raise AssertionError(f"{name}: no gradient reached the parameter DDP holds")
        spec = getattr(p, "_st_info", None)
        if spec is None:
            raise AssertionError(f"{name}: DDP's TP transform did not tag it with _st_info")
        full = DTensor.from_local(
            p.grad, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        ).full_tensor()
        worst = max(worst, (full - expected[name].grad).abs().max().item())
        compared += 1
    return compared, worst


def bare_loop(n: int, first_seed: int) -> tuple[float, list]:
    """Floor (b): the same checks in a plain loop on already-initialised ranks."""
    dist.barrier()  # start the clocks together, not when each rank got the message
    start = time.perf_counter()
    results = [tp_ddp_check(first_seed + i) for i in range(n)]
    return time.perf_counter() - start, results


def verify(results, label: str) -> float:
    """Fail loudly if any rank's check compared nothing or disagreed with the reference."""
    for rank, (compared, worst) in enumerate(results):
        if compared != N_PARAMS:
            raise AssertionError(f"{label}: rank {rank} compared {compared} params, expected {N_PARAMS}")
        if not worst <= TOLERANCE:  # also catches NaN
            raise AssertionError(f"{label}: rank {rank} max |grad diff| {worst:.3g} > {TOLERANCE:g}")
    return max(worst for _, worst in results)


# ---------------------------------------------------------------------------
# (c) Fresh processes per example.
# ---------------------------------------------------------------------------


def _fresh_rank(rank: int, port: int, seed: int, conn) -> None:
    """One rank of a one-example world: join, check once, leave, exit."""
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # same as the pool's ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))  # same as the pool
        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
        joined = time.time()  # wall clock: comparable with the parent's across processes
        result = tp_ddp_check(seed)
        checked = time.time()
        dist.destroy_process_group()
        conn.send(("ok", result, joined, checked))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def fresh_example(seed: int) -> tuple[list, float, float]:
    """Spawn 4 processes for one example and wait for them all to exit.

    Returns the results and when (seconds after the start) the last rank had joined
    the group and the last rank had finished the check.
    """
    start = time.time()
    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore(  # hosted here so children only need the port; 0 = OS picks
        "127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )
    procs, conns = [], []
    for rank in range(WORLD):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_fresh_rank, args=(rank, store.port, seed, child_end))
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    replies = []
    for rank, (proc, conn) in enumerate(zip(procs, conns)):
        if not conn.poll(300):
            raise RuntimeError(f"fresh rank {rank} sent nothing within 300 s")
        replies.append(conn.recv())
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    errors = [r[1] for r in replies if r[0] != "ok"]
    if errors:
        raise RuntimeError(f"a fresh rank failed:\n{errors[0]}")
    joined = max(r[2] for r in replies) - start
    checked = max(r[3] for r in replies) - start
    return [r[1] for r in replies], joined, checked


# ---------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=30, help="N for (a) and (b)")
    parser.add_argument("--fresh-examples", type=int, default=3, help="M for (c)")
    args = parser.parse_args()
    n, m = args.examples, args.fresh_examples
    if n < 1 or m < 1:
        parser.error("--examples and --fresh-examples must be at least 1")

    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, "
          f"CUDA {'available' if torch.cuda.is_available() else 'not available'}, "
          f"Python {platform.python_version()}, {platform.system()} {platform.machine()}")
    print(f"check: TP+DDP gradients vs unsharded MLP({D_IN}->{D_HIDDEN}->{D_IN}), "
          f"batch {BATCH}, {WORLD} gloo ranks, mesh {MESH_SHAPE} {MESH_NAMES}\n", flush=True)

    try:
        startup, pool = timed(RankPool, WORLD, "gloo")
        with pool:
            # Warm-up: the first call creates the mesh's subgroups and imports the TP
            # modules; both are one-time costs that neither (a) nor (b) should carry.
            first, results = timed(pool.run, tp_ddp_check, 0)
            worst = verify(results, "warm-up")

            per_call = []
            for i in range(n):
                elapsed, results = timed(pool.run, tp_ddp_check, 1 + i)
                worst = max(worst, verify(results, f"(a) example {i}"))
                per_call.append(elapsed)
            a = sum(per_call) / n

            replies = pool.run(bare_loop, n, 1)
            for i in range(n):
                worst = max(worst, verify([r[1][i] for r in replies], f"(b) example {i}"))
            b = max(r[0] for r in replies) / n

        fresh = []
        for i in range(m):
            elapsed, (results, joined, checked) = timed(fresh_example, 1 + i)
            worst = max(worst, verify(results, f"(c) example {i}"))
            fresh.append(elapsed)
            print(f"  fresh example {i}: {elapsed:.2f} s  (all ranks joined the group at "
                  f"{joined:.2f} s, checked at {checked:.2f} s, exited at {elapsed:.2f} s)",
                  flush=True)
        c = sum(fresh) / m
    except (AssertionError, RankFailed) as exc:  # the check failed (here or on a rank)
        print(f"\nCHECK FAILED: {exc}", file=sys.stderr)
        return 1

    per_call.sort()
    print()
    print(f"{'measurement':<44} {'examples':>8} {'per example':>12}")
    print(f"{'(a) RankPool(4).run, one example a call':<44} {n:>8} {a * 1e3:>9.1f} ms"
          f"   (median {per_call[n // 2] * 1e3:.1f} ms, min {per_call[0] * 1e3:.1f} ms)")
    print(f"{'(b) floor: bare loop inside the ranks':<44} {n:>8} {b * 1e3:>9.1f} ms")
    print(f"{'(c) fresh 4 processes per example':<44} {m:>8} {c:>10.2f} s")
    print(f"{'pool start-up, RankPool(4) constructor':<44} {'':>8} {startup:>10.2f} s")
    print(f"{'first call (mesh creation + imports)':<44} {'':>8} {first:>10.2f} s")
    print()
    print(f"a/b = {a / b:7.2f}   target <= {TARGET_A_OVER_B:g}   {mark(a / b <= TARGET_A_OVER_B)}")
    print(f"c/a = {c / a:7.1f}   target >= {TARGET_C_OVER_A:g}   {mark(c / a >= TARGET_C_OVER_A)}")
    print(f"every check compared {N_PARAMS} parameter gradients on all {WORLD} ranks; "
          f"largest |diff| {worst:.2g} (tolerance {TOLERANCE:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
