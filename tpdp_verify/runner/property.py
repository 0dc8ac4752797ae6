"""A property of the conformance suite, and running it under a profile.

A property is a plain function ``fn(pool, impl, **drawn)`` plus the strategies that
draw its arguments. ``Property.run`` wraps it in hypothesis afresh for each run, so the
profile is chosen per run and nothing global is touched, and counts the examples it ran
so that a property whose strategy was filtered away cannot pass silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import hypothesis
from hypothesis import given
from hypothesis.errors import UnsatisfiedAssumption
from hypothesis.statistics import collector

from tpdp_verify import signature
from tpdp_verify.cases import mesh_kind
from tpdp_verify.errors import PoolError, RankDied, RankFailed, RankTimeout
from tpdp_verify.judging.divergence import Divergence, divergence
from tpdp_verify.runner.profiles import Profile


FIXED_SEEDS = Path(__file__).with_name("fixed_seeds.json")


@functools.cache
def _frozen() -> dict[str, int]:
    return {name: int(seed, 16) for name, seed in json.loads(FIXED_SEEDS.read_text()).items()}


def fixed_seed(name: str, fn: Callable) -> int:
    """The seed of a property's fixed draw (a profile with no --seed). Hypothesis's
    derandomize would seed it from the property's source, so an edit of its docstring
    would draw other cases, and a baseline learned from the old ones would meet faults it
    never recorded. The seeds of tpdp-verify's own properties are frozen in
    fixed_seeds.json (what derandomize gave when they were frozen: the draws learned since
    stay); any other property's comes from its qualified name."""
    frozen = _frozen().get(name)
    return frozen if frozen is not None else \
        int.from_bytes(hashlib.sha384(f"{fn.__module__}.{fn.__qualname__}".encode()).digest())


@dataclass
class Stats:
    examples: int = 0  # calls of the property: cover cases, drawn ones and shrinking
    passed: int = 0
    discarded: int = 0  # rejected by assume() or a filter inside the example
    drawn: int = 0  # examples hypothesis generated (its generate phase; shrinking apart)
    covered: int = 0  # cover cases run, in their own phase before the search
    known: int = 0  # examples whose every failure a baseline knows: counted, not raised
    known_seen: dict = field(default_factory=dict)  # signature -> the first example that showed it
    stopped_because: str = ""  # why hypothesis stopped generating, in its words
    shrink_seconds: float = 0.0  # spent shrinking (and explaining) what the search found
    failing: dict | None = None  # drawn arguments of the last failing example (the shrunk one)
    # the same, a failure's signature each: hypothesis shrinks distinct bugs (exception types) apart,
    # and two signatures of one exception class name are two bugs
    failures: dict = field(default_factory=dict)
    cover_failures: list = field(default_factory=list)  # (Divergence, drawn) of failing cover cases
    learned: dict = field(default_factory=dict)  # writing a baseline: (region, signature) -> (text, drawn)
    replays: int = 0  # failures run again on the baseline implementation (gate --baseline-python)
    replay_seconds: float = 0.0  # the time those took, here and on the baseline's ranks
    by_parts: int = 0  # failures judged by the parts the baseline had shown, its replay budget spent
    # (what died, the case) where a rank died on ranks that had run other cases but not on
    # fresh ones: the case is judged by its run on fresh ranks (on_fresh_ranks)
    history: list = field(default_factory=list)


Judge = Callable[[signature.Signature, dict], bool]  # (a failure's signature, its case) -> known?


def region(drawn: dict | None) -> str:
    """Where a case lies, as a baseline tells faults apart: a training or checkpoint case's
    DP entry point, model and mesh kind ("dp", "tp", "dp x tp"); a case's own ``region``
    where it has one (a tensor's layout; a drawn loss's path through torch); "" for the
    rest (a module tree), whose property is one region. A part seen under ``replicate`` on
    the tied model says nothing of FSDP1 on the MLP, nor overlapping metadata of uneven
    shards of even ones, nor a KL loss's gradients under loss_parallel of cross entropy's."""
    case = (drawn or {}).get("case")
    if isinstance(getattr(case, "region", None), str):
        return case.region
    entry, model, mesh = (getattr(case, a, None) for a in ("dp_form", "model", "mesh_shape"))
    if not (isinstance(entry, str) and isinstance(model, str) and mesh):
        return ""
    return f"{entry} {model} {mesh_kind(mesh)}"


class KnownParts:
    """Known by a file baseline: every part of the failure is recorded for the property in
    the case's region (``region``); given a plain set, for the property anywhere. Learning a
    baseline adds each new failure's parts to its region."""

    def __init__(self, parts: dict[str, set[str]] | set[str] | tuple = ()):
        self.by_region = {r: set(p) for r, p in parts.items()} if isinstance(parts, dict) else None
        self.parts = set() if isinstance(parts, dict) else set(parts)

    def _of(self, drawn: dict | None) -> set[str]:
        return self.parts if self.by_region is None else self.by_region.setdefault(region(drawn), set())

    def __call__(self, sig: signature.Signature, drawn: dict | None = None) -> bool:
        return signature.known(sig, self._of(drawn))

    def learn(self, sig: signature.Signature, drawn: dict) -> None:
        self._of(drawn).update(sig)


class _Escape(BaseException):
    """Carries what is not a finding (the harness failing) out of hypothesis, unshrunk."""


# How the baseline judges the property now running (None: no baseline), and the case it runs.
_KNOWN: contextvars.ContextVar[Judge | None] = contextvars.ContextVar("tpdp_known", default=None)
_DRAWN: contextvars.ContextVar[dict | None] = contextvars.ContextVar("tpdp_drawn", default=None)


def known_now(sig: signature.Signature) -> bool:
    """Whether the file baseline of the property now running knows every part of ``sig`` in
    the running case's region: a shortcut for reports, so never by replay (that costs a run)."""
    known = _KNOWN.get()
    return isinstance(known, KnownParts) and known(sig, _DRAWN.get())


def worth_explaining(sig: signature.Signature) -> bool:
    """Whether a failure's report reaches a reader, so that it is worth two more runs on
    the ranks (naming the first module, running the case without TP): not for a failure a
    baseline knows, nor during shrinking; yes outside hypothesis (a replay, a cover case)
    and in the final replay of an example hypothesis reports."""
    from hypothesis.control import current_build_context, currently_in_test_context

    if known_now(sig):
        return False
    return not currently_in_test_context() or current_build_context().is_final


def finding(exc: BaseException) -> Divergence | None:
    """``exc`` as a finding about the implementation under test, or None if it is the
    harness's own failure. A rank that died or hung while the case ran is a finding with
    a signature of its own; so is an exception that escaped a rank from the code under test."""
    if isinstance(exc, Divergence):
        return exc
    if isinstance(exc, PoolError) and "start-up" in str(exc):
        return None  # ranks that would not start: the harness, not the case
    if isinstance(exc, RankDied):
        return divergence((signature.crash(getattr(exc, "signal", "")),))(str(exc))
    if isinstance(exc, RankTimeout):
        stacks = getattr(exc, "stacks", {}) or {}
        text = "\n".join([str(exc)] + [f"--- rank {r} stack ---\n{t.rstrip()}" for r, t in sorted(stacks.items())])
        return divergence((signature.HANG,))(text)
    if isinstance(exc, RankFailed):
        parts = {_part(tb) for tb in exc.tracebacks.values()}
        if all(" at " in p for p in parts):  # raised by the code under test, not by ours
            # Ranks left waiting for the ones that raised are named in the message, not the
            # signature: whether a rank reached the raise or a collective first is timing,
            # and the wait is the raise's (a fault's signature must not move run to run)
            return divergence(signature.of(parts))(str(exc))
    return None


def on_fresh_ranks(fn: Callable, *args, history: list | None = None, **kwargs) -> None:
    """``fn(*args, **kwargs)``, and should a rank die, once more. A pool whose rank died
    starts fresh ranks, so the second run has no history: a death it shows again is the
    case's own. One it does not show came from what earlier cases left in the ranks (torch
    reading memory it freed, a group left broken), so the case is judged by its second run
    and the death is kept in ``history`` with the case: a verdict must not depend on which
    cases ran before it on the same processes."""
    try:
        fn(*args, **kwargs)
        return
    except RankDied as died:
        first = str(died)
    again = False
    try:
        fn(*args, **kwargs)
    except RankDied:
        again = True
        raise
    finally:
        if not again and history is not None:
            history.append((first, dict(kwargs)))


def _part(traceback_text: str) -> str:
    """The signature part of a rank's failure: carried with an exception the rank caught
    (pool.caught), else read from the traceback it raised with."""
    from tpdp_verify.ranks.pool import CAUGHT_PART

    if CAUGHT_PART in traceback_text:
        return traceback_text.rsplit(CAUGHT_PART, 1)[1].strip()
    return signature.raised_from_text(traceback_text)


def _judged(known: Judge, sig: signature.Signature, drawn: dict) -> bool:
    """``known(sig, drawn)``; the baseline side failing (its ranks would not start) is the
    harness's failure, carried out of hypothesis, never a failure of the case."""
    try:
        return known(sig, drawn)
    except Exception as exc:
        raise _Escape(exc) from exc


@contextlib.contextmanager
def _shrinking_for(seconds: int):
    """Bound the time hypothesis spends shrinking one run (its engine's module constant)."""
    from hypothesis.internal.conjecture import engine

    saved, engine.MAX_SHRINKING_SECONDS = engine.MAX_SHRINKING_SECONDS, seconds
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = saved


@contextlib.contextmanager
def without_local_constants():
    """Draw without the constants hypothesis reads from the source of the local modules
    imported so far (one draw in twenty picks one): with them the fixed draw moves with
    every literal of tpdp-verify's own code, and with whichever modules the process that
    searches (the CLI, pytest, a script) has imported, so a baseline learned from a draw
    no longer meets it. Without them a draw is a function of the case space, the seed and
    hypothesis's pinned version alone."""
    from hypothesis.internal.conjecture import providers

    saved = getattr(providers, "_get_local_constants", None)
    if saved is None:  # a hypothesis older than its constant pool draws without one
        yield
        return
    providers._get_local_constants = providers.Constants
    providers.CONSTANTS_CACHE.cache.clear()  # filled from the local constants before
    try:
        yield
    finally:
        providers._get_local_constants = saved
        providers.CONSTANTS_CACHE.cache.clear()


@dataclass(frozen=True)
class Property:
    name: str
    fn: Callable
    strategies: dict = field(repr=False)
    min_world_size: int = 1
    # (world size's strategies) -> cases run in a phase of their own before the search:
    # cases a profile must reach whatever hypothesis draws (the simplest case of every
    # zoo model). Their failures are findings; they never stop the search.
    cover: Callable[[dict], list[dict]] | None = field(default=None, repr=False)
    # (profile name, examples): the most this property draws under that profile, where a
    # full search costs more than the profile's budget holds; its cover cases still run
    examples: tuple[tuple[str, int], ...] = ()

    def under(self, profile: Profile) -> Profile:
        """``profile`` as this property runs under it: its examples capped where declared."""
        cap = dict(self.examples).get(profile.name)
        return profile if cap is None or cap >= profile.max_examples else \
            dataclasses.replace(profile, max_examples=cap)

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0]

    def drawing(self, **strategies) -> "Property":
        """The same property over other strategies, e.g. a narrower case space."""
        return dataclasses.replace(self, strategies={**self.strategies, **strategies})

    def run(self, pool, impl: str, profile: Profile, stats: Stats | None = None,
            known: set[str] | Judge | None = None, learn: bool = False) -> Stats:
        """Run under ``profile`` on ``pool``; raise the failures found, after shrinking.

        ``impl`` names the implementation under test (see tpdp_verify.impls.select). ``known``,
        the signature parts a baseline records for this property, or a ``Judge`` (the
        baseline implementation run on the same case, tpdp_verify.runner.replay): an example
        whose every failure is known is counted (``stats.known``) and the search goes on; only
        new failures are raised, shrunk and replayed. ``learn`` (writing a baseline): a new
        failure is added to ``known`` and kept with its case in ``stats.learned``, and the
        search goes on, so that one search meets every failure it can; the cases are the
        first that showed each failure, not shrunk. ``stats``, if given, is filled in as the
        run goes, so it is there even when the run raises.
        """
        stats = Stats() if stats is None else stats
        profile = self.under(profile)
        known = {} if learn and known is None else known
        if known is not None and not callable(known):
            known = KnownParts(known)

        @functools.wraps(self.fn)  # hypothesis names the test from the property
        def run_one(*args, **kwargs):
            stats.examples += 1
            drawn = {k: v for k, v in kwargs.items() if k in self.strategies}
            _DRAWN.set(drawn)
            try:
                on_fresh_ranks(self.fn, *args, history=stats.history, **kwargs)
            except UnsatisfiedAssumption:
                stats.discarded += 1
                raise
            except BaseException as exc:
                found = finding(exc) if isinstance(exc, Exception) else None
                if found is None:
                    raise _Escape(exc) from exc
                if known is not None and _judged(known, found.signature, drawn):
                    stats.known += 1
                    stats.known_seen.setdefault(found.signature, drawn)
                    return
                if learn:
                    known.learn(found.signature, drawn)
                    stats.learned[region(drawn), found.signature] = (str(found), drawn)
                    return
                stats.failing = stats.failures[found.signature] = drawn
                if found is exc:
                    raise
                raise found from exc
            stats.passed += 1

        strategies = {k: s(pool.world_size) if callable(s) else s for k, s in self.strategies.items()}
        token, drawn_token = _KNOWN.set(known), _DRAWN.set(None)
        try:
            self._cover(run_one, strategies, pool, impl, stats)
            self._search(run_one, strategies, pool, impl, profile, stats)
        except _Escape as escape:
            raise escape.args[0] from None
        except BaseExceptionGroup as group:  # distinct failures, one of them the harness's
            escape = next((e for e in group.exceptions if isinstance(e, _Escape)), None)
            if escape is not None:
                raise escape.args[0] from None
            raise self._with_cover(group, stats) from None
        except Divergence as one:
            raise self._with_cover(one, stats) from None
        finally:
            _KNOWN.reset(token)
            _DRAWN.reset(drawn_token)
        if stats.cover_failures:
            raise self._with_cover(None, stats)
        if stats.passed + stats.known + len(stats.learned) == 0:
            raise AssertionError(
                f"property {self.name} ran no example it could check ({stats}); its strategy "
                "never produced a case it could check"
            )
        return stats

    def _cover(self, run_one, strategies: dict, pool, impl: str, stats: Stats) -> None:
        """The cover phase: each case once, outside hypothesis; a failure is kept, not raised."""
        for covered in self.cover(strategies) if self.cover else ():
            stats.covered += 1
            try:
                run_one(pool, impl, **covered)
            except Divergence as found:
                stats.cover_failures.append((found, covered))

    def _search(self, run_one, strategies: dict, pool, impl: str, profile: Profile, stats: Stats) -> None:
        def note(statistics: dict) -> None:
            cases = statistics.get("generate-phase", {}).get("test-cases", [])
            stats.drawn = sum(c["status"] in ("valid", "interesting") for c in cases)
            stats.stopped_because = statistics.get("stopped-because", "")
            stats.shrink_seconds = sum(statistics.get(f"{phase}-phase", {}).get("duration-seconds", 0.0)
                                       for phase in ("shrink", "explain"))

        test = profile.settings(given(**strategies)(run_one))
        test = hypothesis.seed(fixed_seed(self.name, self.fn) if profile.seed is None else profile.seed)(test)
        with collector.with_value(note), _shrinking_for(profile.shrink_seconds), without_local_constants():
            test(pool, impl)

    @staticmethod
    def _with_cover(raised: BaseException | None, stats: Stats) -> BaseException:
        """What the search raised, with the cover phase's failures of other signatures."""
        found = list(raised.exceptions if isinstance(raised, BaseExceptionGroup) else [raised] if raised else [])
        seen = {type(e).signature for e in found}
        for failure, _ in stats.cover_failures:
            if type(failure).signature not in seen:
                seen.add(type(failure).signature)
                found.append(failure)
        return found[0] if len(found) == 1 else BaseExceptionGroup("distinct failures", found)

    def replay_code(self, world_size: int, impl: str, drawn: dict) -> str:
        """A script that runs this property once on ``drawn``, outside hypothesis."""
        args = "".join(f", {k}={v!r}" for k, v in drawn.items())
        imports = "".join(f"from {t.__module__} import {t.__qualname__}\n"
                          for t in sorted(case_types(drawn), key=lambda t: t.__qualname__))
        return (
            "import torch\n"
            "from torch.distributed.tensor import Replicate, Shard\n"
            "from tpdp_verify import RankPool\n"
            f"{imports}from {self.fn.__module__} import {self.name}\n\n"
            'if __name__ == "__main__":  # ranks are spawned: they re-import this file\n'
            f"    with RankPool({world_size}) as pool:\n"
            f"        {self.name}.fn(pool, {impl!r}{args})\n"
        )


def case_types(value) -> set[type]:
    """The project's dataclasses a drawn value is made of, nested ones included."""
    if dataclasses.is_dataclass(value):
        fields = (getattr(value, f.name) for f in dataclasses.fields(value))
        return {type(value)}.union(*map(case_types, fields))
    if isinstance(value, (tuple, list)):
        return set().union(*map(case_types, value))
    if isinstance(value, dict):
        return set().union(*map(case_types, value.values()))
    return set()


def tpdp_property(*, min_world_size: int = 1, cover: Callable[[dict], list[dict]] | None = None,
                  examples: dict[str, int] | None = None, **strategies) -> Callable[[Callable], Property]:
    """Declare ``fn(pool, impl, **drawn)`` a property with strategies for ``drawn``.

    A strategy may also be a function of the pool's world size, for cases (mesh shapes)
    that depend on it. ``cover`` gives explicit examples from the strategies (see Property);
    ``examples``, the most it draws under a profile (``{"ci": 10}``).
    """

    def declare(fn: Callable) -> Property:
        return Property(fn.__name__, fn, strategies, min_world_size, cover, tuple(sorted((examples or {}).items())))

    return declare
