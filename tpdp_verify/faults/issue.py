"""``tpdp-verify report``: an issue ready to file upstream, for a catalogued fault or a gate's finding.

For a fault: what is wrong and why it matters, its standalone reproduction, what that shows
under each interpreter given (expected and actual, and so which installed releases show
it), torch's code at fault as the installed torch has it, and the workaround. For a finding
of a gate's ``--json``: the shrunk case, what failed, its replay, and the faults the catalog
names for it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tpdp_verify.errors import UsageError
from tpdp_verify.faults.record import PROJECTS, Fault
from tpdp_verify.status import Found

TIMEOUT = 180.0  # a reproduction's whole run; one that hangs is stopped by its own join timeout first


@dataclass(frozen=True)
class Shown:
    """What a reproduction printed under one interpreter."""

    python: str
    torch: str
    code: int | None  # None: it did not finish in TIMEOUT
    output: str

    @property
    def verdict(self) -> str:
        return {0: "the fault is absent", 1: "the fault is present"}.get(
            self.code, "did not finish" if self.code is None else f"the reproduction failed (exit {self.code})")


def run(f: Fault, python: str, timeout: float = TIMEOUT) -> Shown:
    """The fault's reproduction under ``python``, outside any checkout (it needs torch only)."""
    version = _torch_version(python)
    try:
        done = subprocess.run([python, str(f.repro_path)], capture_output=True, text=True, timeout=timeout,
                              cwd=f.repro_path.parent, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        return Shown(python, version, None, (exc.stdout or "") if isinstance(exc.stdout, str) else "")
    except OSError as exc:
        raise UsageError(f"cannot run {python}: {exc.strerror}; give --python the path of an interpreter") from exc
    return Shown(python, version, done.returncode, done.stdout.strip() or done.stderr.strip()[-2000:])


def _torch_version(python: str) -> str:
    try:
        done = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"cannot run {python}: {exc}; give --python the path of an interpreter with torch") from exc
    if done.returncode:
        raise UsageError(f"{python} cannot import torch; give --python an interpreter with torch installed")
    return done.stdout.strip()


def source(ref: str, marks: tuple[str, ...] = ()) -> str:
    """Where torch's code at ``module:qualname`` is, as this interpreter's torch has it: its
    file and lines, and of its body the lines at fault (those naming one of ``marks``, the
    identifiers the fault's text names), each with its number; the whole function only where
    no line names one."""
    module, _, qualname = ref.partition(":")
    try:
        obj = importlib.import_module(module)
        for name in qualname.split("."):
            obj = getattr(obj, name)
        lines, first = inspect.getsourcelines(inspect.unwrap(obj))
        path = inspect.getsourcefile(obj) or module
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        return f"`{ref}`: not in this torch ({type(exc).__name__}: {exc})"
    shown = Path(path).as_posix()
    shown = shown[shown.rindex("torch/"):] if "torch/" in shown else Path(shown).name
    at = [i for i, line in enumerate(lines) if i and any(re.search(rf"(?<!\w){re.escape(m)}(?!\w)", line)
                                                          for m in marks)]
    keep = sorted({0, *at}) if at else range(len(lines))
    body, last = [], -1
    for i in keep:
        if i > last + 1:
            body.append("    ...")
        body.append(f"{first + i:>5}  {lines[i].rstrip()}")
        last = i
    body += ["    ..."] if at and last < len(lines) - 1 else []
    return "\n".join([f"`{shown}`, lines {first}-{first + len(lines) - 1} (`{qualname}`)"
                      + (", the lines at fault:" if at else ":"), "", "```python", *body, "```"])


def marks(f: Fault) -> tuple[str, ...]:
    """The identifiers a fault's text names in backticks (``requires_grad_()``, ``nn.Parameter(t)``):
    what marks its lines in torch's code."""
    out = []
    for quoted in re.findall(r"`([^`]+)`", f.what):
        name = re.match(r"[A-Za-z_][\w.]*", quoted)
        if name and len(name[0]) > 3 and name[0] not in out:
            out.append(name[0])
    return tuple(out)


def environment(python: str = "") -> str:
    """The environment block maintainers ask for (torch.utils.collect_env) of ``python``
    (this interpreter by default), its local paths left out."""
    try:
        done = subprocess.run([python or sys.executable, "-m", "torch.utils.collect_env"], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        text = done.stdout.strip() or done.stderr.strip()[-1000:]
        text = text.removeprefix("Collecting environment information...")
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = f"(torch.utils.collect_env did not run: {exc})"
    return unlocal(text.strip())


def unlocal(text: str) -> str:
    """``text`` without this machine's paths: the home directory, the interpreters' prefixes,
    the working directory (a draft is filed as it is; where a user keeps things is theirs)."""
    places = {sys.prefix: "<env>", sys.base_prefix: "<python>", os.getcwd(): "<cwd>", str(Path.home()): "~"}
    for place, said in sorted(places.items(), key=lambda p: -len(p[0])):
        if len(place) > 1:
            text = text.replace(place, said)
    return text


def for_fault(f: Fault, pythons: list[str], runs: bool = True) -> str:
    """The issue for a catalogued fault; the reproduction run under each of ``pythons``."""
    import torch

    shown = [run(f, p) for p in pythons] if runs else []
    out = [f"title: [DTensor] {f.title}", f"file at: {PROJECTS[f.project]}", "",
           "### What is wrong, and why it matters", "", f.what.strip(), "", _sentence(f.consequence), "",
           "### Reproduction", "",
           f"Needs only torch; spawns its own gloo ranks on the CPU. Save as `{f.repro}` and run "
           f"`python {f.repro}`: it prints what one device computes and what the ranks computed, and "
           "exits 1 while the fault is present, 0 once it is fixed.", "",
           "```python", f.repro_path.read_text().rstrip(), "```", ""]
    if shown:
        out += ["### Expected and actual", ""]
        for s in shown:
            out += [f"torch {s.torch}: {s.verdict}", "", "```", unlocal(s.output) or "(nothing printed)", "```", ""]
        present = sorted({s.torch for s in shown if s.code == 1})
        absent = sorted({s.torch for s in shown if s.code == 0})
        out += [f"Releases that show it here: {', '.join(present) or 'none of those run'}"
                + (f"; that do not: {', '.join(absent)}" if absent else "") + ".", ""]
    out += [f"### Where (torch {torch.__version__} as installed)", ""]
    for ref in f.source:
        out += [source(ref, marks(f)), ""]
    out += ["### Workaround", "", _sentence(f.workaround), ""]
    out += ["### Environment", "", "```", environment(), "```", ""]
    out += ["### Related", "", f"Upstream: {', '.join(f.upstream)}" if f.upstream else
            "No upstream issue or pull request was found for it.",
            f"Found by tpdp-verify (fault {f.number} of its catalog: `tpdp-verify explain {f.number}`)."]
    return "\n".join(out) + "\n"


def _sentence(text: str) -> str:
    """A record's clause (it follows a bold label in the docs) as text that stands alone."""
    text = text.strip()
    return text[:1].upper() + text[1:]


def findings(record: dict) -> list[tuple[dict, dict]]:
    """A gate ``--json`` record's findings that block (NEW, CHANGED, or any without a baseline),
    each with its property entry."""
    if record.get("command") != "gate" or "properties" not in record:
        raise UsageError("not a gate's --json record; give the file `tpdp-verify gate --json FILE` wrote")
    return [(p, f) for p in record["properties"] for f in p["findings"] if Found(f["status"]).blocks]


def load(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path} is not JSON ({exc.msg}, line {exc.lineno}); give a gate's --json file") from exc


def for_finding(record: dict, which: int) -> str:
    """The issue for the ``which``-th (1-based) blocking finding of a gate's record: its shrunk case first."""
    found = findings(record)
    if not found:
        raise UsageError("the record has no finding that blocks (NEW, CHANGED, or found without a baseline)")
    if not 1 <= which <= len(found):
        raise UsageError(f"--finding {which}: the record has {len(found)} blocking findings (1 to {len(found)})")
    prop, f = found[which - 1]
    faults = f.get("faults") or []
    out = [f"title: [DTensor] {prop['name']}: {f['kind']}", "",
           f"### What is wrong ({f['status']} against {(record.get('baseline') or {}).get('name', 'no baseline')})", "",
           f"tpdp-verify's `{prop['name']}` (world size {prop['world_size']}) fails on torch {record['torch']} "
           f"with implementation `{record['impl']}`: {f['kind']}.", "",
           "The shrunk case:", "", "```", *[f"{k} = {v}" for k, v in f["case"].items()], "```", "",
           "What failed:", "", "```", f["failure"].strip(), "```", ""]
    if faults:
        out += ["The catalog names: " + "; ".join(f"fault {x['number']}, {x['name']} (workaround: {x['workaround']})"
                                                  for x in faults)
                + ". Its standalone reproduction: `tpdp-verify report "
                + f"{faults[0]['number']}`.", ""]
    if f.get("unexplained"):
        out += ["No catalogued fault explains: " + ", ".join(f["unexplained"])
                + ". Shrink the replay below to torch alone before filing it.", ""]
    if f.get("replay"):
        out += ["### Reproduction (tpdp-verify's replay of the shrunk case)", "", "```python", f["replay"].rstrip(),
                "```", ""]
    out += ["### Environment", "", f"torch {record['torch']}, python {record['python']}, backend {record['backend']}, "
            f"tpdp-verify {record['tpdp_verify']}, profile {record['profile']}, seed {record.get('seed')}.", "",
            "```", environment(), "```"]
    return unlocal("\n".join(out)) + "\n"


def interpreters(given: list[str] | None) -> list[str]:
    """This interpreter first, then those given (each once)."""
    out = [sys.executable]
    for p in given or ():
        if p not in out:
            out.append(p)
    return out
