"""Known divergences: a gate run judged against a recorded baseline.

A baseline (JSON) lists the divergences a torch build is known to have. Each entry gives
the property, the world size, the signature of the failure (tpdp_verify.signature: every
check that failed, the kind of value that departed first, an exception's type and frame,
a crash's signal) and the shrunk case that shows it.

With a baseline, each property's search counts an example whose every failure part the
baseline records for that property in the example's region (its DP entry point, model and
mesh kind: tpdp_verify.runner.property.region) as **known**, and goes on drawing; a failure
with a part the baseline does not record there is **NEW**, shrunk and replayed. Each
recorded case the search did not meet again is judged so:

- if every part of its signature shows in the run's failures of that property, world size
  and region (in other combinations), it is **known** without a rerun;
- if it fails the same way (or only in other known ways), it is **known**;
- if it fails with a part the baseline does not record, it **CHANGED**;
- if it passes, it is **FIXED**.

New and changed divergences block a release (exit 1); known and fixed ones do not.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tpdp_verify import signature
from tpdp_verify.errors import UsageError
from tpdp_verify.files import write_whole

SCHEMA = 2
SHIPPED = Path(__file__).parent.parent / "baselines"  # baselines the project ships, by name


@dataclass(frozen=True)
class Known:
    """A divergence a baseline lists."""

    property: str
    world_size: int
    signature: signature.Signature
    case: dict = field(hash=False)  # argument name -> repr of the shrunk value
    types: tuple = field(default=(), hash=False)  # "module:qualname" of the classes in the case
    summary: str = field(default="", hash=False)  # the failure's first line, for readers

    @property
    def key(self) -> tuple[str, int, str, signature.Signature]:
        return self.property, self.world_size, self.region, self.signature

    @functools.cached_property
    def region(self) -> str:
        """Where its case lies (tpdp_verify.runner.property.region): its parts are known there."""
        from tpdp_verify.runner.property import region

        return region(self.drawn())

    @property
    def kind(self) -> str:
        """The signature as a reader says it."""
        return " + ".join(signature.describe(p) for p in self.signature)

    def drawn(self) -> dict:
        """The recorded case, rebuilt from its repr (as the replay script does)."""
        import torch
        from torch.distributed.tensor import Partial, Replicate, Shard

        names = {"torch": torch, "Replicate": Replicate, "Shard": Shard, "Partial": Partial}
        for path in self.types:
            module, _, qualname = path.partition(":")
            try:
                names[qualname.split(".")[0]] = getattr(importlib.import_module(module), qualname.split(".")[0])
            except (ImportError, AttributeError):
                raise UsageError(f"the baseline's {self.property} entry names the case type {path}, which "
                                 "this tpdp-verify does not have; regenerate the baseline with "
                                 "--update-baseline") from None
        return {k: eval(v, names) for k, v in self.case.items()}  # noqa: S307: the baseline's own reprs

    def to_json(self) -> dict:
        return {"property": self.property, "world_size": self.world_size, "signature": list(self.signature),
                "case": self.case, "types": list(self.types), "summary": self.summary}


def known_parts(entries: list[Known]) -> dict[str, set[str]]:
    """Property -> every signature part its entries record (at any world size, in any region)."""
    parts: dict[str, set[str]] = {}
    for k in entries:
        parts.setdefault(k.property, set()).update(k.signature)
    return parts


def regional_parts(entries: list[Known]) -> dict[str, dict[str, set[str]]]:
    """Property -> region -> every signature part its entries record there (at any world
    size): what a case of that region may show and be known."""
    parts: dict[str, dict[str, set[str]]] = {}
    for k in entries:
        parts.setdefault(k.property, {}).setdefault(k.region, set()).update(k.signature)
    return parts


DOC = "docs/known-divergences.md"  # where the shipped baselines' entries are explained, one heading each


def heading(k: Known) -> str:
    """The entry's heading in DOC (``markdown`` writes it)."""
    return f"`{k.property}` (world size {k.world_size}{', ' + k.region if k.region else ''}): {k.kind}"


def slug(text: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return "".join(c for c in text.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def anchor(k: Known) -> str:
    """A link to the entry's heading in DOC."""
    return f"{DOC}#{slug(heading(k))}"


def training_parts(entries: list[Known], properties: tuple[str, ...], dp_entry: str,
                   mesh: tuple[int, ...] | None = None) -> dict[str, Known]:
    """Each signature part the entries of ``properties`` record for cases through one DP entry
    point in one form (TrainCase.dp_form: "fsdp1(HYBRID_SHARD)", "fully_shard(dp_mesh_dims=shard)")
    (on a mesh of the same kind as ``mesh``, if given), with the first entry that
    records it: what a user's training run through that entry point may show of the build's
    known faults, and where each is explained. Scoped as a region is (the user's model is
    none of the zoo's): a fault of another entry point or mesh kind would otherwise hide a
    departure of the user's."""
    from tpdp_verify.cases import mesh_kind

    parts: dict[str, Known] = {}
    for k in sorted(entries, key=lambda k: (len(k.signature), k.world_size)):  # the plainest entry explains
        case = k.drawn().get("case")
        if k.property in properties and getattr(case, "dp_form", None) == dp_entry and \
                (mesh is None or mesh_kind(case.mesh_shape) == mesh_kind(mesh)):
            for p in k.signature:
                parts.setdefault(p, k)
    return parts


def entry(prop: str, world_size: int, sig: signature.Signature, drawn: dict, summary: str) -> Known:
    from tpdp_verify.runner.property import case_types

    types = tuple(sorted(f"{t.__module__}:{t.__qualname__}" for t in case_types(drawn)))
    return Known(prop, world_size, sig, {k: repr(v) for k, v in drawn.items()}, types, summary.splitlines()[0][:200])


def entries(outcomes) -> list[Known]:
    """Every divergence a run found (raised or known), as baseline entries."""
    return [entry(o.property, o.world_size, f.signature, f.drawn, f.failure)
            for o in outcomes for f in o.findings if f.drawn is not None and f.signature and f.status != "FIXED"]


def write(path: str, outcomes, profile: str, impl: str, keep: list[Known] = ()) -> int:
    """Write a baseline of the run's divergences and ``keep`` (recorded entries this run
    did not reach: a world size or property it left out); the number of entries."""
    import torch

    known = list({k.key: k for k in [*keep, *entries(outcomes)]}.values())
    doc = {"schema": SCHEMA, "torch": torch.__version__, "profile": _profiles(path, profile, torch.__version__),
           "impl": impl, "known": [k.to_json() for k in known]}
    try:  # whole or not at all: a kill while it writes leaves the previous baseline
        write_whole(path, json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write the baseline {path}: {exc.strerror or exc}") from None
    return len(known)


def _profiles(path: str, profile: str, version: str) -> str:
    """The profiles a baseline was learned with: ``profile``, after those of the file it
    adds to (the same torch; ``recorded``), e.g. "ci, smoke"."""
    try:
        previous = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        previous = {}
    learned = previous.get("profile", "") if isinstance(previous, dict) and previous.get("torch") == version else ""
    return ", ".join(dict.fromkeys([*filter(None, str(learned).split(", ")), profile]))


def resolve(name: str) -> Path:
    """A path, or the name of a shipped baseline (``torch-2.13.0``)."""
    path = Path(name)
    if not path.exists() and (SHIPPED / f"{name}.json").exists():
        return SHIPPED / f"{name}.json"
    return path


def load(name: str) -> tuple[dict, list[Known]]:
    path = resolve(name)
    shipped = ", ".join(p.stem for p in sorted(SHIPPED.glob("*.json")))
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"no baseline {name}: give a file written by --update-baseline, or one "
                         f"shipped ({shipped})") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the baseline {path}: {exc}") from None
    if isinstance(doc, dict) and isinstance(doc.get("schema"), int) and doc["schema"] < SCHEMA:
        raise UsageError(f"{path} is a baseline of schema {doc['schema']}, which keyed a divergence on its "
                         f"first failed check; regenerate it: tpdp-verify gate --profile "
                         f"{str(doc.get('profile', 'ci')).split(', ')[0]} --baseline {path} --update-baseline")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("known"), list):
        raise UsageError(f"{path} is not a tpdp-verify baseline (schema {SCHEMA}); write one with "
                         "--update-baseline")
    try:
        return doc, [Known(k["property"], k["world_size"], signature.of(k["signature"]), k["case"],
                           tuple(k.get("types", ())), k.get("summary", "")) for k in doc["known"]]
    except (KeyError, TypeError) as exc:
        raise UsageError(f"{path}: an entry lacks {exc}; rewrite it with --update-baseline") from None


def recorded(name: str) -> tuple[dict, list[Known]] | None:
    """The baseline ``--update-baseline`` adds to: the file's entries if it is one of this
    schema, else None (nothing to keep: it is written afresh). A search meets only the
    faults its draw reaches, and another draw (a new seed, a moved strategy) reaches
    others: writing only this run's would drop faults the build still has."""
    try:
        return load(name)
    except UsageError:
        return None


@dataclass
class Judgement:
    known: list[Known] = field(default_factory=list)
    new: list[Known] = field(default_factory=list)
    changed: list[tuple[Known, str]] = field(default_factory=list)  # and what it does now
    fixed: list[Known] = field(default_factory=list)
    not_run: list[Known] = field(default_factory=list)  # a world size or property this run left out
    not_rerun: list[Known] = field(default_factory=list)  # not met, and the rerun budget was spent

    @property
    def blocks(self) -> bool:
        return bool(self.new or self.changed)


def judge(outcomes, baseline: list[Known], rerun: Callable[[Known], signature.Signature],
          rerun_seconds: float = math.inf, hang_seconds: float = 0.0) -> Judgement:
    """Sort a run's findings by the baseline, and give each its status. A finding the
    search raised is NEW; one it counted as known is known. ``rerun(entry)`` runs a listed
    case that the run did not meet again and returns its signature (() if it passes); once
    the reruns have taken ``rerun_seconds``, the entries left are listed as not rerun (a
    baseline of many regions holds more cases than a short run can afford to rerun); a
    recorded hang, whose rerun waits out the ranks' timeout, only while ``hang_seconds``
    (that timeout) is left."""
    from tpdp_verify.runner.property import region

    parts, start = regional_parts(baseline), time.monotonic()

    def knows(prop: str, where: str, sig) -> bool:
        return signature.known(sig, parts.get(prop, {}).get(where, set()))

    shown = [(o.property, o.world_size, region(f.drawn), set(f.signature)) for o in outcomes for f in o.findings]
    ran = {(o.property, o.world_size): o for o in outcomes}
    out = Judgement()
    for o in outcomes:
        for i, f in enumerate(o.findings):
            if f.signature and knows(o.property, region(f.drawn), f.signature):
                o.findings[i] = f._replace(status="known")
            elif f.drawn is not None:
                o.findings[i] = f._replace(status="NEW")
                out.new.append(entry(o.property, o.world_size, f.signature, f.drawn, f.failure))
    for listed in baseline:  # met when a failure of the run in its region shows all of it (and maybe more)
        where = (listed.property, listed.world_size, listed.region)
        if any((p, w, r) == where and s >= set(listed.signature) for p, w, r, s in shown):
            out.known.append(listed)
            continue
        # every part shown by this run's failures of the property in its region, if in other
        # combinations: each fault is still there, and a rerun would only cost a pool call
        seen = set().union(*(s for p, w, r, s in shown if (p, w, r) == where))
        if seen >= set(listed.signature):
            out.known.append(listed)
            continue
        outcome = ran.get((listed.property, listed.world_size))
        if outcome is None:
            out.not_run.append(listed)
            continue
        left = rerun_seconds - (time.monotonic() - start)
        if left < 0 or (signature.HANG in listed.signature and hang_seconds > left):
            out.not_rerun.append(listed)  # a hang's rerun takes the timeout: only where the budget holds it
            continue
        now = rerun(listed)
        if not now:
            out.fixed.append(listed)
            status = "FIXED"
        elif knows(listed.property, listed.region, now):
            out.known.append(listed)
            status = "known"
        else:
            out.changed.append((listed, "now " + " + ".join(signature.describe(p) for p in now)))
            status = "CHANGED"
        outcome.findings.append(rerun_finding(listed, now, status))
    for o in outcomes:
        o.judged()
    return out


def rerun_finding(listed: Known, now: signature.Signature, status: str):
    from tpdp_verify.runner.gate import Finding

    text = f"{listed.summary}\n(its recorded case, run again: " + (
        "passes)" if not now else " + ".join(signature.describe(p) for p in now) + ")")
    return Finding(text, "", listed.kind, listed.drawn(), now or listed.signature, status)


def judgement_report(j: Judgement, header: dict, name: str, updating: bool = False, title: str = "") -> str:
    width = max([len(k.property) for k in j.known + j.new + j.fixed + j.not_run + [c for c, _ in j.changed]]
                + [8])

    def line(label: str, k: Known, extra: str = "") -> str:
        where = f" ({k.region})" if k.region else ""
        return f"  {label:<8} {k.property:<{width}} world {k.world_size}{where}  {k.kind}{extra}"

    out = [title or f"baseline {name}: recorded on torch {header.get('torch')} with profile {header.get('profile')}"]
    out += [line("NEW", k, f": {k.summary}") for k in j.new]
    out += [line("CHANGED", k, f": {now}") for k, now in j.changed]
    out += [line("FIXED", k, ": its recorded case passes now") for k in j.fixed]
    out += [line("known", k) for k in j.known]
    out += [line("not run", k, " (not in this run)") for k in j.not_run]
    if j.not_rerun:  # one line, not one each: a short run of a wide baseline leaves hundreds
        out.append(f"  not rerun: {len(j.not_rerun)} entries this run did not meet (the profile's rerun budget "
                   "was spent): whether they still fail, or changed, was not asked")
    out.append(f"against the baseline: {len(j.new)} new, {len(j.changed)} changed, {len(j.fixed)} fixed, "
               f"{len(j.known)} known" + (f", {len(j.not_rerun)} not rerun" if j.not_rerun else "")
               + (": recorded" if updating else ": blocks" if j.blocks else ": passes"))
    return "\n".join(out)


def markdown(name: str, properties, impl: str = "torch") -> str:
    """Every entry of a baseline with a script that replays it: the generated half of
    docs/known-divergences.md (``python -m tpdp_verify.runner.baseline NAME``)."""
    header, known = load(name)
    by_name = {p.name: p for p in properties}
    profiles = str(header["profile"]).split(", ")
    out = [f"Recorded on torch {header['torch']} with the {' and '.join(f'`{p}`' for p in profiles)} "
           f"profile{'s' * (len(profiles) > 1)}: {len(known)} entries."]
    for k in known:
        out += ["", f"### {heading(k)}", "",
                "Signature: " + ", ".join(f"`{p}`" for p in k.signature), "", k.summary, "",
                "```python", by_name[k.property].replay_code(k.world_size, impl, k.drawn()).rstrip(), "```"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    from tpdp_verify.runner import suite

    print(markdown(sys.argv[1] if len(sys.argv) > 1 else "torch-2.13.0", suite.load().properties), end="")
