"""What a finding, a search, a plan run and a whole run are: the one place each status's
label, whether it blocks, whether it is a verdict at all, its exit code and its sentence are
decided. The gate, merge, the pytest items, the plan, JSON, JUnit and Markdown read them.

Two types, for two levels:

- ``Found``: a finding against the baseline release (tpdp_verify.runner.baseline):
  ``found`` (no baseline: it blocks), ``NEW``, ``CHANGED`` (block), ``FIXED``, ``known``
  (do not), ``not asked`` (no verdict on it);
- ``Status``: a search's, a plan run's and a run's, from what it found: ``pass``,
  ``known`` (only known failures), ``not asked`` (failures the baseline could not be
  asked about), ``diverges`` (one blocks), ``infra`` (the harness failed), ``interrupted``
  (a signal stopped it). A run's is its worst search's.

Both are ``str`` enums: their values are what the JSON records hold (docs/cli.md), so a
record read back compares equal to them.
"""

from __future__ import annotations

import enum
from typing import Iterable, NamedTuple

from tpdp_verify.errors import EXIT_DIVERGENCE, EXIT_INFRA, EXIT_NOT_ASKED, EXIT_OK


class _Word(str, enum.Enum):
    """A status as its record spells it: compares, prints and formats as its value (what
    enum.StrEnum does, from Python 3.11; tpdp-verify runs on 3.10)."""

    __str__ = str.__str__
    __format__ = str.__format__


class Found(_Word):
    """A finding's status against the baseline release."""

    FOUND = "found"  # no baseline to ask: every failure blocks
    NEW = "NEW"  # the release passes the case, or shows less
    CHANGED = "CHANGED"  # the release fails the case otherwise
    FIXED = "FIXED"  # a case the release fails passes now
    KNOWN = "known"  # the release shows every part of it on the case
    NOT_ASKED = "not asked"  # no memo holds the case and no environment of the release ran it

    @property
    def blocks(self) -> bool:
        return _FOUND[self].blocks

    @property
    def goes_on(self) -> bool:
        """Counted, and the search draws on: hypothesis is told of the blocking ones only."""
        return _FOUND[self].goes_on


class Status(_Word):
    """A search's, a plan run's or a whole run's status; in order, each worse than the last."""

    PASS = "pass"
    KNOWN = "known"
    NOT_ASKED = "not asked"
    DIVERGES = "diverges"
    INFRA = "infra"
    INTERRUPTED = "interrupted"

    @property
    def label(self) -> str:
        """As a table or a progress line says it."""
        return self.value.upper()

    @property
    def key(self) -> str:
        """Its key in a record's ``counts``."""
        return self.value.replace(" ", "_")

    @property
    def blocks(self) -> bool:
        return _STATUS[self].blocks

    @property
    def judged(self) -> bool:
        """Whether it is a verdict at all: infra, interrupted and not asked leave none."""
        return _STATUS[self].judged

    @property
    def exit_code(self) -> int:
        """The exit code of a run whose worst is this. An interrupted run exits with its
        signal's code (tpdp_verify.interrupts); alone, it is a run without a verdict."""
        return _STATUS[self].exit_code

    @property
    def green(self) -> bool:
        """Whether CI reads it as a pass: exit 0, no JUnit failure or error, a passing pytest item."""
        return self.exit_code == EXIT_OK

    @property
    def junit(self) -> str | None:
        """The JUnit element a test case of this status holds: failure, error, or none."""
        return None if self.green else "failure" if self.blocks else "error"

    @property
    def sentence(self) -> str:
        return _STATUS[self].sentence


class _FoundRule(NamedTuple):
    blocks: bool
    goes_on: bool


class _Rule(NamedTuple):
    blocks: bool
    judged: bool
    exit_code: int
    sentence: str


# What each status means: a row each, the one place it is decided.
_FOUND = {
    Found.FOUND: _FoundRule(blocks=True, goes_on=False),
    Found.NEW: _FoundRule(blocks=True, goes_on=False),
    Found.CHANGED: _FoundRule(blocks=True, goes_on=False),
    Found.FIXED: _FoundRule(blocks=False, goes_on=False),
    Found.KNOWN: _FoundRule(blocks=False, goes_on=True),
    Found.NOT_ASKED: _FoundRule(blocks=False, goes_on=True),
}
_STATUS = {
    Status.PASS: _Rule(False, True, EXIT_OK, "passes"),
    Status.KNOWN: _Rule(False, True, EXIT_OK,
                        "passes: every failure is one the baseline release shows alike on the same case"),
    Status.NOT_ASKED: _Rule(False, False, EXIT_NOT_ASKED,
                            "no verdict: failures the baseline release could not be asked about"),
    Status.DIVERGES: _Rule(True, True, EXIT_DIVERGENCE, "blocks: a divergence"),
    Status.INFRA: _Rule(False, False, EXIT_INFRA, "no verdict: the harness failed"),
    Status.INTERRUPTED: _Rule(False, False, EXIT_INFRA, "no verdict: interrupted"),
}
_ORDER = list(Status)


def worst(verdicts: Iterable[Status | str]) -> Status:
    """A run's verdict: its worst search's (PASS where it made none)."""
    return max((Status(v) for v in verdicts), key=_ORDER.index, default=Status.PASS)


def of_findings(found: Iterable[Found | str]) -> Status:
    """A judged search's verdict from its findings' statuses."""
    found = [Found(f) for f in found]
    if any(f.blocks for f in found):
        return Status.DIVERGES
    if Found.NOT_ASKED in found:
        return Status.NOT_ASKED
    return Status.KNOWN if Found.KNOWN in found else Status.PASS


def of_counts(counts: dict, error: str = "") -> Status:
    """A run's verdict from its record's ``counts`` (a search a key) and its ``error`` (the
    run stopped before its end: no verdict on what it left)."""
    return worst([v for v in Status if counts.get(v.key)] + [Status.INFRA] * bool(error))


def count(verdicts: Iterable[Status | str]) -> dict:
    """A record's ``counts``: how many searches of each verdict, every key present."""
    verdicts = [Status(v) for v in verdicts]
    return {v.key: verdicts.count(v) for v in Status}


def counted(counts: dict) -> str:
    """A record's ``counts`` as the gate, merge and Markdown say them."""
    words = {Status.PASS: "passed", Status.KNOWN: "known only", Status.NOT_ASKED: "not asked",
             Status.DIVERGES: "diverged", Status.INFRA: "infrastructure failures", Status.INTERRUPTED: "interrupted"}
    always = (Status.PASS, Status.KNOWN, Status.DIVERGES, Status.INFRA)
    return ", ".join(f"{counts.get(v.key, 0)} {words[v]}" for v in Status if v in always or counts.get(v.key))


def verdict_line(v: Status, exit_code: int | None = None) -> str:
    """The run's verdict and exit code (a signal's where it was stopped): the last line the
    gate, merge and --jobs print."""
    return f"verdict: {v.sentence} (exit {v.exit_code if exit_code is None else exit_code})"
