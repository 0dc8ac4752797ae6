"""Benchmark: does a long run on one RankPool leak memory, descriptors, processes or sockets?

Run as ``.venv/bin/python bench/bench_endurance.py [--examples N] [--warm-up W]``.
N examples (default 1000) of the ci gradient property, ``trains_like_one_device``, run
against the reference transform on one ``RankPool(4)``: the cases are drawn by the
property's own strategy (``sound_cases(4)``, derandomized) and each is judged by the
property's function, exactly as the gate judges it (the ranks train, the parent runs the
oracles and compares). The reference passes every case, so nothing is shrunk.

Sampled from /proc (no psutil) after the first W examples (the warm-up, default 20:
mesh subgroups, imports and dispatch caches are one-time costs) and after the last one,
with a ``gc.collect()`` in the parent and in every rank first:

- each rank's resident memory (VmRSS in /proc/<pid>/status);
- open file descriptors of the parent and of each rank (/proc/<pid>/fd);
- the parent's child processes (/proc/<pid>/task/*/children);
- TCP sockets (listening and established) among the descriptors of the parent and the
  ranks, matched by inode against /proc/net/tcp and /proc/net/tcp6.

After ``pool.close()``: no rank process remains, and no port that the pool listened on
(its TCPStore in the parent, gloo's listeners in the ranks) is still listening.

Targets: RSS growth < 10% on every rank from the first sample to the last; descriptor,
process and socket deltas 0; nothing left after close. Exits 1 if a target is missed
(or a reference example fails: a broken check is never what got measured).
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import sys
import time
from collections import Counter

import torch
from hypothesis import Phase, given, settings

from tpdp_verify.errors import PoolError
from tpdp_verify.pool import RankPool
from tpdp_verify.properties.training import trains_like_one_device

WORLD = 4
RSS_TARGET = 10.0  # percent
TCP_STATES = {"0A": "listen", "01": "established"}


# ---------------------------------------------------------------------------
# /proc readings.
# ---------------------------------------------------------------------------


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS (a zombie?)")


def fd_targets(pid: int) -> list[str]:
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed while we looked
            pass
    return targets


def tcp_table() -> dict[int, tuple[str, int]]:
    """Socket inode -> (state, local port) for every TCP socket in this network namespace."""
    table = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            next(f)
            for line in f:
                cols = line.split()
                table[int(cols[9])] = (TCP_STATES.get(cols[3], cols[3]), int(cols[1].rsplit(":", 1)[1], 16))
    return table


def children(pid: int) -> set[int]:
    kids = set()
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            kids.update(int(p) for p in f.read().split())
    return kids


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except FileNotFoundError:
        return f"{pid} (gone)"


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def rank_caches() -> dict:
    """Inside a rank, after a gc: what grows with the cases seen, to explain RSS growth."""
    gc.collect()
    from torch._C._distributed_c10d import _get_work_registry_size
    from torch._subclasses.fake_tensor import FakeTensorMode

    return {
        # DTensor's sharding propagation is cached in C++ (the Python lru_cache behind it
        # stays empty): (hits, misses); every miss adds an entry that is never evicted
        "sharding": torch._C._get_DTensor_sharding_propagator_cache_stats(),
        "fake": len(FakeTensorMode.cache),  # fake-tensor dispatch cache, unbounded too
        "objects": len(gc.get_objects()),
        "unwaited": _get_work_registry_size(),  # collectives whose Work nobody waited on
    }


def sample(pool: RankPool) -> dict:
    """One reading of the parent (key "parent") and every rank (key = rank)."""
    gc.collect()
    caches = pool.run(rank_caches)
    tcp = tcp_table()
    procs = {"parent": os.getpid(), **dict(enumerate(pool.pids))}
    out = {}
    for who, pid in procs.items():
        targets = fd_targets(pid)
        inodes = [int(t[8:-1]) for t in targets if t.startswith("socket:[")]
        states = Counter(tcp[i][0] for i in inodes if i in tcp)
        out[who] = {
            "pid": pid,
            "rss_kb": rss_kb(pid),
            "fds": len(targets),
            "sockets": len(inodes),
            "listen": states["listen"],
            "established": states["established"],
            "listen_ports": {tcp[i][1] for i in inodes if i in tcp and tcp[i][0] == "listen"},
        }
    for rank, reading in enumerate(caches):
        out[rank].update(reading)
    out["children"] = len(children(os.getpid()))
    return out


def listening_ports() -> set[int]:
    return {port for state, port in tcp_table().values() if state == "listen"}


# ---------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------


def draw(n: int) -> list:
    """n cases of the property's own strategy, derandomized (the same cases every run)."""
    cases = []

    @settings(max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None)
    @given(trains_like_one_device.strategies["case"](WORLD))
    def collect(case):
        cases.append(case)

    collect()
    return cases


def check(pool: RankPool, case) -> None:
    """One example, judged as the property judges it; a reference failure ends the run."""
    try:
        trains_like_one_device.fn(pool, "reference", case)
    except PoolError:
        raise
    except Exception as exc:
        print(f"REFERENCE EXAMPLE FAILED: {case!r}\n{exc}", file=sys.stderr)
        sys.exit(1)


def mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="examples in all, warm-up included")
    parser.add_argument("--warm-up", type=int, default=20, help="examples before the first sample")
    parser.add_argument("--every", type=int, default=100, help="print RSS every this many examples")
    parser.add_argument("--cycle", action="store_true",
                        help="after the warm-up, cycle through the warm-up's cases instead of new "
                             "ones: growth that remains is per example, not per new shape")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before ranks count as hung")
    args = parser.parse_args()
    if not 0 < args.warm_up < args.examples:
        parser.error("need 0 < --warm-up < --examples")

    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}; {args.examples} examples of "
          f"trains_like_one_device (reference) on RankPool({WORLD}), first sample after "
          f"{args.warm_up}", flush=True)
    start = time.monotonic()
    cases = draw(args.examples)
    # The warm-up meets every mesh shape and entry point the run will: each mesh creates
    # its gloo subgroups (sockets, descriptors) once, on first use, which is no leak.
    warm, rest = cases[: args.warm_up], cases[args.warm_up:]
    for key in dict.fromkeys((c.mesh_shape, c.entry) for c in rest):
        if key not in {(c.mesh_shape, c.entry) for c in warm}:
            i = next(i for i, c in enumerate(rest) if (c.mesh_shape, c.entry) == key)
            warm.append(rest.pop(i))
    if args.cycle:
        rest = [warm[i % len(warm)] for i in range(len(rest))]
    print(f"drew {len(cases)} cases in {time.monotonic() - start:.1f} s "
          f"({len(warm)} warm-up: every mesh shape x entry point of the run)", flush=True)

    before_pool = {"fds": len(fd_targets(os.getpid())), "children": len(children(os.getpid()))}
    listening_before = listening_ports()
    trend = []
    pool = RankPool(WORLD, "gloo", timeout=args.timeout)
    try:
        pids, store_port = list(pool.pids), pool._ranks.store.port
        run_start = time.monotonic()
        for case in warm:
            check(pool, case)
        first = sample(pool)
        trend.append((len(warm), first))
        print(f"after {len(warm)} warm-up examples ({time.monotonic() - run_start:.0f} s): rank RSS "
              + ", ".join(f"{first[r]['rss_kb'] / 1024:.0f}" for r in range(WORLD)) + " MB", flush=True)
        measured_start = time.monotonic()
        for i, case in enumerate(rest, len(warm) + 1):
            check(pool, case)
            if i % args.every == 0 or i == len(cases):
                s = sample(pool) if i != len(cases) else None
                if s is not None:
                    trend.append((i, s))
                    print(f"  {i:>5} examples, {time.monotonic() - run_start:6.0f} s: rank RSS "
                          + ", ".join(f"{s[r]['rss_kb'] / 1024:.0f}" for r in range(WORLD))
                          + f" MB, parent {s['parent']['rss_kb'] / 1024:.0f} MB", flush=True)
        measured = time.monotonic() - measured_start
        last = sample(pool)
        trend.append((len(cases), last))
        if pool.spawns != 1 or pool.pids != pids:
            print(f"the ranks were respawned during the run ({pool.spawns} generations): "
                  "the readings compare different processes", file=sys.stderr)
            return 1
        used_ports = {store_port} | set().union(*(last[w]["listen_ports"] | first[w]["listen_ports"]
                                                  for w in ("parent", *range(WORLD))))
    finally:
        pool.close()
    gc.collect()
    # the ranks are joined by close(); give the kernel a moment to tear down their sockets
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (any(map(alive, pids)) or used_ports & listening_ports()):
        time.sleep(0.1)
    left_alive = [p for p in pids if alive(p)]
    left_listening = sorted(used_ports & listening_ports())
    after_close = {"fds": len(fd_targets(os.getpid())), "children": len(children(os.getpid()))}
    kept = [cmdline(p) for p in children(os.getpid())]
    total = time.monotonic() - start

    # -- report ------------------------------------------------------------
    ok = True

    def row(label, a, b, target_zero=True, unit=""):
        nonlocal ok
        delta = b - a
        passed = delta == 0 if target_zero else True
        ok &= passed
        verdict = mark(passed) if target_zero else ""
        print(f"{label:<34}{a:>10}{unit}{b:>10}{unit}{delta:>+8}{unit}   {verdict}")

    print(f"\n{len(cases)} examples passed in {time.monotonic() - run_start:.0f} s; "
          f"{len(rest)} measured examples: {measured / len(rest) * 1e3:.0f} ms/example")
    print(f"\nRSS from the first sample (after {len(warm)} examples) to the last (after {len(cases)}):")
    print(f"{'process':<10}{'first MB':>10}{'last MB':>10}{'growth':>9}   target < {RSS_TARGET:g}%")
    for who in (*range(WORLD), "parent"):
        a, b = first[who]["rss_kb"], last[who]["rss_kb"]
        growth = 100.0 * (b - a) / a
        label = f"rank {who}" if who != "parent" else "parent"
        if who == "parent":
            print(f"{label:<10}{a / 1024:>10.0f}{b / 1024:>10.0f}{growth:>8.1f}%   (no target)")
        else:
            ok &= growth < RSS_TARGET
            print(f"{label:<10}{a / 1024:>10.0f}{b / 1024:>10.0f}{growth:>8.1f}%   {mark(growth < RSS_TARGET)}")
    print(f"\nRSS trend (MB), every {args.every} examples:")
    print(f"{'examples':>9}" + "".join(f"{'rank ' + str(r):>9}" for r in range(WORLD)) + f"{'parent':>9}"
          + "   rank 0: sharding prop. misses, fake-tensor cache, gc objects, unwaited collectives")
    for n, s in trend:
        print(f"{n:>9}" + "".join(f"{s[w]['rss_kb'] / 1024:>9.0f}" for w in (*range(WORLD), "parent"))
              + f"   {s[0]['sharding'][1]:>7} {s[0]['fake']:>7} {s[0]['objects']:>9} {s[0]['unwaited']:>6}")

    print(f"\n{'count':<34}{'first':>10}{'last':>10}{'delta':>8}   target 0")
    for who in ("parent", *range(WORLD)):
        label = "parent" if who == "parent" else f"rank {who}"
        row(f"{label}: open fds", first[who]["fds"], last[who]["fds"])
        row(f"{label}: sockets", first[who]["sockets"], last[who]["sockets"])
        row(f"{label}: TCP listening", first[who]["listen"], last[who]["listen"])
        row(f"{label}: TCP established", first[who]["established"], last[who]["established"])
    row("parent: child processes", first["children"], last["children"])

    print(f"\nafter pool.close():")
    ok &= not left_alive and not left_listening
    print(f"  rank processes left: {len(left_alive)} of {len(pids)} {left_alive or ''}   {mark(not left_alive)}")
    print(f"  ports the pool listened on (store {store_port}, gloo {sorted(used_ports - {store_port})}): "
          f"{len(left_listening)} still listening {left_listening or ''}   {mark(not left_listening)}")
    print(f"  parent: {before_pool['fds']} fds and {before_pool['children']} children before the pool, "
          f"{after_close['fds']} and {after_close['children']} after close (no target)"
          + "".join(f"\n    child left: {c}" for c in kept))
    print(f"\ntotal {total:.0f} s ({total / 60:.1f} min); targets: {'all met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
