"""A property of the conformance suite, and running it under a profile.

A property is a plain function ``fn(pool, impl, **drawn)`` plus the strategies that
draw its arguments. ``Property.run`` wraps it in hypothesis afresh for each run, so the
profile is chosen per run and nothing global is touched, and counts the examples it ran
so that a property whose strategy was filtered away cannot pass silently.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import hypothesis
from hypothesis import given
from hypothesis.errors import UnsatisfiedAssumption

from tpdp_verify import hypothesis_internals, signature, stacks
from tpdp_verify.cases import case_types
from tpdp_verify.errors import PoolError, RankDied, RankFailed, RankTimeout
from tpdp_verify.judging.divergence import Divergence, divergence
from tpdp_verify.runner.memo import key, printed
from tpdp_verify.runner.profiles import Profile
from tpdp_verify.status import Found


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
    known: int = 0  # examples whose every failure the baseline release shows too: counted, not raised
    not_asked: int = 0  # examples that failed where the baseline could not be asked: counted, not raised
    known_seen: dict = field(default_factory=dict)  # signature -> (status, the first example that showed it)
    stopped_because: str = ""  # why hypothesis stopped generating, in its words
    shrink_seconds: float = 0.0  # spent shrinking (and explaining) what the search found
    failing: dict | None = None  # drawn arguments of the last failing example (the shrunk one)
    # the same, a failure's signature each: hypothesis shrinks distinct bugs (exception types) apart,
    # and two signatures of one exception class name are two bugs
    failures: dict = field(default_factory=dict)
    statuses: dict = field(default_factory=dict)  # signature -> its status, as last judged (NEW, CHANGED)
    cover_failures: list = field(default_factory=list)  # (Divergence, drawn) of failing cover cases
    ran: dict = field(default_factory=dict)  # memo key -> what the candidate showed there (() passed)
    printed: dict = field(default_factory=dict)  # memo key -> the case as the memo keeps it (reprs, types)
    said: dict = field(default_factory=dict)  # signature -> the first failure's text that showed it
    reran: int = 0  # the memo's failing cases run again on the candidate after the search
    not_rerun: int = 0  # and those the rerun budget left
    # (what died, the case) where a rank died on ranks that had run other cases but not on
    # fresh ones: the case is judged by its run on fresh ranks (on_fresh_ranks)
    history: list = field(default_factory=list)


# (a failure's signature, its case) -> its status against the baseline release:
# known, not asked (counted, and the search draws on), NEW or CHANGED (raised)
Judge = Callable[[signature.Signature, dict], Found]


def worth_explaining(sig: signature.Signature) -> bool:
    """Whether a failure's report reaches a reader, so that it is worth two more runs on
    the ranks (naming the first module, running the case without TP): not during the
    search or shrinking; yes outside hypothesis (a replay) and in the final replay of an
    example hypothesis reports."""
    return hypothesis_internals.in_final_replay()


def never(sig: signature.Signature) -> bool:
    return False


def always(sig: signature.Signature) -> bool:
    return True


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
        dumps = getattr(exc, "stacks", {}) or {}
        return divergence((signature.HANG,))("\n".join(filter(None, [str(exc), stacks.report(dumps)])))
    if isinstance(exc, RankFailed):
        parts = signature.echoes_left_out(_part(tb) for tb in exc.tracebacks.values())
        if all(" at " in signature.api(p) for p in parts):  # raised by the code under test, not by ours
            # Ranks left waiting for the ones that raised are named in the message, not the
            # signature: whether a rank reached the raise or a collective first is timing,
            # and the wait is the raise's (a fault's signature must not move run to run)
            return divergence(signature.of(parts))(str(exc))
    return None


def on_fresh_ranks(run: Callable[[], None], history: list | None = None, case: dict | None = None,
                   fresh: bool = False) -> None:
    """``run()``, and should a rank die, once more. A pool whose rank died starts fresh
    ranks, so the second run has no history: a death it shows again is the case's own. One
    it does not show came from what earlier cases left in the ranks (torch reading memory
    it freed, a group left broken), so the case is judged by its second run and the death
    is kept in ``history`` with ``case``: a verdict must not depend on which cases ran
    before it on the same processes. ``fresh``: ``run`` starts on ranks that have run
    nothing, so its death is the case's own at once (run again, it would meet the same)."""
    try:
        run()
        return
    except RankDied as died:
        if fresh:
            raise
        first = str(died)
    again = False
    try:
        run()
    except RankDied:
        again = True
        raise
    finally:
        if not again and history is not None:
            history.append((first, dict(case or {})))


def _part(traceback_text: str) -> str:
    """The signature part of a rank's failure: carried with an exception the rank caught
    (pool.caught), else read from the traceback it raised with."""
    from tpdp_verify.ranks.rank import CAUGHT_PART

    if CAUGHT_PART in traceback_text:
        return traceback_text.rsplit(CAUGHT_PART, 1)[1].strip()
    return signature.raised_from_text(traceback_text)


class _Escape(BaseException):
    """Carries what is not a finding (the harness failing) out of hypothesis, unshrunk."""


def _judged(judge: Judge, sig: signature.Signature, drawn: dict) -> Found:
    """``judge(sig, drawn)``; the baseline side failing (its ranks would not start) is the
    harness's failure, carried out of hypothesis, never a failure of the case."""
    try:
        return judge(sig, drawn)
    except Exception as exc:
        raise _Escape(exc) from exc


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

    @functools.cached_property
    def explains(self) -> bool:
        """Whether its function takes ``explain``: which failures are worth two more runs (its
        own parameters: a wrapper's ``functools.wraps`` would show the wrapped function's)."""
        return "explain" in inspect.signature(self.fn, follow_wrapped=False).parameters

    def call(self, pool, impl: str, drawn: dict, explain: Callable = worth_explaining,
             history: list | None = None) -> None:
        """The property once on ``drawn`` (again on fresh ranks should a rank die: on_fresh_ranks)."""
        extra = {"explain": explain} if self.explains else {}
        on_fresh_ranks(lambda: self.fn(pool, impl, **drawn, **extra), history=history, case=drawn,
                       fresh=getattr(pool, "fresh", False))

    def run(self, pool, impl: str, profile: Profile, stats: Stats | None = None,
            judge: Judge | None = None) -> Stats:
        """Run under ``profile`` on ``pool``; raise the failures found, after shrinking.

        ``impl`` names the implementation under test (see tpdp_verify.impls.select). ``judge``
        (tpdp_verify.runner.baseline): an example whose failure the baseline release shows on
        the same case is counted (``stats.known``) and the search goes on; only failures it
        calls NEW or CHANGED are raised, shrunk and replayed. ``stats``, if given, is filled
        in as the run goes, so it is there even when the run raises.
        """
        stats = Stats() if stats is None else stats
        profile = self.under(profile)

        given_as = inspect.signature(self.fn)  # hypothesis draws what the property takes, but ``explain``
        taken = [p for p in given_as.parameters.values() if p.name != "explain"]
        positional = [p.name for p in taken[2:]]

        @functools.wraps(self.fn)  # hypothesis names the test from the property
        def run_one(pool, impl, *args, explain=worth_explaining, **kwargs):
            kwargs.update(zip(positional, args))  # hypothesis may pass them by position
            stats.examples += 1
            drawn = {k: v for k, v in kwargs.items() if k in self.strategies}
            where = key(self.name, pool.world_size, drawn)
            stats.printed[where] = printed(drawn)
            try:
                self.call(pool, impl, kwargs, explain, stats.history)
            except UnsatisfiedAssumption:
                stats.discarded += 1
                raise
            except BaseException as exc:
                found = finding(exc) if isinstance(exc, Exception) else None
                if found is None:
                    raise _Escape(exc) from exc
                stats.ran[where] = found.signature
                stats.said.setdefault(found.signature, f"{type(found).__module__}.{type(found).__qualname__}: {found}")
                status = _judged(judge, found.signature, drawn) if judge is not None else Found.FOUND
                if status.goes_on:
                    stats.known += status == Found.KNOWN
                    stats.not_asked += status == Found.NOT_ASKED
                    stats.known_seen.setdefault(found.signature, (status, drawn))
                    return
                stats.statuses[found.signature] = status
                stats.failing = stats.failures[found.signature] = drawn
                if found is exc:
                    raise
                raise found from exc
            stats.ran[where] = ()
            stats.passed += 1

        run_one.__signature__ = given_as.replace(parameters=taken)

        strategies = {k: s(pool.world_size) if callable(s) else s for k, s in self.strategies.items()}
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
        if stats.cover_failures:
            raise self._with_cover(None, stats)
        if stats.passed + stats.known + stats.not_asked == 0:
            raise AssertionError(
                f"property {self.name} ran no example it could check ({stats}); its strategy "
                "never produced a case it could check"
            )
        return stats

    def _cover(self, run_one, strategies: dict, pool, impl: str, stats: Stats) -> None:
        """The cover phase: each case once, outside hypothesis; a failure is kept, not raised.
        Explained (two more runs) only where it is reported: not where the baseline knows it."""
        for covered in self.cover(strategies) if self.cover else ():
            stats.covered += 1
            try:
                run_one(pool, impl, explain=never, **covered)
            except Divergence:
                try:
                    self.call(pool, impl, covered, always)
                except Divergence as explained:
                    stats.cover_failures.append((explained, covered))
                except Exception as exc:  # the second run met something else: the first's stands
                    found = finding(exc)
                    if found is None:
                        raise
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
        with hypothesis_internals.collecting(note), hypothesis_internals.shrinking_for(profile.shrink_seconds), \
                hypothesis_internals.without_local_constants():
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
