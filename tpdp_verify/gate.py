"""The gate: run the conformance suite against one implementation and judge it.

Each property runs on a pool of every world size the profile names; its outcome is
pass, diverges (a property failed: a finding about the implementation, with the shrunk
case and a script that replays it) or infra (ranks hung or died: no verdict).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from hypothesis.reporting import with_reporter

from tpdp_verify import impl as impl_mod
from tpdp_verify.errors import EXIT_DIVERGENCE, EXIT_INFRA, EXIT_OK, PoolError
from tpdp_verify.pool import RankPool
from tpdp_verify.profiles import Profile
from tpdp_verify.suite import Property, Stats


@dataclass
class Outcome:
    property: str
    world_size: int
    status: str  # "pass" | "diverges" | "infra"
    seconds: float
    stats: Stats = field(default_factory=Stats)
    message: str = ""  # why there is no verdict (infra)
    findings: list[tuple[str, str]] = field(default_factory=list)  # (failure, replay script)


def _failure_text(exc: BaseException, reported: list[str]) -> str:
    lines = "".join(traceback.format_exception_only(exc)).strip()
    extra = [r for r in reported if r.strip() and r not in lines]
    return "\n".join([lines, *extra])


def check_property(prop: Property, pool: RankPool, impl: str, profile: Profile) -> Outcome:
    stats, reported = Stats(), []
    start = time.monotonic()
    try:
        with with_reporter(reported.append):
            prop.run(pool, impl, profile, stats)
    except PoolError as exc:
        return Outcome(prop.name, pool.world_size, "infra", time.monotonic() - start, stats, str(exc))
    except Exception as exc:
        # hypothesis raises a group when it found distinct bugs: one message and replay each
        found = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        findings = []
        for e in found:
            drawn = stats.failures.get(type(e).__name__, stats.failing)
            findings.append((_failure_text(e, reported if len(found) == 1 else []),
                             prop.replay_code(pool.world_size, impl, drawn) if drawn else ""))
        return Outcome(prop.name, pool.world_size, "diverges", time.monotonic() - start, stats,
                       findings=findings)
    return Outcome(prop.name, pool.world_size, "pass", time.monotonic() - start, stats)


def run_gate(
    properties: tuple[Property, ...],
    profile: Profile,
    impl: str = "torch",
    backend: str = "auto",
    timeout: float = 120.0,
    progress: Callable[[str], None] = print,
) -> list[Outcome]:
    impl_mod.load(impl)  # a bad --impl fails here, in one line, before any rank starts
    outcomes = []
    for world_size in profile.world_sizes:
        todo = [p for p in properties if world_size >= p.min_world_size]
        if not todo:
            continue
        start = time.monotonic()
        with RankPool(world_size, backend, timeout=timeout) as pool:
            progress(f"world size {world_size}: {pool.backend} ranks up in {time.monotonic() - start:.1f} s")
            for prop in todo:
                outcome = check_property(prop, pool, impl, profile)
                outcomes.append(outcome)
                progress(f"  {_line(outcome)}")
    return outcomes


def _line(o: Outcome) -> str:
    return (f"{o.property:<34} world {o.world_size}  {o.status.upper():<8} "
            f"{o.stats.examples:>4} examples ({o.stats.discarded} discarded)  {o.seconds:6.1f} s")


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
        f"failures in {seconds:.1f} s",
    ]
    for o in outcomes:
        if o.status == "pass":
            continue
        out += ["", f"== {o.property} (world size {o.world_size}): {o.status}"]
        if o.message:
            out.append(o.message)
        for i, (failure, replay) in enumerate(o.findings):
            out += ([""] if i else []) + [failure]
            if replay:
                out += ["-- replay (save as a file and run it with python):", replay.rstrip()]
    return "\n".join(out)
