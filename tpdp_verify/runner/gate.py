"""The gate: run the conformance suite against one implementation and judge it.

Each property runs on a pool of every world size the profile names; its outcome is
pass, diverges (a property failed: a finding about the implementation, with the shrunk
case and a script that replays it; known when a baseline knows every failure) or infra
(the harness failed: no verdict); a run a signal stopped marks the searches it left
interrupted (no verdict either).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import torch

from tpdp_verify import faults, hypothesis_internals, interrupts, signature
from tpdp_verify import status as statuses
from tpdp_verify.errors import PoolError
from tpdp_verify.impls import select as impl_mod
from tpdp_verify.interrupts import Interrupted
from tpdp_verify.judging.divergence import Divergence
from tpdp_verify.ranks.pool import MAX_RSS_GROWTH, RankPool
from tpdp_verify.runner import coverage
from tpdp_verify.runner.profiles import Profile
from tpdp_verify.runner.baseline import status
from tpdp_verify.runner.property import Judge, Property, Stats, finding, never
from tpdp_verify.status import Found, Status

# once ranks have hung, a call counts as hung after 5x the slowest call that answered (the
# pool's after_hang): a build that hangs, hangs in many cases, and a full timeout each is hours
AFTER_HANG = 5.0


class Finding(NamedTuple):
    """One distinct failure: a signature, the shrunk case that shows it, and what it is to a baseline."""

    failure: str  # the exception's text and what hypothesis reported
    replay: str = ""  # a script that replays the shrunk case
    kind: str = ""  # the signature as a reader says it
    drawn: dict | None = None  # the shrunk case, argument name -> value
    signature: tuple = ()  # tpdp_verify.signature: every part of what failed
    status: Found = Found.FOUND  # against a baseline: NEW, CHANGED, known, FIXED or not asked
    explanation: faults.Explanation | None = None  # the catalogued faults that explain it

    @property
    def blocks(self) -> bool:
        return self.status.blocks


@dataclass
class Outcome:
    property: str
    world_size: int
    status: Status  # tpdp_verify.status
    seconds: float
    stats: Stats = field(default_factory=Stats)
    message: str = ""  # why there is no verdict (infra, interrupted)
    findings: list[Finding] = field(default_factory=list)
    backend: str = ""  # the process group's, as the pool chose it
    wanted: int = 0  # examples the profile asks this property to draw
    unshrunk: bool = False  # the gate's shrinking budget was spent before this search ran
    rank_output: str = ""  # the file holding what the ranks printed during this search, if they did

    def __post_init__(self):
        self.status = Status(self.status)  # "pass" as a record spells it, too

    def judged(self) -> None:
        """The status from the findings' own (tpdp_verify.status.of_findings), where the
        harness left one."""
        if self.status not in (Status.INFRA, Status.INTERRUPTED):
            self.status = statuses.of_findings(f.status for f in self.findings)

    @property
    def short(self) -> bool:
        """The search drew fewer examples than its profile asks (it stopped at a new failure,
        or its case space ran out)."""
        return self.status not in (Status.INFRA, Status.INTERRUPTED) and self.stats.drawn < self.wanted


REPLAY = "-- replay (save as a file and run it with python):"
WIDTH = 38  # the longest property name: entry_points_state_dict_like_unsharded


# hypothesis's own commentary, as notes on the exception or reported: not part of a finding
_ASIDES = ("Explanation:", "WARNING: Hypothesis", "    ")


def _failure_text(exc: BaseException, reported: list[str]) -> str:
    notes = [n for n in getattr(exc, "__notes__", ()) if not n.startswith(_ASIDES)]
    lines = "\n".join([f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}".strip(), *notes])
    extra = [r for r in reported if r.strip() and r not in lines and not r.startswith(_ASIDES)]
    return "\n".join([lines, *extra])


def check_property(prop: Property, pool: RankPool, impl: str, profile: Profile,
                   progress: Callable[[str], None] | None = None, every: float = 60.0,
                   judge: Judge | None = None, stats: Stats | None = None) -> Outcome:
    """Run one property's search; with ``progress``, say every ``every`` seconds that it still runs.

    ``judge``: each failure's status against the baseline release (Property.run); ``stats``:
    filled in as it runs.
    """
    stats, reported, findings = stats or Stats(), [], []
    start = time.monotonic()
    try:
        with hypothesis_internals.reporting_to(reported.append), _heartbeat(prop.name, stats, progress, every):
            prop.run(pool, impl, profile, stats, judge)
    except PoolError as exc:
        return _outcome(prop, pool, profile, Status.INFRA, start, stats, message=str(exc))
    except Divergence as exc:
        findings = _findings(prop, pool, impl, (exc,), stats, reported)
    except BaseExceptionGroup as group:
        if not all(isinstance(e, Divergence) for e in group.exceptions):
            raise _internal(prop.name, group) from group
        findings = _findings(prop, pool, impl, group.exceptions, stats, [])
    except Exception as exc:
        raise _internal(prop.name, exc) from exc
    met = {f.signature for f in findings}  # what only known failures showed: one example each
    findings += [_finding(prop, pool, impl, "", sig, drawn, status)
                 for sig, (status, drawn) in stats.known_seen.items() if sig not in met]
    outcome = _outcome(prop, pool, profile, Status.PASS, start, stats, findings=findings)
    outcome.judged()
    return outcome


@dataclass
class Spent:
    """What a run has spent of its profile's budgets, over all its searches."""

    shrinking: float = 0.0
    rerunning: float = 0.0


def judged_search(prop: Property, pool: RankPool, impl: str, profile: Profile, baseline=None,
                  spent: Spent | None = None, progress: Callable[[str], None] | None = None,
                  every: float = 60.0) -> Outcome:
    """One search, judged: the gate's whole sequence for a property on a pool, as the CLI,
    the pytest items and each ``--jobs`` part run it. The search, each failure judged by the
    baseline release on its case (tpdp_verify.runner.baseline), then the memo's failing cases
    of this search run on the candidate (FIXED, CHANGED), within the profile's budgets."""
    spent = spent if spent is not None else Spent()
    judge = None if baseline is None else \
        (lambda sig, drawn: status(sig, baseline.answer(prop, pool, impl, drawn, sig)))
    outcome = check_property(prop, pool, impl, profile.with_shrinking_left(profile.shrink_total - spent.shrinking),
                             progress, every, judge)
    outcome.unshrunk = profile.shrink and spent.shrinking >= profile.shrink_total
    spent.shrinking += outcome.stats.shrink_seconds
    if baseline is not None and outcome.status != Status.INFRA and baseline.is_candidate(impl):
        # the run is the release's: every case it ran, passes too, answers for the release
        baseline.remember(prop.name, pool.world_size, outcome.stats.ran, outcome.stats.printed)
    elif baseline is not None and outcome.status != Status.INFRA:
        start = time.monotonic()
        try:
            _rerun_memo(prop, pool, impl, outcome, baseline, profile.rerun_total - spent.rerunning)
        except PoolError as exc:
            outcome.status, outcome.message = Status.INFRA, str(exc)
        spent.rerunning += time.monotonic() - start
    outcome.judged()
    return outcome


def _rerun_memo(prop: Property, pool: RankPool, impl: str, outcome: Outcome, baseline, seconds: float) -> None:
    """The release's failing cases of this search, on the candidate: FIXED where it passes,
    CHANGED where it fails otherwise; a finding for each way, with the first case and how
    many showed it. Cases the search ran are judged by that run; the others run while
    ``seconds`` last (a recorded hang only while its timeout fits)."""
    stats, start = outcome.stats, time.monotonic()
    ways: dict[tuple, list] = {}  # (status, what the release showed, what the candidate shows) -> cases
    said = stats.said  # what the candidate said, a failure's text each way (the search's, then the reruns')
    for asked in baseline.memo.failing(prop.name, pool.world_size):
        now = stats.ran.get(asked.key)
        if now is None:
            left = seconds - (time.monotonic() - start)
            if left <= 0 or (signature.HANG in asked.signature and pool.timeout > left):
                stats.not_rerun += 1
                continue
            now, text = _run_once(prop, pool, impl, asked.drawn())
            stats.ran[asked.key] = now
            said.setdefault(now, text)
            stats.reran += 1
        verdict = Found.FIXED if not now else status(now, asked.signature)
        if verdict != Found.KNOWN:
            ways.setdefault((verdict, asked.signature, now), []).append(asked)
    for (verdict, was, now), cases in ways.items():
        if any((f.signature, f.status) == (now, verdict) for f in outcome.findings):
            continue  # reported by the search already
        does = "passes" if not now else " + ".join(signature.describe(p) for p in now)
        text = (f"torch {baseline.release} fails {len(cases)} case{'s' * (len(cases) > 1)} of this search with "
                f"{' + '.join(signature.describe(p) for p in was)}; the candidate {does} (the first below)")
        outcome.findings.append(_finding(prop, pool, impl, "\n".join(filter(None, [text, said.get(now, "")])),
                                         now or was, cases[0].drawn(), verdict))


def _run_once(prop: Property, pool: RankPool, impl: str, drawn: dict) -> tuple[signature.Signature, str]:
    """What the candidate shows on ``drawn``, outside hypothesis, and its failure's text:
    ((), "") where it passes."""
    try:
        prop.call(pool, impl, drawn, never)
    except Exception as exc:
        found = finding(exc)
        if found is None:
            raise _internal(prop.name, exc) from exc
        return found.signature, f"{type(found).__module__}.{type(found).__qualname__}: {found}"
    return (), ""


def _internal(name: str, exc: BaseException) -> BaseException:
    """The harness's failure running ``name``; or the interrupt, where a signal caused it."""
    stopped = interrupts.within(exc)
    return InternalError(name, exc) if stopped is None else Interrupted(stopped.signum)


def _outcome(prop: Property, pool: RankPool, profile: Profile, status: Status, start: float, stats: Stats,
             **details) -> Outcome:
    return Outcome(prop.name, pool.world_size, status, time.monotonic() - start, stats, backend=pool.backend,
                   wanted=prop.under(profile).max_examples, **details)


def _findings(prop: Property, pool: RankPool, impl: str, found, stats: Stats, reported: list[str]
              ) -> list[Finding]:
    """A Finding a distinct failure, with the case hypothesis shrank it to (or the cover case).
    One a signature: hypothesis tells failures apart by where they were raised too, and a
    crash is raised from more than one place."""
    out, seen = [], set()
    for e in found:
        if type(e).signature in seen:
            continue
        seen.add(type(e).signature)
        drawn = stats.failures.get(type(e).signature, stats.failing)
        out.append(_finding(prop, pool, impl, _failure_text(e, reported if len(found) == 1 else []),
                            type(e).signature, drawn, stats.statuses.get(type(e).signature, Found.FOUND)))
    return out


def _finding(prop: Property, pool: RankPool, impl: str, text: str, sig: tuple, drawn: dict | None,
             status: Found = Found.FOUND) -> Finding:
    if status.goes_on:
        text = f"{status}: {' + '.join(signature.describe(p) for p in sig)}"
    return Finding(text, prop.replay_code(pool.world_size, impl, drawn) if drawn else "",
                   " + ".join(signature.describe(p) for p in sig), drawn, sig, status,
                   faults.explain(prop.name, drawn, sig) if sig else None)


class InternalError(Exception):
    """tpdp-verify itself failed while running a property: not a finding (exit 3)."""

    def __init__(self, prop: str, exc: BaseException):
        super().__init__(f"tpdp-verify failed running {prop}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        self.original = exc


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
    baseline=None,
    seed: int | None = None,
    rank_output: str | None = None,
    selected: set[tuple[str, int]] | None = None,
) -> Iterator[Outcome]:
    """Each search's judged outcome as it comes (``judged_search``), so that a run cut short
    keeps what it found.

    ``progress`` gets a line per search with the count done, the failures so far and the
    time since the start, and a line every ``every`` seconds a search runs. ``baseline``:
    the release that judges (tpdp_verify.runner.baseline.Baseline); ``seed``: draw other
    cases than the profile's fixed ones; ``rank_output``: a directory for the ranks' stdout
    and stderr (RankPool's output), else the terminal; ``selected``: the searches (name,
    world size) to make, of all the profile's (tpdp_verify.runner.selection).
    """
    impl_mod.load(impl)  # a bad --impl fails here, in one line, before any rank starts
    if seed is not None:
        profile = dataclasses.replace(profile, seed=seed)
    plan = searches(properties, profile, selected)
    total = len(plan)
    done = failed = 0
    start, spent = time.monotonic(), Spent()
    for world_size in profile.world_sizes:
        todo = [p for p, ws in plan if ws == world_size]
        if not todo:
            continue
        up = time.monotonic()
        with RankPool(world_size, backend, timeout=timeout, max_rss_growth=MAX_RSS_GROWTH, after_hang=AFTER_HANG,
                      output=rank_output, waiting=lambda line: progress(f"      ... {line}")) as pool:
            progress(f"world size {world_size}: {pool.backend} ranks up in {time.monotonic() - up:.1f} s")
            for prop in todo:
                outcome = judged_search(prop, pool, impl, profile, baseline, spent, progress, every)
                outcome.rank_output = _set_aside(rank_output, world_size, prop.name) if rank_output else ""
                done, failed = done + 1, failed + (outcome.status in (Status.DIVERGES, Status.INFRA))
                progress(f"  [{done:>{len(str(total))}}/{total}] {_short_line(outcome)}  (failures so "
                         f"far: {failed}, elapsed {time.monotonic() - start:.0f} s)")
                yield outcome


def searches(properties: tuple[Property, ...], profile: Profile,
             selected: set[tuple[str, int]] | None = None) -> list[tuple[Property, int]]:
    """Every search a gate run makes, (property, world size), in the order it makes them;
    of ``selected`` only, where given."""
    return [(p, ws) for ws in profile.world_sizes for p in properties
            if ws >= p.min_world_size and (selected is None or (p.name, ws) in selected)]


def interrupted(left: list[tuple[Property, int]], signal: str, running: float | None, wanted: int) -> list[Outcome]:
    """The outcomes of the searches a signal left unjudged: the first of ``left`` ran for
    ``running`` seconds when it came (None: it came between searches), the others not at all."""
    outcomes = [Outcome(prop.name, ws, Status.INTERRUPTED, 0.0, wanted=wanted,
                        message=f"not run: the gate was interrupted by {signal}") for prop, ws in left]
    if outcomes and running is not None:
        outcomes[0].seconds, outcomes[0].message = running, f"interrupted by {signal} while it ran"
    return outcomes


def _set_aside(directory: str, world_size: int, name: str) -> str:
    """Move what the ranks printed during one property's search (torch's warnings, C++ logs,
    a crash's own words) from their logs into a file of its own, kept with its outcome;
    the path, or "" if they printed nothing. The ranks are idle between calls, and append."""
    logs = sorted(Path(directory).glob(f"world{world_size}-rank*.log"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    texts = {p: p.read_bytes() for p in logs}
    for p in logs:
        os.truncate(p, 0)
    if not any(texts.values()):
        return ""
    target = Path(directory) / f"{name}-world{world_size}.log"
    with target.open("ab") as f:
        for p, text in texts.items():
            if text:
                f.write(f"==> {p.stem.split('-', 1)[1]} <==\n".encode() + text)
    return str(target)


def run_gate(properties: tuple[Property, ...], profile: Profile, impl: str = "torch",
             backend: str = "auto", timeout: float = 120.0,
             progress: Callable[[str], None] = print, **options) -> list[Outcome]:
    """Every outcome of a whole run (see ``iter_gate``)."""
    return list(iter_gate(properties, profile, impl, backend, timeout, progress, **options))


def _drew(o: Outcome) -> str:
    known = f", {o.stats.known} known only" if o.stats.known else ""
    known += f", {o.stats.not_asked} not asked" if o.stats.not_asked else ""
    short = f" FEWER THAN {o.wanted}" if o.short else ""
    return f"{o.stats.drawn:>4} drawn{short}{known}"


def _line(o: Outcome) -> str:
    return (f"{o.property:<{WIDTH}} world {o.world_size}  {o.status.upper():<8} {_drew(o)}, "
            f"{o.stats.covered} cover, {o.stats.examples} run ({o.stats.discarded} discarded)  {o.seconds:6.1f} s")


def _short_line(o: Outcome) -> str:
    """``_line`` without the run and discarded counts (the summary has them): progress lines stay short."""
    return f"{o.property:<{WIDTH}} world {o.world_size}  {o.status.upper():<8} {_drew(o)}  {o.seconds:6.1f} s"


def verdict(outcomes: list[Outcome]) -> Status:
    """The run's: its worst search's (tpdp_verify.status), whose exit code the gate exits with."""
    return statuses.worst(o.status for o in outcomes)


def summary(outcomes: list[Outcome], profile: Profile, impl: str, seconds: float,
            excluded: list[str] = (), full: bool = True) -> str:
    """The run in words: ``full``, every search's line, what is not searched, each finding's
    report and replay (the report file, and the terminal under -v); else what a person reads
    first: the counts, what needs attention, and a line a finding that is not known."""
    short = [o for o in outcomes if o.short]
    out = [f"tpdp-verify gate: profile {profile.name}, implementation {impl}, torch {torch.__version__}"]
    out += [_line(o) for o in outcomes] if full else []
    counted = statuses.counted(statuses.count(o.status for o in outcomes))
    out.append(f"{counted} in {seconds:.1f} s ({profile.name} budget "
               f"{profile.budget:.0f} s{', OVER BUDGET' if seconds > profile.budget else ''})")
    if short and (full or len(short) <= 3):
        out.append(f"{len(short)} searches drew fewer examples than they ask: "
                   + ", ".join(f"{o.property} (world {o.world_size}: {o.stats.drawn} of {o.wanted}"
                               f"{', ' + o.stats.stopped_because if o.stats.stopped_because else ''})"
                               for o in short))
    elif short:
        out.append(f"{len(short)} searches drew fewer examples than they ask (a new finding stops one; the full "
                   "report says why each stopped)")
    history = [(o, text) for o in outcomes for text, _ in o.stats.history]
    if history:
        out.append(f"{len(history)} cases killed a rank after other cases on the same ranks and not on fresh ones "
                   "(each judged by its run on fresh ranks; the death is a fault of an earlier case's, in the JSON): "
                   + "; ".join(f"{o.property} (world {o.world_size}): {text.splitlines()[0]}" for o, text in history))
    unshrunk = [o for o in outcomes if o.unshrunk]
    if unshrunk:
        out.append(f"the gate spent its {profile.shrink_total:g} s of shrinking ({profile.name}); "
                   f"{len(unshrunk)} later searches reported their failures as first found: "
                   + ", ".join(f"{o.property} (world {o.world_size})" for o in unshrunk))
    if full:
        out += catalog_lines(outcomes, most=None) + list(excluded)
        out.append(coverage.summary_line(coverage.unexercised()))
        for o in outcomes:
            if o.status != Status.PASS:
                out += ["", outcome_report(o)]
        return "\n".join(out)
    unset = sum(map(len, coverage.unexercised().values()))
    out.append(f"not searched: {len(excluded)} regions of the case space; keywords no case sets: {unset} "
               "(each with its reason in the full report)")
    out += catalog_lines(outcomes)
    lines = [fit(f"  {f.status:<8} {o.property} (world {o.world_size}): {f.kind}", _numbered(f))
             for o in outcomes for f in o.findings if not f.status.goes_on]
    lines += [fit(f"  {Status.INFRA.label:<8} {o.property} (world {o.world_size}): {o.message.splitlines()[0]}")
              for o in outcomes if o.status == Status.INFRA and o.message]
    return "\n".join(out + (["findings (their cases and replays in the full report):", *lines] if lines else []))


def fit(line: str, tail: str = "", width: int | None = None) -> str:
    """``line`` and its ``tail`` within the terminal's width (100 where there is none): the
    line cut, "..." where cut, the tail kept whole. The full text is in the report."""
    width = (width or shutil.get_terminal_size((100, 24)).columns) - len(tail)
    return (line if len(line) <= width else line[: max(width - 3, 20)] + "...") + tail


def _numbered(f: Finding) -> str:
    """The catalogued faults a finding names, by number: ``[faults 1, 30]``."""
    if f.explanation is None or not f.explanation.faults:
        return "" if f.explanation is None else " [no catalogued fault]"
    numbers = [str(x.number) for x in f.explanation.faults]
    return f" [fault{'s' * (len(numbers) > 1)} {', '.join(numbers)}{' +' if f.explanation.unexplained else ''}]"


def _named(f: Finding) -> str:
    """The faults the catalog names for a finding, in brackets; or that it names none."""
    if f.explanation is None:
        return ""
    if not f.explanation.faults:
        return " [no catalogued fault]"
    more = " + uncatalogued parts" if f.explanation.unexplained else ""
    return f" [{'; '.join(x.label for x in f.explanation.faults)}{more}]"


def catalog_lines(outcomes: list[Outcome], most: int | None = 5) -> list[str]:
    """How many known failures the catalog explains; each it does not (``most`` of them; None:
    all), for it is news."""
    known = [(o, f) for o in outcomes for f in o.findings if f.status == Found.KNOWN and f.explanation]
    if not known:
        return []
    named = sorted({x.number for _, f in known for x in f.explanation.faults})
    out = [f"the fault catalog explains {sum(f.explanation.explained for _, f in known)} of {len(known)} known "
           f"failures (faults {', '.join(map(str, named)) or 'none'}; tpdp-verify explain N)"]
    news = [f"  no catalogued fault explains {', '.join(f.explanation.unexplained)} in {o.property} (world "
            f"{o.world_size}): news, though the baseline release fails alike" for o, f in known
            if not f.explanation.explained]
    left = len(news) - (len(news) if most is None else min(most, len(news)))
    return out + news[:most] + ([f"  and {left} more (the full report)"] if left else [])


def outcome_report(o: Outcome) -> str:
    """Why a property has no pass: each finding's status, failed checks, shrunk case and replay."""
    if o.status == Status.PASS:
        return ""
    out = [f"== {o.property} (world size {o.world_size}): {o.status}"]
    if o.message:
        out.append(o.message)
    for f in (f for f in o.findings if not f.status.goes_on):
        out += ["", f"{f.status}: {f.kind}", f"signature: {', '.join(f.signature)}"]
        out += [f"catalog: {f.explanation.line()}"] if f.explanation else []
        out.append(f.failure)
        if f.replay:
            out += ["(the case as first found: the gate's shrinking budget was spent)"] if o.unshrunk else []
            out += [REPLAY, f.replay.rstrip()]
    known = [f.kind + _named(f) for f in o.findings if f.status == Found.KNOWN]
    if known:
        out += ["", f"known ({o.stats.known} examples showed only failures the baseline release shows on the same "
                    "case): " + "; ".join(known)]
    unasked = [f.kind for f in o.findings if f.status == Found.NOT_ASKED]
    if unasked:
        out += ["", f"not asked ({o.stats.not_asked} examples failed where the baseline release could not be asked: "
                    "no verdict): " + "; ".join(unasked)]
    if o.rank_output:
        out += ["", f"what the ranks printed during this search (-v shows it as it comes): {o.rank_output}"]
    return "\n".join(out)
