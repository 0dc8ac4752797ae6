"""A property of the conformance suite, and running it under a profile.

A property is a plain function ``fn(pool, impl, **drawn)`` plus the strategies that
draw its arguments. ``Property.run`` wraps it in hypothesis afresh for each run, so the
profile is chosen per run and nothing global is touched, and counts the examples it ran
so that a property whose strategy was filtered away cannot pass silently.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import example, given
from hypothesis.errors import UnsatisfiedAssumption

from tpdp_verify.errors import PoolError
from tpdp_verify.profiles import Profile


@dataclass
class Stats:
    examples: int = 0  # examples hypothesis ran, shrinking included
    passed: int = 0
    discarded: int = 0  # rejected by assume() or a filter inside the example
    failing: dict | None = None  # drawn arguments of the last failing example (the shrunk one)
    # the same, a kind of failure (exception type) each: hypothesis shrinks distinct bugs apart
    failures: dict = field(default_factory=dict)


class _PoolBroke(BaseException):
    """Carries a PoolError out of hypothesis, which must not shrink on a hang or crash."""


@dataclass(frozen=True)
class Property:
    name: str
    fn: Callable
    strategies: dict = field(repr=False)
    min_world_size: int = 1
    # (world size's strategies) -> explicit examples run before any drawn one: cases a
    # profile must reach whatever hypothesis draws (the simplest case of every zoo model)
    cover: Callable[[dict], list[dict]] | None = field(default=None, repr=False)

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip().splitlines()[0]

    def drawing(self, **strategies) -> "Property":
        """The same property over other strategies, e.g. a narrower case space."""
        return dataclasses.replace(self, strategies={**self.strategies, **strategies})

    def run(self, pool, impl: str, profile: Profile, stats: Stats | None = None) -> Stats:
        """Run under ``profile`` on ``pool``; raise what hypothesis raises, after shrinking.

        ``impl`` names the implementation under test (see tpdp_verify.impl); ``stats``,
        if given, is filled in as the run goes, so it is there even when the run raises.
        """
        stats = Stats() if stats is None else stats

        @functools.wraps(self.fn)  # hypothesis seeds and names the test from the property
        def run_one(*args, **kwargs):
            stats.examples += 1
            try:
                self.fn(*args, **kwargs)
            except UnsatisfiedAssumption:
                stats.discarded += 1
                raise
            except PoolError as exc:
                raise _PoolBroke(exc) from exc
            except BaseException:
                stats.failing = {k: v for k, v in kwargs.items() if k in self.strategies}
                stats.failures[type(sys.exc_info()[1]).__name__] = stats.failing
                raise
            stats.passed += 1

        strategies = {k: s(pool.world_size) if callable(s) else s for k, s in self.strategies.items()}
        test = given(**strategies)(run_one)
        for covered in self.cover(strategies) if self.cover else ():
            test = example(**covered)(test)
        test = profile.settings(test)
        try:
            test(pool, impl)
        except _PoolBroke as broke:
            raise broke.args[0] from None
        except BaseExceptionGroup as group:  # distinct failures, one of them a hang or crash
            broke = next((e for e in group.exceptions if isinstance(e, _PoolBroke)), None)
            if broke is not None:
                raise broke.args[0] from None
            raise
        if stats.passed == 0:
            raise AssertionError(
                f"property {self.name} ran no passing example ({stats}); its strategy "
                "never produced a case it could check"
            )
        return stats

    def replay_code(self, world_size: int, impl: str, drawn: dict) -> str:
        """A script that runs this property once on ``drawn``, outside hypothesis."""
        args = "".join(f", {k}={v!r}" for k, v in drawn.items())
        imports = "".join(f"from {t.__module__} import {t.__qualname__}\n"
                          for t in sorted(_case_types(drawn), key=lambda t: t.__qualname__))
        return (
            "import torch\n"
            "from torch.distributed.tensor import Replicate, Shard\n"
            "from tpdp_verify.pool import RankPool\n"
            f"{imports}from {self.fn.__module__} import {self.name}\n\n"
            'if __name__ == "__main__":  # ranks are spawned: they re-import this file\n'
            f"    with RankPool({world_size}) as pool:\n"
            f"        {self.name}.fn(pool, {impl!r}{args})\n"
        )


def _case_types(value) -> set[type]:
    """The project's dataclasses a drawn value is made of, nested ones included."""
    if dataclasses.is_dataclass(value):
        fields = (getattr(value, f.name) for f in dataclasses.fields(value))
        return {type(value)}.union(*map(_case_types, fields))
    if isinstance(value, (tuple, list)):
        return set().union(*map(_case_types, value))
    if isinstance(value, dict):
        return set().union(*map(_case_types, value.values()))
    return set()


def tpdp_property(*, min_world_size: int = 1, cover: Callable[[dict], list[dict]] | None = None,
                  **strategies) -> Callable[[Callable], Property]:
    """Declare ``fn(pool, impl, **drawn)`` a property with strategies for ``drawn``.

    A strategy may also be a function of the pool's world size, for cases (mesh shapes)
    that depend on it. ``cover`` gives explicit examples from the strategies (see Property).
    """

    def declare(fn: Callable) -> Property:
        return Property(fn.__name__, fn, strategies, min_world_size, cover)

    return declare
