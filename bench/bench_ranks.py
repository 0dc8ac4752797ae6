"""Benchmark: how the ranks of a pool share this machine's cores.

Run as ``.venv/bin/python bench/bench_ranks.py [--world-sizes 2 4] [--calls 20]``.
For each world size, a RankPool's ranks report their torch intra-op threads, interop
threads, the CPUs they may run on (``sched_getaffinity``) and how long their first
collective took from the pool's start; then ``--calls`` TP+DDP training cases (the suite's
own, ``trains_like_one_device`` on the simplest MLP case) are timed through the pool, with
the threads as the pool sets them (cores // world size each) and with torch's default
(every core each: what a 16-core machine gave the smoke gate before the pool set them).

Prints the ratio default / set per world size: above 1, oversubscribed ranks cost that
much. Exits 0 whatever the ratio; 1 if a case fails, so a broken case is never what got timed.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.ranks.pool import RankPool


def about_me(start: float) -> dict:
    """On a rank: its threads, its CPUs, and when its first collective returned."""
    import torch.distributed as dist

    t = torch.zeros(1)
    dist.all_reduce(t)
    return {"threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
            "cpus": len(os.sched_getaffinity(0)), "first_collective_s": time.time() - start}


def timed(world_size: int, calls: int, threads: int | None) -> tuple[list[dict], float]:
    """The ranks' reports and the seconds ``calls`` cases took, with OMP_NUM_THREADS=``threads``
    (None: as the pool sets them)."""
    from tpdp_verify.oracles.verdicts import verdict_one_device

    saved = os.environ.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        start = time.time()
        with RankPool(world_size) as pool:
            reports = pool.run(about_me, start)
            case = TrainCase(model="mlp", mesh_shape=(world_size // 2, 2), entry="fully_shard")
            verdict_one_device(pool, "torch", case)  # warm: the first call builds caches
            t0 = time.perf_counter()
            for _ in range(calls):
                verdict = verdict_one_device(pool, "torch", case)
                if not verdict.ok:
                    raise SystemExit(f"the timed case departs: {verdict.report()}")
            return reports, time.perf_counter() - t0
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"{platform.node()}: {cores} cores, torch {torch.__version__}")
    for ws in args.world_sizes:
        reports, set_s = timed(ws, args.calls, None)
        for rank, r in enumerate(reports):
            print(f"  world {ws} rank {rank}: {r['threads']} threads ({r['interop']} interop), {r['cpus']} CPUs, "
                  f"first collective {r['first_collective_s']:.2f} s after the pool's start")
        _, default_s = timed(ws, args.calls, cores)
        print(f"world {ws}: {args.calls} cases in {set_s:.2f} s with {max(1, cores // ws)} threads a rank, "
              f"{default_s:.2f} s with {cores} (torch's default): ratio {default_s / set_s:.2f}")


if __name__ == "__main__":
    main()
