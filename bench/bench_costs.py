"""Cost model: where a gate profile's time goes, by search and by phase.

Run as ``.venv/bin/python bench/bench_costs.py [--profile ci] [-k NAME] [--examples N]``.
It runs the gate's own searches (``iter_gate``, the fixed draw, judged by the shipped memo
of torch 2.13.0 as ``--baseline torch==2.13.0`` does) with every phase of an example timed
where it runs:

- in this process: drawing the case and hypothesis's own work (what is left), the
  one-device run in the case's dtype and in float64 (``oracle``), judging (``assemble``,
  ``judge_*``), and the wait on the ranks (``RankPool.run``);
- on each rank: building the model and applying TP, the DP wrap, the steps (forward,
  backward, optimizer: the sharding propagation and collectives in them), the taps
  (TP's and DP's reduction watchers), checkpoint save and load, and the whole call;
  "collectives and IPC" is the wait on the ranks less the ranks' own calls.

Rank phases are each rank's mean (the ranks run side by side). The table gives seconds per
search and the share of the run; the last lines name the largest phases: the levers. A
phase's time includes the phases inside it that the table lists apart only where said.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

RECORD = "TPDP_VERIFY_BENCH_PHASES"  # the directory where each rank writes its totals

# phase -> (module, attribute) of each function whose time is that phase's, where it runs
RANK_PHASES = {
    "model build + TP": [("tpdp_verify.ranks.tp_dp", "tp_model")],
    "DP wrap": [("tpdp_verify.ranks.entries", f"wrap_{e}") for e in
                ("ddp_mesh", "transform_ddp", "replicate", "fully_shard", "fsdp1", "replicate_fsdp", "own")],
    "steps": [("tpdp_verify.ranks.loop", "train")],
    "taps": [("tpdp_verify.ranks.taps", "watching"), ("tpdp_verify.ranks.taps", "around")],
    "checkpoint save/load": [("tpdp_verify.ranks.checkpoint", "_save"), ("tpdp_verify.ranks.checkpoint", "_load")],
    "rank call (all)": [("tpdp_verify.ranks.rank", "reply")],
}
PARENT_PHASES = {
    "one-device run (dtype + float64)": [("tpdp_verify.oracles.single_device", "run")],
    "judging": [("tpdp_verify.judging.verdict", "assemble"), ("tpdp_verify.judging.verdict", "judge_training"),
                ("tpdp_verify.judging.reductions", "judge_reductions"),
                ("tpdp_verify.judging.reductions", "judge_dp_reductions")],
    "wait on the ranks": [("tpdp_verify.ranks.pool", "RankPool.run")],
    # a fresh generation of ranks: after a call that raised on a rank (RankPool.run), a hang or
    # a death, and for the memory cap; inside the wait
    "rank start": [("tpdp_verify.ranks.pool", "RankPool._start")],
}
TAPS = ("watching", "around")  # they return wrappers: the time is the wrappers' calls'


def _timed(fn, name: str, totals: dict, nested: set):
    """``fn`` with its time added to ``totals[name]``; a call inside another of the same
    phase counts once (train inside train)."""
    import functools

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if name in nested:
            return fn(*args, **kwargs)
        nested.add(name)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            nested.discard(name)
            totals[name] += time.perf_counter() - start
            totals[f"{name} #"] += 1  # how many: the table's counts

    return timed


def _tap_timed(make, name: str, totals: dict, nested: set):
    """A tap maker (taps.watching, taps.around) whose callbacks' time is ``name``'s."""
    import functools

    @functools.wraps(make)
    def made(inner, *callbacks):
        return make(inner, *(_timed(c, name, totals, nested) for c in callbacks))

    return made


def instrument(phases: dict, totals: dict) -> None:
    """Replace each phase's functions by timed ones, everywhere they are bound (the modules
    that imported them by name too)."""
    import importlib

    nested: set = set()
    for name, sites in phases.items():
        for module, attribute in sites:
            owner = importlib.import_module(module)
            *path, last = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = getattr(owner, last, None)
            if original is None:
                continue
            wrap = _tap_timed if last in TAPS else _timed
            replacement = wrap(original, name, totals, nested)
            for m in [m for n, m in list(sys.modules.items()) if n.startswith("tpdp_verify")]:  # who binds them
                for key, value in list(getattr(m, "__dict__", {}).items()):
                    if value is original:
                        setattr(m, key, replacement)
                    elif isinstance(value, dict):  # a table of them (entries.WRAP)
                        for k in [k for k, v in value.items() if v is original]:
                            value[k] = replacement
            setattr(owner, last, replacement)


def time_the_grace(totals: dict) -> None:
    """After a rank raises, the others get the error grace: they are waited for until they
    answer or sit idle in a collective (IDLE_WINDOW without CPU), then killed. The wait from
    the first error to a reply marked stuck is the "error grace" phase (inside the wait)."""
    from tpdp_verify.ranks import pool

    since: list = []
    idleness_init, collect = pool._Idleness.__init__, pool._Ranks.collect

    def noted(self, *args, **kwargs):
        since.append(time.perf_counter())
        idleness_init(self, *args, **kwargs)

    def collected(self, *args, **kwargs):
        since.clear()
        replies = collect(self, *args, **kwargs)
        if since and any(r[0] == "stuck" for r in replies.values()):
            totals["error grace"] += time.perf_counter() - since[0]
            totals["error grace #"] += 1
        return replies

    pool._Idleness.__init__, pool._Ranks.collect = noted, collected


def _in_a_rank() -> None:
    """Runs as each rank imports this file (``__mp_main__``): time the rank phases, and write
    this rank's totals after every call."""
    import tpdp_verify.ranks.checkpoint  # noqa: F401: the modules whose names are replaced
    import tpdp_verify.ranks.entries  # noqa: F401
    import tpdp_verify.ranks.loop  # noqa: F401
    import tpdp_verify.ranks.rank as rank
    import tpdp_verify.ranks.taps  # noqa: F401
    import tpdp_verify.ranks.tp_dp  # noqa: F401

    totals: dict = defaultdict(float)
    instrument(RANK_PHASES, totals)
    timed_reply = rank.reply
    where = Path(os.environ[RECORD]) / f"rank-{os.getpid()}.json"

    def recorded(call: bytes) -> bytes:
        try:
            return timed_reply(call)
        finally:
            where.write_text(json.dumps(totals))

    rank.reply = recorded


def rank_totals(directory: Path) -> dict:
    """Each phase's seconds summed over every rank that wrote (every generation's)."""
    out: dict = defaultdict(float)
    for f in directory.glob("rank-*.json"):
        with contextlib.suppress(ValueError, OSError):
            for k, v in json.loads(f.read_text()).items():
                out[k] += v
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci")
    parser.add_argument("-k", default="", help="only searches whose property name contains this")
    parser.add_argument("--examples", type=int, default=None, help="examples a search (default: the profile's)")
    parser.add_argument("--world-sizes", type=int, nargs="*", default=None)
    args = parser.parse_args()

    import dataclasses

    from tpdp_verify.runner import profiles
    from tpdp_verify.runner.baseline import Baseline
    from tpdp_verify.runner.gate import iter_gate
    from tpdp_verify.runner.suite import load

    profile = profiles.get(args.profile)
    if args.examples:
        profile = dataclasses.replace(profile, max_examples=args.examples)
    if args.world_sizes:
        profile = dataclasses.replace(profile, world_sizes=tuple(args.world_sizes))
    suite = load()  # imported before the clock starts: a gate pays them once, before its first search
    props = tuple(p for p in suite.properties if args.k in p.name)
    parent: dict = defaultdict(float)
    import tpdp_verify.judging.reductions  # noqa: F401
    import tpdp_verify.judging.verdict  # noqa: F401
    import tpdp_verify.oracles.verdicts  # noqa: F401
    instrument(PARENT_PHASES, parent)
    time_the_grace(parent)
    baseline = Baseline("2.13.0", install=False, memo_path=Path(tempfile.mkdtemp()) / "memo.json")
    rows, start = [], time.monotonic()
    with tempfile.TemporaryDirectory() as record:
        os.environ[RECORD] = record
        before_p, before_r, last = dict(parent), {}, time.monotonic()
        for outcome in iter_gate(props, profile, "torch", baseline=baseline, progress=lambda s: None):
            now, ranks = time.monotonic(), rank_totals(Path(record))
            p = {k: parent[k] - before_p.get(k, 0.0) for k in parent}
            r = {k: (ranks[k] - before_r.get(k, 0.0)) / outcome.world_size for k in ranks}
            rows.append((outcome, now - last, p, r))
            print(f"  {outcome.property} (world {outcome.world_size}): {now - last:.1f} s", file=sys.stderr)
            before_p, before_r, last = dict(parent), dict(ranks), now
    total = time.monotonic() - start
    print(table(rows, total, profile))
    return 0


COLUMNS = ("one-device run (dtype + float64)", "judging", "model build + TP", "DP wrap", "steps", "taps",
           "checkpoint save/load", "rank call, other", "rank start", "error grace", "collectives and IPC",
           "drawing + hypothesis")


def table(rows: list, total: float, profile) -> str:
    """One row a search: its seconds and examples, and each phase's seconds; then totals."""
    out = [f"cost model: profile {profile.name} ({profile.max_examples} examples a search), "
           f"{len(rows)} searches in {total:.1f} s", "",
           "| search | world | s | examples | generations | stuck | " + " | ".join(COLUMNS) + " |",
           "|---|---|---|---|---|---|" + "---|" * len(COLUMNS)]
    sums: dict = defaultdict(float)
    for o, seconds, p, r in rows:
        phases = split(seconds, p, r)
        for k, v in phases.items():
            sums[k] += v
        sums["s"] += seconds
        out.append(f"| {o.property} | {o.world_size} | {seconds:.1f} | {o.stats.examples} | {p.get('rank start #', 0):.0f} "
                   f"| {p.get('error grace #', 0):.0f} | "
                   + " | ".join(f"{phases[c]:.1f}" for c in COLUMNS) + " |")
    out.append(f"| all | | {sums['s']:.1f} | | | | " + " | ".join(f"{sums[c]:.1f}" for c in COLUMNS) + " |")
    ranked = sorted(COLUMNS, key=lambda c: -sums[c])
    out += ["", "largest phases: " + ", ".join(f"{c} {sums[c]:.0f} s ({sums[c] / max(sums['s'], 1e-9):.0%})"
                                                for c in ranked[:4])]
    by_search = defaultdict(float)
    for o, seconds, _, _ in rows:
        by_search[o.property] += seconds
    out.append("largest properties: " + ", ".join(f"{k} {v:.0f} s" for k, v in
                                                  sorted(by_search.items(), key=lambda kv: -kv[1])[:6]))
    return "\n".join(out)


def split(seconds: float, p: dict, r: dict) -> dict:
    """A search's seconds by phase. The ranks' phases are nested in their calls, which are
    nested in the wait on them: collectives and IPC are the wait less the calls; what the
    parent spends outside its phases is drawing and hypothesis. A rank stuck in a collective
    for a rank that raised never ends its call: the wait for it (the error grace) is in
    collectives and IPC."""
    wait, calls = p.get("wait on the ranks", 0.0), r.get("rank call (all)", 0.0)
    steps = r.get("steps", 0.0) - r.get("taps", 0.0)  # the taps run inside the steps
    out = {"one-device run (dtype + float64)": p.get("one-device run (dtype + float64)", 0.0),
           "judging": p.get("judging", 0.0), "model build + TP": r.get("model build + TP", 0.0),
           "DP wrap": r.get("DP wrap", 0.0), "steps": steps, "taps": r.get("taps", 0.0),
           "checkpoint save/load": r.get("checkpoint save/load", 0.0),
           "rank start": p.get("rank start", 0.0), "error grace": p.get("error grace", 0.0),
           "collectives and IPC": max(0.0, wait - calls - p.get("rank start", 0.0) - p.get("error grace", 0.0))}
    named_on_ranks = sum(out[k] for k in ("model build + TP", "DP wrap", "steps", "taps", "checkpoint save/load"))
    out["drawing + hypothesis"] = max(0.0, seconds - wait - out["one-device run (dtype + float64)"] - out["judging"])
    out["rank call, other"] = max(0.0, calls - named_on_ranks)
    return out


if __name__ == "__mp_main__" and os.environ.get(RECORD):
    _in_a_rank()

if __name__ == "__main__":
    sys.exit(main())
