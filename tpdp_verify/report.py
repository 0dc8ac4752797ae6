"""What verify_plan found: one line per check, the first diverging module, the table, a replay.

The verdicts against one device and against plain DP hold every comparison made; a
``Report`` sorts them into the checks a plan's author asks about, counting each, so a
check that compared nothing shows (and fails) instead of passing silently.
"""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass, field

from tpdp_verify import faults
from tpdp_verify.cases import mesh_text
from tpdp_verify.cases.training import DP, TrainCase
from tpdp_verify.judging.verdict import Row, Verdict, on_ranks
from tpdp_verify.signature import describe
from tpdp_verify.status import Status

# The checks of a report, in the order a reader asks about them; those marked True must
# compare something, whatever the model.
CHECKS = {
    "plan keys resolve": True,
    "trains without an exception": True,
    "registry preserved": True,
    "requires_grad preserved": True,
    "DP replicas equal": True,
    "forward output": True,
    "gradients vs one device": True,
    "parameters after each step": True,
    "optimizer state": False,
    "buffers": False,
    "gradients vs plain DDP": True,
    "everything else vs plain DDP": True,
}

_BY_KIND = {"output": "forward output", "loss": "forward output", "gradient": "gradients vs one device",
            "parameter": "parameters after each step", "optimizer state": "optimizer state",
            "buffer": "buffers", "gradient norm": "gradients vs one device", "direct output": "forward output"}


def _section(name: str) -> str:
    """The report check a verdict's structural check belongs to."""
    if "exception" in name or name.startswith("refuses"):
        return "trains without an exception"
    if name.startswith(("replicas agree", "tp ranks of a dp group")):
        return "DP replicas equal"
    if name in ("the same parameters are trainable", "frozen parameters stay unchanged",
                "every rank has the same trainable parameters"):
        return "requires_grad preserved"
    if name.startswith(("parameters stay registered", "every rank has the same registry")):
        return "registry preserved"
    if name == "trainable parameters move as in the oracle":
        return "parameters after each step"
    kind = next((k for k in _BY_KIND if k in name), None)
    if kind == "parameter" or name.startswith("compared at least"):
        return "registry preserved"  # every parameter there, no other, each of its global shape
    return _BY_KIND.get(kind, "trains without an exception")


@dataclass
class Line:
    check: str
    compared: int = 0
    failed: int = 0
    worst: float = 0.0  # the largest error / bound ratio among its values
    detail: str = ""  # the first failure, or what was compared
    skipped: str = ""  # why this check was not run, where it was not

    @property
    def ok(self) -> bool:
        return self.failed == 0 and (self.compared > 0 or not CHECKS[self.check] or bool(self.skipped))

    def add(self, ok: bool, detail: str = "", ratio: float | None = None) -> None:
        self.compared += 1
        if ratio is not None:
            self.worst = max(self.worst, ratio)
        if not ok:
            self.failed += 1
            self.detail = self.detail if self.failed > 1 else detail.splitlines()[0]

    def cell(self, reached: bool) -> tuple[str, str]:
        """Its result and detail columns; ``reached``: whether training got far enough to
        compare anything (a run that raised compares nothing after it)."""
        if self.skipped:
            return "-", f"not compared: {self.skipped}"
        if not self.compared:
            if not reached:
                return "-", "not reached: training raised"
            return ("FAIL", "compared nothing") if CHECKS[self.check] else ("-", self.detail)
        if not self.ok:
            return "FAIL", self.detail
        return "ok", f"{self.worst:.3g} of the bound" if self.worst else self.detail


WIDTH = 100  # a report's lines: a terminal's, a CI log's


def _row(check: str, result: str, detail: str, compared: int, most: int = 2) -> list[str]:
    """A check's row of the table, its detail folded under the detail column: ``most`` lines
    of a failure's (the report below says it whole, once: a list of names is not said three
    times), all of any other's."""
    head = f"  {check:<30}{result:<8}{compared:>9}  "
    rows = textwrap.wrap(detail, WIDTH, initial_indent=head, subsequent_indent=" " * len(head),
                         break_on_hyphens=False) or [head.rstrip()]
    if result == "FAIL" and len(rows) > most:
        last = textwrap.shorten(rows[most - 1].strip(), WIDTH - len(head) - 4, placeholder="")
        rows = rows[:most - 1] + [" " * len(head) + last + " ..."]
    return rows


def _fold(line: str) -> list[str]:
    """A line of prose within WIDTH, its continuation indented two more than it; a line of
    the values' table as it is (its columns must stay aligned)."""
    if len(line) <= WIDTH or line.lstrip().startswith(("value ", "gradient ", "parameter ", "optimizer ", "check ")) \
            or line.startswith(" " * 50):  # a table's columns, or a row folded already
        return [line]
    indent = " " * (len(line) - len(line.lstrip()))
    return textwrap.wrap(line.strip(), WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False) or [line]


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _number(x: float):
    """JSON has no infinity or NaN: a non-finite error or ratio is written as a string."""
    return x if math.isfinite(x) else str(x)


def _row_detail(r: Row) -> str:
    whole = "" if r.err.whole is None else f"; rms rel {r.err.whole[0]:.3g}, bound {r.err.whole[1]:.3g}"
    return f"{r.what} {r.name} at step {r.step}: max abs {r.err.max_abs:.3g}, bound {r.err.bound:.3g}{whole}"


@dataclass
class Report:
    case: TrainCase
    lines: list[Line]
    one_device: Verdict
    plain_ddp: Verdict
    replay: str
    # with a baseline: its name, and per oracle ("one device", "plain DDP") each signature
    # part the run showed to be torch's -> the evidence (tpdp_verify.plan.verify._torch_faults)
    baseline: str = ""
    known: dict = field(default_factory=dict)

    @classmethod
    def of(cls, case: TrainCase, plan_keys: int, one: Verdict, plain: Verdict, replay: str,
           plan_detail: str | None = None, baseline: str = "", known: dict | None = None,
           plain_skipped: str = "") -> Report:
        """``plan_keys``: the plan's keys checked (or the parameters a parallelize function
        sharded, as ``plan_detail`` says); ``plain_skipped``: why no plain-DP run was made."""
        lines = {name: Line(name) for name in CHECKS}
        keys = lines["plan keys resolve"]
        for _ in range(plan_keys):
            keys.add(True)
        keys.detail = plan_detail or f"{plan_keys} keys, each matching a module, each style fitting it"
        for c in one.checks:
            lines[_section(c.name)].add(c.ok, f"{c.name}{on_ranks(c.ranks)}: {c.detail}")
        for r in one.rows:
            lines["registry preserved" if r.what == "parameter" and r.step == 0 else _BY_KIND[r.what]].add(
                r.err.ok, _row_detail(r), r.err.ratio)
        for c in plain.checks:
            lines["everything else vs plain DDP"].add(c.ok, f"{c.name}{on_ranks(c.ranks)}: {c.detail}")
        for r in plain.rows:
            name = "gradients vs plain DDP" if r.what == "gradient" else "everything else vs plain DDP"
            lines[name].add(r.err.ok, _row_detail(r), r.err.ratio)
        for name in ("gradients vs plain DDP", "everything else vs plain DDP"):
            lines[name].skipped = plain_skipped
        if not lines["buffers"].compared:
            del lines["buffers"]  # the model has none: no row for what is not there
        if not lines["optimizer state"].compared:
            lines["optimizer state"].detail = "not compared: " + (
                one.unobserved.removeprefix("optimizer state: ") or "the optimizer keeps no state")
        return cls(case, list(lines.values()), one, plain, replay, baseline, known or {})

    def _parts(self, known: bool) -> list[tuple[str, str]]:
        """(oracle, part) of every failure the baseline knows (or does not)."""
        return [(v.against, p) for v in (self.one_device, self.plain_ddp) for p in v.signature
                if (p in self.known.get(v.against, {})) == known]

    @property
    def status(self) -> Status:
        """pass; known: the run shows every departure to be torch's (and every check compared
        something); else diverges: the plan departs."""
        if all(line.ok for line in self.lines):
            return Status.PASS
        vacuous = any(line.cell(self._reached) == ("FAIL", "compared nothing") for line in self.lines)
        return Status.KNOWN if self.baseline and not vacuous and not self._parts(known=False) else Status.DIVERGES

    @property
    def ok(self) -> bool:
        return self.status.green

    @property
    def first_module(self) -> str | None:
        return self.one_device.first_module

    def _title(self) -> str:
        c = self.case
        dp = next((k for k, v in DP.items() if v == c.entry), c.entry) if c.dp_form == c.entry else c.dp_form
        status = f"PASS but for known torch faults ({self.baseline})" if self.status == Status.KNOWN \
            else self.status.label
        return (f"{c.model} with TP on mesh {mesh_text(c.mesh_shape)}, dp={dp}, {c.steps} step"
                f"{'s' if c.steps > 1 else ''}, {c.dtype}: {status}")

    def _known_lines(self) -> list[str]:
        """With a baseline: the departures the run shows to be torch's, with the evidence, and the plan's."""
        known, new = self._parts(known=True), self._parts(known=False)
        if not self.baseline or not (known or new):
            return []
        out = [""]
        if known:
            out += ["torch's faults, not the plan's: the run shows each to be torch's"]
            out += [f"  {describe(p)} (vs {against}): {self.known[against][p]}" for against, p in known]
            named = self.named()
            out += [f"  {f.label}: workaround: {f.fix} (tpdp-verify explain {f.number})" for f in named.faults]
            out += [f"  no catalogued fault explains {', '.join(named.unexplained)}: news to report "
                    "(tpdp-verify report, docs/known-divergences.md)"] if named.unexplained else []
        if new:
            out += ["the plan's departures (the run does not show them to be torch's): "
                    + ", ".join(f"{describe(p)} (vs {against})" for against, p in new)]
        return out

    def named(self, known: bool = True) -> faults.Explanation:
        """The catalogued faults that explain the departures the run shows to be torch's (or,
        ``known=False``, the others), each against its oracle as the suite's property judges it."""
        found: dict = {}
        unexplained: list[str] = []
        for against, prop in (("one device", "trains_like_one_device"), ("plain DDP", "trains_like_plain_ddp")):
            # a user's model's ties, found on one device, and the weights its TP shards per part
            drawn = {"case": self.case, "ties": bool(self.one_device.tied),
                     "per_part": bool(self.one_device.exercised.get("sharded per part"))}
            e = faults.explain(prop, drawn, [p for a, p in self._parts(known) if a == against])
            found |= {f.number: f for f in e.faults}
            unexplained += [p for p in e.unexplained if p not in unexplained]
        return faults.Explanation(tuple(found[n] for n in sorted(found)), tuple(unexplained))

    def _catalog_lines(self) -> list[str]:
        """Without a baseline, first: the catalogued torch faults whose pattern the departures
        match, and the entry point that avoids them. A match names; it proves nothing, so the
        verdict stands and the baseline is how the run shows a departure to be torch's."""
        if self.baseline or self.status == Status.PASS:
            return []
        e = self.named(known=False)
        if not e.faults:
            return []
        avoid = next((dp for dp in ("fsdp2", "replicate_fsdp", "fsdp1") if dp != self.case.entry
                      and all(DP[dp] not in f.entry_points for f in e.faults)), None)
        return ["", f"{'every departure below matches' if e.explained else 'some departures below match'} "
                "torch's catalogued "
                + "; ".join(f"{f.label} (tpdp-verify explain {f.number})" for f in e.faults)
                + (f". dp='{avoid}' (--dp {avoid}) avoids {'them' if len(e.faults) > 1 else 'it'}" if avoid else "")
                + "; baseline='torch==2.13.0' (--baseline torch==2.13.0) has the run show whether each is torch's"]

    def _exercised_lines(self) -> list[str]:
        """What the run went through, so that a reader knows what a PASS covers."""
        seen = self.one_device.exercised
        if not seen:
            return []  # the ranks did not get as far as wrapping
        ops = seen.get("loss ops")
        loss = ("not under loss_parallel" if ops is None else
                f"under loss_parallel, its sharded ops: {', '.join(ops)}" if ops else
                "under loss_parallel, but none of its sharded ops ran: the loss never met vocab-sharded logits")
        reduced = seen.get("reduced by tp", [])
        tp = (f"{len(reduced)} ({_few(reduced)}): TP sums each rank's partial gradient, or each rank computes "
              "the whole one alike" if reduced else "none, so a PASS says nothing of TP's gradient reductions")
        per_part = seen.get("sharded per part", [])
        return ["", "what this run exercised (a PASS covers these):", f"  loss: {loss}",
                f"  trained parameters replicated over tp: {tp}"] \
            + ([f"  weights sharded per part over tp (fused projections): {len(per_part)} ({_few(per_part)})"]
               if per_part else []) \
            + [f"  mixed precision: {_few(seen.get('precision', [])) or 'none'}"] \
            + [f"  not observed: {said}" for said in seen.get("unobservable", [])]

    @property
    def _reached(self) -> bool:
        """Whether training got far enough to compare anything (a run that raised compares nothing after it)."""
        return next(x for x in self.lines if x.check == "trains without an exception").ok

    def __str__(self) -> str:
        out = [self._title(), *self._catalog_lines(), "",
               f"  {'check':<30}{'result':<8}{'compared':>9}  worst ratio / detail"]
        for line in self.lines:
            out += _row(line.check, *line.cell(self._reached), line.compared)
        # Against one device first; plain DDP's own report only adds news when that passed.
        if self.one_device.unread:
            out += ["", "output leaves not compared: " + "; ".join(self.one_device.unread)]
        if self.one_device.substituted:
            out += ["", "the exact run (one device, float64) substituted: " + "; ".join(self.one_device.substituted)]
        out += self._exercised_lines()
        out += self._known_lines()
        verdict = self.one_device if not self.one_device.ok else self.plain_ddp
        if not verdict.ok:
            out += ["", verdict.report()]
        out = out[:1] + [folded for line in "\n".join(out[1:]).splitlines() for folded in _fold(line)]
        out += ["", f"replay: {self.replay}" if "\n" not in self.replay.strip() else
                "replay (save as a file and run it with python):\n" + self.replay.rstrip()]
        return "\n".join(out)

    def to_dict(self) -> dict:
        c = self.case
        failures = [{"against": v.against, "what": r.what, "step": r.step, "name": r.name,
                     "max_abs": _number(r.err.max_abs), "max_rel": _number(r.err.max_rel),
                     "bound": _number(r.err.bound), "ratio": _number(r.err.ratio),
                     "rms_rel": None if r.err.whole is None else _number(r.err.whole[0]),
                     "rms_bound": None if r.err.whole is None else _number(r.err.whole[1])}
                    for v in (self.one_device, self.plain_ddp)
                    for r in v.rows if not r.err.ok]
        return {
            "ok": self.ok,
            "status": self.status,
            "baseline": self.baseline or None,
            "known": [{"against": a, "part": p, "evidence": self.known[a][p]} for a, p in self._parts(True)],
            **(self.named().to_json() if self.baseline else {"faults": [], "unexplained": []}),
            "new": [{"against": a, "part": p} for a, p in self._parts(False)] if self.baseline else [],
            "case": {"model": c.model, "mesh": list(c.mesh_shape), "dp": c.entry, "steps": c.steps,
                     "accumulate": c.accumulate, "batch": c.global_batch, "dtype": c.dtype, "seed": c.seed},
            # ok: null where nothing was compared: not reached, or nothing there (the detail says why)
            "checks": [{"check": x.check, "ok": {"ok": True, "FAIL": False}.get(x.cell(self._reached)[0]),
                        "compared": x.compared, "failed": x.failed, "worst_ratio": _number(x.worst),
                        "detail": x.cell(self._reached)[1]} for x in self.lines],
            "exercised": self.one_device.exercised,
            "outputs_not_compared": self.one_device.unread,
            "exact_run_substituted": self.one_device.substituted,
            "first_module": self.first_module,
            "plain_ddp": self.one_device.plain_ddp,
            "failures": failures,
            "report": str(self),
            "replay": self.replay,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False)
