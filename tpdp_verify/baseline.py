"""Known divergences: a gate run judged against a recorded baseline.

A baseline (JSON) lists the divergences a torch build is known to have. Each entry gives
the property, the world size, the kind (the exception type the property raised, which
names the check that departs) and the shrunk case that shows it. With a baseline, the
gate sorts what it finds:

- **known**: the baseline lists it (same property, world size and kind);
- **new**: the baseline does not list it.

For each listed divergence the run did not find, the gate runs the recorded case again:

- if it still fails the same way, it is **known** (another failure shrank ahead of it);
- if it fails in another way, it **changed**;
- if it passes, it is **fixed**.

New and changed divergences block a release (exit 1); known and fixed ones do not.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from tpdp_verify.errors import UsageError

SCHEMA = 1
SHIPPED = Path(__file__).parent / "baselines"  # baselines the project ships, by name


@dataclass(frozen=True)
class Known:
    """A divergence a baseline lists."""

    property: str
    world_size: int
    kind: str
    case: dict = field(hash=False)  # argument name -> repr of the shrunk value
    types: tuple = field(default=(), hash=False)  # "module:qualname" of the classes in the case
    summary: str = field(default="", hash=False)  # the failure's first line, for readers

    @property
    def key(self) -> tuple[str, int, str]:
        return self.property, self.world_size, self.kind

    def drawn(self) -> dict:
        """The recorded case, rebuilt from its repr (as the replay script does)."""
        import torch
        from torch.distributed.tensor import Partial, Replicate, Shard

        names = {"torch": torch, "Replicate": Replicate, "Shard": Shard, "Partial": Partial}
        for path in self.types:
            module, _, qualname = path.partition(":")
            names[qualname.split(".")[0]] = getattr(importlib.import_module(module), qualname.split(".")[0])
        return {k: eval(v, names) for k, v in self.case.items()}  # noqa: S307: the baseline's own reprs


def _types(drawn: dict) -> tuple[str, ...]:
    from tpdp_verify.suite import _case_types

    return tuple(sorted(f"{t.__module__}:{t.__qualname__}" for t in _case_types(drawn)))


def entries(outcomes) -> list[Known]:
    """Every divergence a run found, as baseline entries."""
    return [Known(o.property, o.world_size, f.kind, {k: repr(v) for k, v in f.drawn.items()},
                  _types(f.drawn), f.failure.splitlines()[0][:200])
            for o in outcomes if o.status == "diverges" for f in o.findings if f.drawn is not None]


def write(path: str, outcomes, profile: str, impl: str) -> int:
    import torch

    known = entries(outcomes)
    doc = {"schema": SCHEMA, "torch": torch.__version__, "profile": profile, "impl": impl,
           "known": [asdict(k) | {"types": list(k.types)} for k in known]}
    try:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write the baseline {path}: {exc.strerror or exc}") from None
    return len(known)


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
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("known"), list):
        raise UsageError(f"{path} is not a tpdp-verify baseline (schema {SCHEMA}); write one with "
                         "--update-baseline")
    try:
        return doc, [Known(k["property"], k["world_size"], k["kind"], k["case"], tuple(k.get("types", ())),
                           k.get("summary", "")) for k in doc["known"]]
    except (KeyError, TypeError) as exc:
        raise UsageError(f"{path}: an entry lacks {exc}; rewrite it with --update-baseline") from None


@dataclass
class Judgement:
    known: list[Known] = field(default_factory=list)
    new: list[Known] = field(default_factory=list)
    changed: list[tuple[Known, str]] = field(default_factory=list)  # and what it does now
    fixed: list[Known] = field(default_factory=list)
    not_run: list[Known] = field(default_factory=list)  # a world size or property this run left out

    @property
    def blocks(self) -> bool:
        return bool(self.new or self.changed)


def judge(outcomes, baseline: list[Known], rerun: Callable[[Known], str]) -> Judgement:
    """Sort a run's divergences by the baseline. ``rerun(entry)`` runs a listed case that
    the run did not find and returns the kind it now raises ("" if it passes)."""
    found = {k.key: k for k in entries(outcomes)}
    ran = {(o.property, o.world_size) for o in outcomes}
    out = Judgement(new=[k for key, k in found.items() if key not in {b.key for b in baseline}])
    for entry in baseline:
        if entry.key in found:
            out.known.append(entry)
        elif (entry.property, entry.world_size) not in ran:
            out.not_run.append(entry)
        else:
            now = rerun(entry)
            if now == entry.kind:
                out.known.append(entry)
            elif now:
                out.changed.append((entry, f"now raises {now}"))
            else:
                out.fixed.append(entry)
    return out


def report(j: Judgement, header: dict, name: str) -> str:
    width = max([len(k.property) for k in j.known + j.new + j.fixed + j.not_run + [c for c, _ in j.changed]]
                + [8])

    def line(label: str, k: Known, extra: str = "") -> str:
        return f"  {label:<8} {k.property:<{width}} world {k.world_size}  {k.kind}{extra}"

    out = [f"baseline {name}: recorded on torch {header.get('torch')} with profile {header.get('profile')}"]
    out += [line("NEW", k, f": {k.summary}") for k in j.new]
    out += [line("CHANGED", k, f": {now}") for k, now in j.changed]
    out += [line("FIXED", k, ": its recorded case passes now") for k in j.fixed]
    out += [line("known", k) for k in j.known]
    out += [line("not run", k, " (not in this run)") for k in j.not_run]
    out.append(f"against the baseline: {len(j.new)} new, {len(j.changed)} changed, {len(j.fixed)} fixed, "
               f"{len(j.known)} known" + (": blocks" if j.blocks else ": passes"))
    return "\n".join(out)


def markdown(name: str, impl: str = "torch") -> str:
    """Every entry of a baseline with a script that replays it: the generated half of
    docs/known-divergences.md (``python -m tpdp_verify.baseline NAME``)."""
    from tpdp_verify.properties import ALL

    header, known = load(name)
    by_name = {p.name: p for p in ALL}
    out = [f"Recorded on torch {header['torch']} with the `{header['profile']}` profile: "
           f"{len(known)} entries."]
    for k in known:
        out += ["", f"### `{k.property}` (world size {k.world_size}): `{k.kind}`", "", k.summary, "",
                "```python", by_name[k.property].replay_code(k.world_size, impl, k.drawn()).rstrip(), "```"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    print(markdown(sys.argv[1] if len(sys.argv) > 1 else "torch-2.13.0"), end="")
