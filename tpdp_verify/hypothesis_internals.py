"""Every hypothesis internal tpdp-verify reads, in one place, with the releases that have
them (SUPPORTED: pyproject.toml's range; tests/test_hypothesis_internals.py checks each is
there). The rest of tpdp-verify uses hypothesis's public API only.

- whether a test body runs inside hypothesis, and in its final replay (explain a failure
  only where its report reaches a reader);
- the statistics collector (what hypothesis drew and why it stopped);
- the engine's shrinking time limit (the profile's shrinking budget);
- the constant pool drawn from the local modules' source (6.135 on): off, so that a fixed
  draw depends on the case space, the seed and hypothesis's pinned release alone;
- its reporter (the falsifying example's text, kept with the finding);
- its pretty printer's fields helper (a case printed without the user's model).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

SUPPORTED = ">=6.135,<7"  # pprint_fields from 6.120; the constant pool from 6.135


def in_test() -> bool:
    from hypothesis.control import currently_in_test_context

    return currently_in_test_context()


def in_final_replay() -> bool:
    """Outside hypothesis, or in the final replay of the example it reports."""
    from hypothesis.control import current_build_context

    return not in_test() or current_build_context().is_final


@contextlib.contextmanager
def collecting(note: Callable[[dict], None]) -> Iterator[None]:
    """hypothesis's statistics of each test run, handed to ``note``."""
    from hypothesis.statistics import collector

    with collector.with_value(note):
        yield


@contextlib.contextmanager
def shrinking_for(seconds: float) -> Iterator[None]:
    """Bound the time hypothesis spends shrinking one run (its engine's module constant)."""
    from hypothesis.internal.conjecture import engine

    saved, engine.MAX_SHRINKING_SECONDS = engine.MAX_SHRINKING_SECONDS, seconds
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = saved


@contextlib.contextmanager
def without_local_constants() -> Iterator[None]:
    """Draw without the constants hypothesis reads from the source of the local modules
    imported so far (one draw in twenty picks one): with them the fixed draw moves with
    every literal of tpdp-verify's own code, and with whichever modules the process that
    searches (the CLI, pytest, a script) has imported, so a baseline learned from a draw
    no longer meets it. Without them a draw is a function of the case space, the seed and
    hypothesis's pinned version alone."""
    from hypothesis.internal.conjecture import providers

    saved = providers._get_local_constants
    providers._get_local_constants = providers.Constants
    providers.CONSTANTS_CACHE.cache.clear()  # filled from the local constants before
    try:
        yield
    finally:
        providers._get_local_constants = saved
        providers.CONSTANTS_CACHE.cache.clear()


def reporting_to(report: Callable[[str], None]):
    """hypothesis's reporter (what it prints of a falsifying example) set to ``report``."""
    from hypothesis.reporting import with_reporter

    return with_reporter(report)


def pprint_fields(obj, p, cycle: bool, fields: list[str]) -> None:
    from hypothesis.vendor.pretty import pprint_fields as fields_of

    fields_of(obj, p, cycle, fields)


def missing() -> list[str]:
    """The internals above the installed hypothesis lacks: [] within SUPPORTED."""
    import importlib

    wanted = {"hypothesis.control": ("currently_in_test_context", "current_build_context"),
              "hypothesis.statistics": ("collector",),
              "hypothesis.internal.conjecture.engine": ("MAX_SHRINKING_SECONDS",),
              "hypothesis.internal.conjecture.providers": ("_get_local_constants", "Constants", "CONSTANTS_CACHE"),
              "hypothesis.reporting": ("with_reporter",),
              "hypothesis.vendor.pretty": ("pprint_fields",)}
    out = []
    for module, names in wanted.items():
        try:
            found = importlib.import_module(module)
        except ImportError:
            out.append(module)
            continue
        out += [f"{module}.{n}" for n in names if not hasattr(found, n)]
    return out
