"""Benchmark: does a long run on one RankPool leak memory, descriptors, processes or sockets?

Run as ``.venv/bin/python bench/bench_endurance.py [--examples N] [--warm-up W]``.
N examples (default 1000) of the ci gradient property, ``trains_like_one_device``, run
against the reference transform on one ``RankPool(4)``: the cases are drawn by the
property's own strategy (``sound_cases(4)``, derandomized) and each is judged by the
property's function, exactly as the gate judges it (the ranks train, the parent runs the
oracles and compares). The reference passes every case, so nothing is shrunk.

The pool recycles its ranks as the gate's pools do (``--max-rss-growth``, default
``MAX_RSS_GROWTH``; 0 never recycles, to see how one generation grows).

Sampled from /proc (no psutil) after the first W examples (the warm-up, default 20:
mesh subgroups, imports and dispatch caches are one-time costs) and after the last one,
with a ``gc.collect()`` in the parent and in every rank first:

- each rank's resident memory (VmRSS in /proc/<pid>/status);
- open file descriptors of the parent and of each rank (/proc/<pid>/fd);
- the parent's child processes (/proc/<pid>/task/*/children);
- TCP sockets (listening and established) among the descriptors of the parent and the
  ranks, matched by inode against /proc/net/tcp and /proc/net/tcp6.

Besides, every rank's VmRSS is read after every example, for its peak. After
``pool.close()``: no rank process of any generation remains, and no port that the pool
listened on (each generation's TCPStore in the parent, gloo's listeners in the ranks) is
still listening.

Targets: every rank's peak RSS within 10% of its size at the first sample; descriptor,
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
from tpdp_verify.properties.training import trains_like_one_device
from tpdp_verify.ranks.pool import MAX_RSS_GROWTH, RankPool

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import alive  # noqa: E402  (tests/helpers.py: the one liveness test)

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
    parser.add_argument("--max-rss-growth", type=float, default=MAX_RSS_GROWTH,
                        help=f"growth past which the pool recycles a generation of ranks (default "
                             f"{MAX_RSS_GROWTH}, as the gate; 0: never)")
    args = parser.parse_args()
    if not 0 < args.warm_up < args.examples:
        parser.error("need 0 < --warm-up < --examples")
    if args.max_rss_growth < 0:
        parser.error("--max-rss-growth must be 0 (never) or a positive fraction")

    recycling = f"recycling ranks grown by {args.max_rss_growth:.0%}" if args.max_rss_growth else "never recycling"
    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}; {args.examples} examples of "
          f"trains_like_one_device (reference) on RankPool({WORLD}), first sample after "
          f"{args.warm_up}, {recycling}", flush=True)
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
    pool = RankPool(WORLD, "gloo", timeout=args.timeout, max_rss_growth=args.max_rss_growth or None)
    pids, store_ports = set(), set()
    peak = [0] * WORLD

    def watch() -> None:
        """After every call: the generation's pids and store port, every rank's RSS."""
        pids.update(pool.pids)
        store_ports.add(pool._ranks.store.port)
        for r, pid in enumerate(pool.pids):
            peak[r] = max(peak[r], rss_kb(pid))

    try:
        run_start = time.monotonic()
        for case in warm:
            check(pool, case)
        first = sample(pool)
        watch()
        peak = [first[r]["rss_kb"] for r in range(WORLD)]  # the peak counts from here
        trend.append((len(warm), first))
        print(f"after {len(warm)} warm-up examples ({time.monotonic() - run_start:.0f} s): rank RSS "
              + ", ".join(f"{first[r]['rss_kb'] / 1024:.0f}" for r in range(WORLD)) + " MB", flush=True)
        measured_start = time.monotonic()
        for i, case in enumerate(rest, len(warm) + 1):
            check(pool, case)
            watch()
            if i % args.every == 0 or i == len(cases):
                s = sample(pool) if i != len(cases) else None
                if s is not None:
                    watch()
                    trend.append((i, s))
                    print(f"  {i:>5} examples, {time.monotonic() - run_start:6.0f} s: rank RSS "
                          + ", ".join(f"{s[r]['rss_kb'] / 1024:.0f}" for r in range(WORLD))
                          + f" MB, parent {s['parent']['rss_kb'] / 1024:.0f} MB"
                          + f", generation {pool.spawns}", flush=True)
        measured = time.monotonic() - measured_start
        last = sample(pool)
        watch()
        trend.append((len(cases), last))
        generations = pool.spawns
        used_ports = store_ports | set().union(*(s[w]["listen_ports"] for _, s in trend
                                                 for w in ("parent", *range(WORLD))))
    finally:
        pool.close()
    gc.collect()
    # the ranks are joined by close(); give the kernel a moment to tear down their sockets
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (any(map(alive, pids)) or used_ports & listening_ports()):
        time.sleep(0.1)
    left_alive = sorted(p for p in pids if alive(p))
    left_listening = sorted(used_ports & listening_ports())
    after_close = {"fds": len(fd_targets(os.getpid())), "children": len(children(os.getpid()))}
    kept = [cmdline(p) for p in children(os.getpid())]
    total = time.monotonic() - start

    # -- report ------------------------------------------------------------
    ok = True

    def row(label, a, b, at_most=False):
        """Target delta 0; or, for a rank whose last reading is a later generation's, which
        may not have met every mesh yet (each creates gloo subgroups), no more than first."""
        nonlocal ok
        passed = b <= a if at_most else b == a
        ok &= passed
        print(f"{label:<34}{a:>10}{b:>10}{b - a:>+8}   {'<= 0' if at_most else '0':>4}  {mark(passed)}")

    print(f"\n{len(cases)} examples passed in {time.monotonic() - run_start:.0f} s; "
          f"{len(rest)} measured examples: {measured / len(rest) * 1e3:.0f} ms/example; "
          f"{generations} generation(s) of ranks, {len(pids)} rank processes in all")
    print(f"\nRSS from the first sample (after {len(warm)} examples) to the last (after {len(cases)}), "
          "and the peak read after any example:")
    print(f"{'process':<10}{'first MB':>10}{'last MB':>10}{'peak MB':>10}{'peak growth':>13}   "
          f"target < {RSS_TARGET:g}%")
    for who in (*range(WORLD), "parent"):
        a, b = first[who]["rss_kb"], last[who]["rss_kb"]
        if who == "parent":
            print(f"{'parent':<10}{a / 1024:>10.0f}{b / 1024:>10.0f}{'':>10}{100.0 * (b - a) / a:>12.1f}%   "
                  "(last vs first; no target)")
        else:
            growth = 100.0 * (peak[who] - a) / a
            ok &= growth < RSS_TARGET
            print(f"{'rank ' + str(who):<10}{a / 1024:>10.0f}{b / 1024:>10.0f}{peak[who] / 1024:>10.0f}"
                  f"{growth:>12.1f}%   {mark(growth < RSS_TARGET)}")
    print(f"\nRSS trend (MB), every {args.every} examples:")
    print(f"{'examples':>9}" + "".join(f"{'rank ' + str(r):>9}" for r in range(WORLD)) + f"{'parent':>9}"
          + "   rank 0: sharding prop. misses, fake-tensor cache, gc objects, unwaited collectives")
    for n, s in trend:
        print(f"{n:>9}" + "".join(f"{s[w]['rss_kb'] / 1024:>9.0f}" for w in (*range(WORLD), "parent"))
              + f"   {s[0]['sharding'][1]:>7} {s[0]['fake']:>7} {s[0]['objects']:>9} {s[0]['unwaited']:>6}")

    print(f"\n{'count':<34}{'first':>10}{'last':>10}{'delta':>8}   target")
    for who in ("parent", *range(WORLD)):
        label = "parent" if who == "parent" else f"rank {who}"
        later = who != "parent" and generations > 1
        for key, what in (("fds", "open fds"), ("sockets", "sockets"), ("listen", "TCP listening"),
                          ("established", "TCP established")):
            row(f"{label}: {what}", first[who][key], last[who][key], later)
    row("parent: child processes", first["children"], last["children"])

    print("\nafter pool.close():")
    ok &= not left_alive and not left_listening
    print(f"  rank processes left: {len(left_alive)} of {len(pids)} {left_alive or ''}   {mark(not left_alive)}")
    print(f"  ports the pool listened on (stores {sorted(store_ports)}, gloo {sorted(used_ports - store_ports)}): "
          f"{len(left_listening)} still listening {left_listening or ''}   {mark(not left_listening)}")
    print(f"  parent: {before_pool['fds']} fds and {before_pool['children']} children before the pool, "
          f"{after_close['fds']} and {after_close['children']} after close (no target)"
          + "".join(f"\n    child left: {c}" for c in kept))
    print(f"\ntotal {total:.0f} s ({total / 60:.1f} min); targets: {'all met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
