"""A suite: the properties the gate runs and the regions of their case space they leave
out, found by the name of the module that declares them.

The library never imports the suite it runs: properties build on the library, as tests
build on pytest. The gate is told the suite's module, ``tpdp_verify.properties`` unless a
user names their own (``tpdp-verify gate --suite MODULE``): a module with ``ALL``, its
properties in the order they run, and optionally ``EXCLUSIONS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from tpdp_verify.errors import UsageError
from tpdp_verify.runner.property import Property

DEFAULT = "tpdp_verify.properties"


@dataclass(frozen=True)
class Exclusion:
    """A region of the case space the properties ``applies_to`` never draw."""

    name: str
    applies_to: tuple[str, ...]  # property names
    reason: str
    doc: str  # "docs/<file>.md#<anchor>"
    test: Callable[[object], bool] = field(repr=False, compare=False)  # true: the drawn case is left out


@dataclass(frozen=True)
class Suite:
    """The properties a gate runs, in order, and the regions of their case space they leave out."""

    properties: tuple[Property, ...]
    exclusions: tuple[Exclusion, ...] = ()

    def summary_lines(self) -> list[str]:
        """One line an exclusion, for the gate's report."""
        return [f"not searched: {x.name} ({', '.join(x.applies_to)}): {x.reason} [{x.doc}]"
                for x in self.exclusions]

    def exclusion_records(self) -> list[dict]:
        """The exclusions as plain data (JSON reports)."""
        return [{"name": x.name, "properties": list(x.applies_to), "reason": x.reason, "doc": x.doc}
                for x in self.exclusions]


def load(module: str = DEFAULT) -> Suite:
    """The suite a module declares."""
    try:
        found = importlib.import_module(module)
    except Exception as exc:  # the user's module: what is wrong with it is one line, not a traceback
        if isinstance(exc, ModuleNotFoundError) and exc.name and module.startswith(exc.name):
            raise UsageError(f"no suite module {module!r}: give a module with ALL, a tuple of properties") from None
        raise UsageError(f"suite module {module!r} does not import: {type(exc).__name__}: {exc}") from None
    properties = getattr(found, "ALL", None)
    if not properties or not all(isinstance(p, Property) for p in properties):
        raise UsageError(f"{module} has no ALL, a tuple of tpdp_verify properties (@tpdp_property)")
    return Suite(tuple(properties), tuple(getattr(found, "EXCLUSIONS", ())))
