"""The gate: run the conformance suite against one implementation and judge it.

Each property runs on a pool of every world size the profile names; its outcome is
pass, diverges (a property failed: a finding about the implementation, with the shrunk
case and a script that replays it) or infra (ranks hung or died: no verdict).
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import torch
from hypothesis.reporting import with_reporter

from tpdp_verify import impl as impl_mod
from tpdp_verify.errors import EXIT_DIVERGENCE, EXIT_INFRA, EXIT_OK, PoolError
from tpdp_verify.pool import MAX_RSS_GROWTH, RankPool
from tpdp_verify.profiles import Profile
from tpdp_verify.suite import Property, Stats


class Finding(NamedTuple):
    """One distinct divergence hypothesis found (it shrinks each kind apart)."""

    failure: str  # the exception's text and what hypothesis reported
    replay: str = ""  # a script that replays the shrunk case
    kind: str = ""  # the exception's type name: which check departs
    drawn: dict | None = None  # the shrunk case, argument name -> value


@dataclass
class Outcome:
    property: str
    world_size: int
    status: str  # "pass" | "diverges" | "infra"
    seconds: float
    stats: Stats = field(default_factory=Stats)
    message: str = ""  # why there is no verdict (infra)
    findings: list[Finding] = field(default_factory=list)
    backend: str = ""  # the process group's, as the pool chose it


REPLAY = "-- replay (save as a file and run it with python):"
WIDTH = 38  # the longest property name: entry_points_state_dict_like_unsharded


def _failure_text(exc: BaseException, reported: list[str]) -> str:
    lines = "".join(traceback.format_exception_only(exc)).strip()
    extra = [r for r in reported if r.strip() and r not in lines]
    return "\n".join([lines, *extra])


def check_property(prop: Property, pool: RankPool, impl: str, profile: Profile,
                   progress: Callable[[str], None] | None = None, every: float = 60.0) -> Outcome:
    """Run one property; with ``progress``, say every ``every`` seconds that it still runs."""
    stats, reported = Stats(), []
    start = time.monotonic()

    def outcome(status: str, **details) -> Outcome:
        return Outcome(prop.name, pool.world_size, status, time.monotonic() - start, stats,
                       backend=pool.backend, **details)

    try:
        with with_reporter(reported.append), _heartbeat(prop.name, stats, progress, every):
            prop.run(pool, impl, profile, stats)
    except PoolError as exc:
        return outcome("infra", message=str(exc))
    except Exception as exc:
        # hypothesis raises a group when it found distinct bugs: one message and replay each
        found = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        findings = []
        for e in found:
            drawn = stats.failures.get(type(e).__name__, stats.failing)
            findings.append(Finding(_failure_text(e, reported if len(found) == 1 else []),
                                    prop.replay_code(pool.world_size, impl, drawn) if drawn else "",
                                    type(e).__name__, drawn))
        return outcome("diverges", findings=findings)
    return outcome("pass")


@contextlib.contextmanager
def _heartbeat(name: str, stats: Stats, progress: Callable[[str], None] | None, every: float):
    """A line every ``every`` seconds while a property runs: a release run at world size 8
    spends many minutes on one property, and CI kills jobs that print nothing for long."""
    if progress is None:
        yield
        return
    start, stop = time.monotonic(), threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            progress(f"      ... {name}: {stats.examples} examples so far, "
                     f"{time.monotonic() - start:.0f} s")

    thread = threading.Thread(target=beat, name="tpdp-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def iter_gate(
    properties: tuple[Property, ...],
    profile: Profile,
    impl: str = "torch",
    backend: str = "auto",
    timeout: float = 120.0,
    progress: Callable[[str], None] = print,
    every: float = 60.0,
) -> Iterator[Outcome]:
    """Each property's outcome as it comes, so that a run cut short keeps what it found.

    ``progress`` gets a line per property with the count done, the failures so far and
    the time since the start, and a line every ``every`` seconds a property runs.
    """
    impl_mod.load(impl)  # a bad --impl fails here, in one line, before any rank starts
    plan = [(ws, [p for p in properties if ws >= p.min_world_size]) for ws in profile.world_sizes]
    total = sum(len(todo) for _, todo in plan)
    done = failed = 0
    start = time.monotonic()
    for world_size, todo in plan:
        if not todo:
            continue
        up = time.monotonic()
        with RankPool(world_size, backend, timeout=timeout, max_rss_growth=MAX_RSS_GROWTH) as pool:
            progress(f"world size {world_size}: {pool.backend} ranks up in {time.monotonic() - up:.1f} s")
            for prop in todo:
                outcome = check_property(prop, pool, impl, profile, progress, every)
                done, failed = done + 1, failed + (outcome.status != "pass")
                progress(f"  [{done:>{len(str(total))}}/{total}] {_short_line(outcome)}  (failures so "
                         f"far: {failed}, elapsed {time.monotonic() - start:.0f} s)")
                yield outcome


def run_gate(properties: tuple[Property, ...], profile: Profile, impl: str = "torch",
             backend: str = "auto", timeout: float = 120.0,
             progress: Callable[[str], None] = print) -> list[Outcome]:
    """Every outcome of a whole run (see ``iter_gate``)."""
    return list(iter_gate(properties, profile, impl, backend, timeout, progress))


def _line(o: Outcome) -> str:
    return (f"{o.property:<{WIDTH}} world {o.world_size}  {o.status.upper():<8} "
            f"{o.stats.examples:>4} examples ({o.stats.discarded} discarded)  {o.seconds:6.1f} s")


def _short_line(o: Outcome) -> str:
    """``_line`` without the discarded count (the summary has it): progress lines stay short."""
    return (f"{o.property:<{WIDTH}} world {o.world_size}  {o.status.upper():<8} "
            f"{o.stats.examples:>4} examples  {o.seconds:6.1f} s")


def exit_code(outcomes: list[Outcome]) -> int:
    statuses = {o.status for o in outcomes}
    if "infra" in statuses:
        return EXIT_INFRA
    return EXIT_DIVERGENCE if "diverges" in statuses else EXIT_OK


def summary(outcomes: list[Outcome], profile: Profile, impl: str, seconds: float) -> str:
    counts = {s: sum(o.status == s for o in outcomes) for s in ("pass", "diverges", "infra")}
    out = [
        f"tpdp-verify gate: profile {profile.name}, implementation {impl}, torch {torch.__version__}",
        *(_line(o) for o in outcomes),
        f"{counts['pass']} passed, {counts['diverges']} diverged, {counts['infra']} infrastructure "
        f"failures in {seconds:.1f} s ({profile.name} budget {profile.budget:.0f} s"
        f"{', OVER BUDGET' if seconds > profile.budget else ''})",
    ]
    for o in outcomes:
        if o.status != "pass":
            out += ["", report(o)]
    return "\n".join(out)


def report(o: Outcome) -> str:
    """Why a property has no pass: its failed checks, shrunk case and replay script each."""
    if o.status == "pass":
        return ""
    out = [f"== {o.property} (world size {o.world_size}): {o.status}"]
    if o.message:
        out.append(o.message)
    for i, (failure, replay, _, _) in enumerate(o.findings):
        out += ([""] if i else []) + [failure]
        if replay:
            out += [REPLAY, replay.rstrip()]
    return "\n".join(out)


@contextlib.contextmanager
def rerunner(properties: tuple[Property, ...], impl: str, backend: str = "auto", timeout: float = 120.0):
    """``rerun(entry)``: a baseline entry's recorded case run once more, outside hypothesis;
    the kind of divergence it raises, or "" if it passes. Pools start on first use."""
    by_name = {p.name: p for p in properties}
    with contextlib.ExitStack() as stack:
        pools: dict[int, RankPool] = {}

        def rerun(entry) -> str:
            if entry.world_size not in pools:
                pools[entry.world_size] = stack.enter_context(RankPool(entry.world_size, backend, timeout=timeout))
            try:
                by_name[entry.property].fn(pools[entry.world_size], impl, **entry.drawn())
            except PoolError:
                raise
            except Exception as exc:
                return type(exc).__name__
            return ""

        yield rerun
