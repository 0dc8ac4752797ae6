"""What a rank observed, in one shape for every property.

Every function the properties send to the ranks returns an ``Observation``: the checks the
rank could make by itself (a structural property compares the transform's output with its
own input), and what it raised, if it raised. A training run's ``Trace``
(tpdp_verify.ranks.loop) and a checkpoint's ``Seen`` (tpdp_verify.ranks.checkpoint) add the
values the rank holds, for the parent to put together. The parent judges the ranks'
observations into one ``Verdict`` (tpdp_verify.judging.verdict).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple


class Check(NamedTuple):
    """One comparison, made on a rank or by the parent.

    ``name`` says what is checked and is the check's identifier in signatures and
    baselines; ``detail`` says what was seen, for readers. ``part`` overrides the
    signature part, for a check that failed by an exception (its type and frame).
    ``ranks``: the ranks it failed on, once the parent has merged the ranks' checks.
    ``where``: for an exception, the innermost frame that raised it: never a part (it moves
    when torch refactors), but ranks that raised in different places stay apart in reports.
    """

    name: str
    ok: bool
    detail: str = ""
    part: str = ""
    ranks: tuple[int, ...] = ()
    where: str = ""


@dataclass
class Observation:
    """What one rank saw."""

    checks: list[Check] = field(default_factory=list)  # made on the rank
    error: str = ""  # "<stage>: <exception>", if the rank raised
    raised: str = ""  # its signature part: type and frame (tpdp_verify.signature)


def observing(checks: Callable[..., list[Check]]) -> Callable[..., Observation]:
    """A rank function that makes only checks, returning them as its Observation."""

    @functools.wraps(checks)
    def observe(*args, **kwargs) -> Observation:
        return Observation(checks(*args, **kwargs))

    return observe
