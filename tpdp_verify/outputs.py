"""What the commands write for CI and for people: JSON records, JUnit XML, Markdown.

A run becomes one record, a dict whose keys docs/cli.md documents; the JSON file is the
record itself and the JUnit and Markdown files are views of it, so the three agree.
Output paths are checked before the run: a typo in a path must not cost a long run.
Each file is written whole or not at all (tpdp_verify.files): a run killed while it writes
leaves the previous file, never half of a new one that CI would read.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import tempfile
import xml.etree.ElementTree as ET
from importlib import metadata
from typing import Callable

from tpdp_verify import faults
from tpdp_verify import status as statuses
from tpdp_verify.cases import mesh_text
from tpdp_verify.errors import EXIT_USAGE, UsageError
from tpdp_verify.files import write_whole
from tpdp_verify.status import Found, Status

# torch and the gate are imported where used: a bad output path fails before they load

# bumped when a key changes meaning or goes away; new keys keep it. 3: a search whose failures
# the baseline could not be asked about is "not asked" (was "known"); a plan's status is
# lower case, as a search's (tpdp_verify.status)
SCHEMA = 3


# -- files


def check_writable(files: dict[str, str]) -> None:
    """Fail now, in one line, if an output (``{"--json": path}``) cannot be written."""
    seen: dict[str, str] = {}
    for option, path in files.items():
        real = os.path.realpath(path)
        if real in seen:
            raise UsageError(f"{seen[real]} and {option} both name {path}; give each its own file")
        seen[real] = option
        existed = os.path.lexists(path)
        try:
            with open(path, "a", encoding="utf-8"):  # "a": an existing file keeps its text
                pass
            # write_whole makes its temporary file beside the output: the folder must take one
            fd, probe = tempfile.mkstemp(dir=os.path.dirname(real), prefix=".tpdp-verify-", suffix=".tmp")
            os.close(fd)
            os.remove(probe)
        except OSError as exc:
            raise UsageError(_cannot_write(option, path, exc)) from None
        finally:
            if not existed and os.path.lexists(path):
                os.remove(path)


def write(files: dict[str, str], record: dict) -> None:
    """Render ``record`` into each file asked for: ``{"--junit": path}`` gets JUnit XML."""
    for option, path in files.items():
        try:
            write_whole(path, RENDER[option](record))
        except OSError as exc:
            raise UsageError(_cannot_write(option, path, exc)) from None


def _cannot_write(option: str, path: str, exc: OSError) -> str:
    return f"cannot write {option} {path}: {exc.strerror or exc}"


def now() -> str:
    """The time a run started, as ISO 8601 in UTC (JUnit's timestamp, the record's started)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _version() -> str:
    try:
        return metadata.version("tpdp-verify")
    except metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


# -- the gate


def gate_record(outcomes: list, profile, impl: str, backend: str, seconds: float,
                exit_code: int, started: str, error: str = "", baseline: str = "", judged=None,
                excluded: list[dict] = (), seed: int | None = None, interrupted: dict | None = None,
                selection: dict | None = None) -> dict:
    """The gate's run as plain data: the header, the counts and one entry per outcome.

    With a baseline each finding carries its status (NEW, CHANGED, known, FIXED, not asked): the exit
    code, the JUnit failures and the Markdown table all follow from those statuses.
    ``interrupted``: for a run a signal stopped, ``{"signal", "during"}``; the searches it left
    are outcomes of status "interrupted", listed again under its "not_run". ``selection``:
    what ``-k`` and ``--shard`` left (``{"keyword", "shard", "plan", "searches"}``; null for
    the whole suite): what ``merge`` checks the parts against.
    """
    import torch

    from tpdp_verify.runner import coverage
    from tpdp_verify.runner.gate import outcome_report

    record = {
        "schema": SCHEMA,
        "command": "gate",
        "tpdp_verify": _version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "impl": impl,
        "profile": profile.name,
        "max_examples": profile.max_examples,
        "shrink_total": profile.shrink_total if profile.shrink else 0,
        "seed": seed,
        "selection": selection,
        "backend": backend,
        "world_sizes": list(profile.world_sizes),
        "unexercised_keywords": coverage.record(coverage.unexercised()),
        "started": started,
        "seconds": round(seconds, 3),
        "exit_code": exit_code,
        "error": error,
        "interrupted": interrupted and {**interrupted, "not_run": [
            {"name": o.property, "world_size": o.world_size} for o in outcomes if o.status == Status.INTERRUPTED]},
        "baseline": _judgement(baseline, judged),
        "verdict": statuses.worst([o.status for o in outcomes] + [Status.INFRA] * bool(error)
                                  + [Status.INTERRUPTED] * bool(interrupted)),
        "counts": statuses.count(o.status for o in outcomes),
        "not_searched": list(excluded),
        "properties": [
            {
                "name": o.property,
                "world_size": o.world_size,
                "backend": o.backend,
                "status": o.status,
                "drawn": o.stats.drawn,
                "wanted": o.wanted,
                "drew_fewer": o.short,
                "stopped_because": o.stats.stopped_because,
                "covered": o.stats.covered,
                "known_only": o.stats.known,
                "examples": o.stats.examples,
                "passed": o.stats.passed,
                "discarded": o.stats.discarded,
                "seconds": round(o.seconds, 3),
                "unshrunk": o.unshrunk,
                "shrink_seconds": round(o.stats.shrink_seconds, 3),
                "not_asked": o.stats.not_asked,
                "reran": o.stats.reran,
                "not_rerun": o.stats.not_rerun,
                "died_after_other_cases": [{"failure": text, "case": {k: repr(v) for k, v in drawn.items()}}
                                           for text, drawn in o.stats.history],
                "rank_output": o.rank_output or None,
                "message": o.message,
                "findings": [{"status": f.status, "signature": list(f.signature), "kind": f.kind,
                              "failure": f.failure, "replay": f.replay,
                              "case": {k: repr(v) for k, v in (f.drawn or {}).items()},
                              **(f.explanation.to_json() if f.explanation else {"faults": [], "unexplained": []})}
                             for f in o.findings],
                "report": outcome_report(o),
            }
            for o in outcomes
        ],
    }
    return record | {"catalog": faults.tally(record["properties"])}


def _judgement(name: str, judged) -> dict | None:
    if not name or judged is None:
        return None
    return {"name": name, "blocks": judged.blocks, **judged.counts()}


def to_json(record: dict) -> str:
    return json.dumps(record, indent=2, allow_nan=False) + "\n"


# -- a plan's verdict


def plan_record(report, exit_code: int, started: str, seconds: float) -> dict:
    """A ``plan`` run as plain data: the header every record has, then the report's own keys."""
    import torch

    return {"schema": SCHEMA, "command": "plan", "tpdp_verify": _version(), "torch": torch.__version__,
            "python": platform.python_version(), "started": started, "seconds": round(seconds, 3),
            "exit_code": exit_code, "interrupted": None, **report.to_dict()}


def plan_interrupted(case: dict, signal: str, exit_code: int, started: str, seconds: float, baseline: str,
                     replay: str) -> dict:
    """A ``plan`` run a signal stopped before its verdict: the keys a report has, nothing judged
    (the verdict needs every run of the case), ``ok`` false, status interrupted."""
    import torch

    return {"schema": SCHEMA, "command": "plan", "tpdp_verify": _version(), "torch": torch.__version__,
            "python": platform.python_version(), "started": started, "seconds": round(seconds, 3),
            "exit_code": exit_code, "interrupted": {"signal": signal}, "ok": False, "status": Status.INTERRUPTED,
            "baseline": baseline or None, "known": [], "new": [], "case": case, "checks": [],
            "outputs_not_compared": [], "first_module": None, "plain_ddp": "", "failures": [],
            "report": f"interrupted by {signal} before the verdict: nothing was judged", "replay": replay}


def _plan_junit(record: dict) -> str:
    """One <testcase> a check of the report; a failed check is a <failure> with its detail where
    the run diverges, its known fault's <system-out> where every departure is torch's."""
    checks, interrupted, status = record["checks"], bool(record.get("interrupted")), Status(record["status"])
    failures = sum(c["ok"] is False for c in checks) if status.blocks else 0
    totals = {"tests": str(len(checks) + interrupted), "failures": str(failures),
              "errors": str(int(interrupted)),
              "skipped": str(sum(c["ok"] is None for c in checks)), "time": f"{record['seconds']:.3f}"}
    root = ET.Element("testsuites", name="tpdp-verify plan", **totals)
    suite = ET.SubElement(root, "testsuite", name=f"tpdp-verify plan {record['case']['model']}", **totals,
                          timestamp=record["started"])
    properties = ET.SubElement(suite, "properties")
    for key in ("tpdp_verify", "torch", "python", "exit_code"):
        ET.SubElement(properties, "property", name=key, value=str(record[key]))
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname="tpdp_verify.plan", name=c["check"], time="0")
        if c["ok"] is False and status.blocks:
            ET.SubElement(case, "failure", message=_one_line(c["detail"]), type=status).text = \
                _xml_text(record["report"])
        elif c["ok"] is False:  # every departure is torch's known fault: the run passes (tpdp_verify.status)
            ET.SubElement(case, "system-out").text = f"{status}: {_xml_text(c['detail'])}"
        elif c["ok"] is None:
            ET.SubElement(case, "skipped", message=_one_line(c["detail"]))
    if interrupted:  # no verdict: never read as a pass
        case = ET.SubElement(suite, "testcase", classname="tpdp_verify.plan", name="run", time="0")
        ET.SubElement(case, "error", message=record["report"], type="interrupted").text = record["report"]
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _plan_markdown(record: dict) -> str:
    c = record["case"]
    out = [f"# tpdp-verify plan: {c['model']}: {Status(record['status']).label}", "",
           f"torch {record['torch']}, mesh {mesh_text(c['mesh'])}, dp={c['dp']}, {c['steps']} steps, "
           f"{c['dtype']}: {record['seconds']:.1f} s, exit code {record['exit_code']}.", "",
           "| check | result | compared | detail |", "| --- | --- | ---: | --- |"]
    out += [f"| {x['check']} | {'ok' if x['ok'] else 'not compared' if x['ok'] is None else 'FAIL'} | "
            f"{x['compared']} | {_cell(x['detail'])} |" for x in record["checks"]]
    out += ["", *_fenced(record["report"])]
    return "\n".join(out) + "\n"


def usage_record(command: str, message: str) -> dict:
    """A command that refused its input (exit 2): what its outputs say, so that a CI job that
    reads them finds a file, and an error, never last run's verdict or nothing."""
    return {"schema": SCHEMA, "command": command, "tpdp_verify": _version(), "exit_code": EXIT_USAGE,
            "usage_error": message}


def _usage_junit(record: dict) -> str:
    root = ET.Element("testsuites", name=f"tpdp-verify {record['command']}", tests="1", errors="1", failures="0")
    suite = ET.SubElement(root, "testsuite", name=f"tpdp-verify {record['command']}", tests="1", errors="1",
                          failures="0")
    case = ET.SubElement(suite, "testcase", classname="tpdp_verify.cli", name="usage", time="0")
    ET.SubElement(case, "error", message=_one_line(record["usage_error"]), type="usage")
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def to_junit(record: dict) -> str:
    """One <testsuite> of one <testcase> per property and world size: a blocking divergence
    (new, changed, or any without a baseline) is a <failure>, a harness failure (no verdict) an
    <error>, and so is a run that stopped early. A property whose failures a baseline all
    knows passes, its known findings listed in <system-out>: CI is green exactly when the
    gate exits 0, and an interrupted run is never green."""
    if "usage_error" in record:
        return _usage_junit(record)
    if record["command"] == "plan":
        return _plan_junit(record)
    props, error = record["properties"], record["error"]
    tags = [Status(p["status"]).junit for p in props]
    totals = {"tests": len(props) + bool(error), "failures": tags.count("failure"),
              "errors": tags.count("error") + bool(error), "skipped": 0}
    totals = {k: str(v) for k, v in totals.items()} | {"time": f"{record['seconds']:.3f}"}
    root = ET.Element("testsuites", name="tpdp-verify gate", **totals)
    suite = ET.SubElement(root, "testsuite", name="tpdp-verify gate", **totals,
                          timestamp=record["started"])
    properties = ET.SubElement(suite, "properties")
    for key in ("tpdp_verify", "torch", "python", "impl", "profile", "backend", "exit_code"):
        ET.SubElement(properties, "property", name=key, value=str(record[key]))
    ET.SubElement(properties, "property", name="world_sizes",
                  value=", ".join(map(str, record["world_sizes"])))
    if record.get("baseline"):
        ET.SubElement(properties, "property", name="baseline", value=record["baseline"]["name"])
    for p in props:
        case = ET.SubElement(suite, "testcase", classname="tpdp_verify.properties",
                             name=f"{p['name']}[world_size={p['world_size']}]",
                             time=f"{p['seconds']:.3f}")
        verdict = Status(p["status"])
        if verdict.junit:  # a failure where it blocks, an error where there is no verdict (tpdp_verify.status)
            said = [f for f in p["findings"] if Found(f["status"]).blocks] or \
                [f for f in p["findings"] if f["status"] == Found.NOT_ASKED]
            first = f"{said[0]['status']}: {said[0]['kind']}{_faults(said[0])}" if said else p["message"]
            element = ET.SubElement(case, verdict.junit, message=_one_line(first), type=p["status"])
            element.text = _xml_text(p["report"])
        elif verdict == Status.KNOWN:
            ET.SubElement(case, "system-out").text = _xml_text(p["report"])
    if error:
        case = ET.SubElement(suite, "testcase", classname="tpdp_verify.runner.gate", name="run", time="0")
        ET.SubElement(case, "error", message=_one_line(error), type="infra").text = _xml_text(error)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def to_markdown(record: dict) -> str:
    """A table for people (a CI job summary, a pull request), then each failure's report."""
    if "usage_error" in record:
        return f"# tpdp-verify {record['command']}: usage error (exit 2)\n\n{record['usage_error']}\n"
    if record["command"] == "plan":
        return _plan_markdown(record)
    c = record["counts"]
    verdict = statuses.of_counts(c, record["error"])
    stopped = f"INTERRUPTED by {record['interrupted']['signal']}: " if record.get("interrupted") else ""
    out = [
        f"# tpdp-verify gate: {stopped}{statuses.counted(c)}",
        "",
        f"**{statuses.verdict_line(verdict, record['exit_code'])}**",
        "",
        f"torch {record['torch']}, implementation `{record['impl']}`, profile {record['profile']} "
        f"({record['max_examples']} examples a property on world sizes "
        f"{', '.join(map(str, record['world_sizes']))}), backend {record['backend']}: "
        f"{record['seconds']:.1f} s, exit code {record['exit_code']}.",
        "",
    ]
    if record["error"]:
        out += [f"**The run stopped early**: {_one_line(record['error'])}", ""]
    b = record.get("baseline")
    if b:
        out += [f"Against the baseline {b['name']}: {b['new']} new, {b['changed']} changed, {b['fixed']} fixed, "
                f"{b['known']} known" + (f", {b['not_asked']} not asked" if b.get("not_asked") else "") + ".", ""]
    c = record.get("catalog")
    if c and c["known"]:
        out += [f"The fault catalog explains {c['explained']} of the {c['known']} known failures"
                + (f" (faults {', '.join(c['by_fault'])}: `tpdp-verify explain N`)" if c["by_fault"] else "")
                + "".join(f"; not {u['property']} (world {u['world_size']}): {', '.join(u['parts'])}"
                          for u in c["unexplained"]) + ".", ""]
    out += ["| property | world size | result | drawn | known only | findings | seconds |",
            "| --- | ---: | --- | ---: | ---: | --- | ---: |"]
    out += [f"| {p['name']} | {p['world_size']} | {Status(p['status']).label} | {p['drawn']}"
            f"{' (fewer than ' + str(p['wanted']) + ')' if p['drew_fewer'] else ''} | {p['known_only']} | "
            + ", ".join(f"{f['status']}: {f['kind']}{_faults(f)}" for f in p["findings"]).replace("|", "\\|")
            + f" | {p['seconds']:.1f} |" for p in record["properties"]]
    if record.get("not_searched"):
        out += ["", "Not searched:", ""] + [f"- {x['name']} ({', '.join(x['properties'])}): {x['reason']} "
                                          f"([why]({x['doc']}))" for x in record["not_searched"]]
    for p in record["properties"]:
        if p["report"] and p["status"] != Status.INTERRUPTED:  # the table says it: no verdict, no report
            out += ["", f"## {p['name']} (world size {p['world_size']}): {p['status']}", "",
                    *_fenced(p["report"])]
    return "\n".join(out) + "\n"


def _faults(finding: dict) -> str:
    """The catalogued faults a finding's JSON names, as a table cell or a message says them."""
    named = [f"fault {x['number']}" for x in finding.get("faults", ())]
    return f" [{', '.join(named)}]" if named else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _one_line(text: str, limit: int = 300) -> str:
    """A message attribute: the first non-blank line (and the next, when the first ends
    in a colon: "3 of 16 checks failed:" says less than its first check), cut to ``limit``."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()] or [""]
    line = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


# Characters XML 1.0 cannot carry even escaped (a rank's stray terminal codes, say)
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(text: str) -> str:
    return _NOT_XML.sub("?", text)


def _fenced(text: str) -> list[str]:
    """``text`` in a fence longer than any run of backticks inside it."""
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", text)), default=0))
    return [f"{fence}text", text, fence]


# -- the environment


def env_record() -> dict:
    """What this machine and torch build can run; quick: no process group starts."""
    import torch
    import torch.distributed as dist

    from tpdp_verify.impls import select as impl
    from tpdp_verify.runner import profiles

    distributed = dist.is_available()
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "schema": SCHEMA,
        "command": "env",
        "tpdp_verify": _version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": cpus,
        "cuda": cuda,
        "gpus": gpus,
        "backends": {"gloo": distributed and dist.is_gloo_available(),
                     "nccl": distributed and dist.is_nccl_available()},
        "world_sizes": {"gloo": _gloo_sizes(distributed and dist.is_gloo_available(), cpus),
                        "nccl": _nccl_sizes(distributed and dist.is_nccl_available(), gpus)},
        "implementations": {name: _loads(impl.load, name) for name in ("torch", "reference")},
        "profiles": {p.name: {"max_examples": p.max_examples, "world_sizes": list(p.world_sizes)}
                     for p in profiles.PROFILES.values()},
    }


def _gloo_sizes(available: bool, cpus: int | None) -> dict:
    if not available:
        return {"max": 0, "note": "none: this torch build has no gloo"}
    return {"max": None, "note": f"any; more ranks than the {cpus} CPUs time-share them"}


def _nccl_sizes(available: bool, gpus: int) -> dict:
    if gpus == 0:
        return {"max": 0, "note": "none: no GPU"}
    if not available:
        return {"max": 0, "note": "none: this torch build has no NCCL"}
    return {"max": gpus, "note": f"1 to {gpus}: one GPU a rank"}


def _loads(load: Callable[[str], object], name: str) -> str:
    """``ok``, or why the gate could not use implementation ``name``."""
    try:
        load(name)
    except Exception as exc:  # whatever stops it, env reports it and goes on
        return f"error: {exc}"
    return "ok"


def env_text(record: dict) -> str:
    sizes, backends = record["world_sizes"], record["backends"]
    rows = [
        ("tpdp-verify", record["tpdp_verify"]),
        ("torch", record["torch"]),
        ("python", f"{record['python']} on {record['platform']}"),
        ("cpus", record["cpus"]),
        ("cuda", f"{'available' if record['cuda'] else 'not available'}, {record['gpus']} GPUs"),
        ("backends", ", ".join(f"{b} {'yes' if ok else 'no'}" for b, ok in backends.items())),
        ("world sizes", f"gloo: {sizes['gloo']['note']}"),
        ("", f"nccl: {sizes['nccl']['note']}"),
        ("implementations", ", ".join(f"{n} ({s})" for n, s in record["implementations"].items())
         + "; or --impl a.dotted.path"),
    ]
    rows += [("profiles" if i == 0 else "", f"{name}: {p['max_examples']} examples a property, "
              f"world sizes {', '.join(map(str, p['world_sizes']))}")
             for i, (name, p) in enumerate(record["profiles"].items())]
    return "\n".join(f"{key:<16} {value}" for key, value in rows)


RENDER: dict[str, Callable[[dict], str]] = {
    "--json": to_json, "--junit": to_junit, "--markdown": to_markdown,
}
