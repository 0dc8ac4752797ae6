"""The parts of a gate run split by ``--shard``, put back together into the run's one record.

Each part is the ``--json`` record of ``gate --shard K/N``. They must be the N parts of one
run: the same torch, implementation, profile, seed, ``-k``, suite plan and baseline, each
K once; a part missing, given twice or from another run is an error, never a pass. A
search's verdict is its own, so the whole run's record is the parts' searches in the run's
order; its counts, judgement and exit code follow from them as the gate's do.
"""

from __future__ import annotations

import json
from pathlib import Path

from tpdp_verify import faults
from tpdp_verify import status as statuses
from tpdp_verify.errors import UsageError
from tpdp_verify.runner.selection import parse
from tpdp_verify.status import Status

# What the parts of one run share.
SAME = ("command", "schema", "tpdp_verify", "torch", "impl", "profile", "max_examples", "seed", "backend",
        "world_sizes", "shrink_total")
JUDGED = ("new", "changed", "fixed", "known", "not_asked", "reran", "not_rerun", "infra")  # the baseline's counts
# What merge reads of a part, beyond SAME.
READ = ("selection", "counts", "properties", "seconds", "started", "exit_code", "error", "baseline", "interrupted")


def load(path: str) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise UsageError(f"{path} is not JSON: give the --json files of `tpdp-verify gate --shard K/N` runs") from None
    if not isinstance(record, dict) or record.get("command") != "gate":
        raise UsageError(f"{path} is not a gate record: give the --json files of `tpdp-verify gate --shard K/N` runs")
    lacks = [key for key in (*SAME, *READ) if key not in record]
    if lacks:
        raise UsageError(f"{path} lacks {', '.join(lacks)}: a gate record of another tpdp-verify; run the parts "
                         "again with this one")
    return record


def merge(records: list[tuple[str, dict]]) -> dict:
    """The parts' (path, record), to the whole run's record (and its exit code)."""
    parts = _parts(records)
    first = parts[0]
    plan = first["selection"]["plan"]
    order = {sid: i for i, sid in enumerate(plan)}
    properties = sorted((p for r in parts for p in r["properties"]),
                        key=lambda p: order[f"{p['name']}[world_size={p['world_size']}]"])
    counts = {v.key: sum(r["counts"].get(v.key, 0) for r in parts) for v in Status}
    stopped = [r["interrupted"] for r in parts if r.get("interrupted")]
    errors = [f"part {r['selection']['shard']}: {r['error']}" for r in parts if r["error"]]
    merged = {
        **first,
        "started": min(r["started"] for r in parts),
        "seconds": round(sum(r["seconds"] for r in parts), 3),  # as if run in one process
        "error": "; ".join(errors),
        "interrupted": {**stopped[0], "not_run": [x for s in stopped for x in s["not_run"]]} if stopped else None,
        "baseline": _judgement([r["baseline"] for r in parts]),
        "counts": counts,
        # the run's own: -k's where given, else the whole suite's (null, as a run in one process)
        "selection": {**first["selection"], "shard": None, "searches": plan} if first["selection"]["keyword"]
        else None,
        "parts": [{"shard": r["selection"]["shard"], "seconds": r["seconds"], "exit_code": r["exit_code"],
                   "started": r["started"]} for r in parts],
        "properties": properties,
        "catalog": faults.tally(properties),
    }
    merged["exit_code"] = _exit_code(merged, parts)
    return merged


def _parts(records: list[tuple[str, dict]]) -> list[dict]:
    """The records in shard order, once each checked to be the parts of one run."""
    if not records:
        raise UsageError("give the --json files of the N parts of one `tpdp-verify gate --shard K/N` run")
    by_k: dict[int, tuple[str, dict]] = {}
    n = None
    for path, record in records:
        shard = (record.get("selection") or {}).get("shard")
        if not shard:
            raise UsageError(f"{path} is a whole run, not a part: merge takes the --json files of `gate --shard K/N`")
        try:
            k, parts = parse(shard)
        except UsageError:
            raise UsageError(f"{path} names its part {shard!r}, not K/N: a gate record of another tool?") from None
        if n is not None and parts != n:
            raise UsageError(f"{path} is part {shard}, the others of {n} parts: give the parts of one split")
        n = parts
        if k in by_k:
            raise UsageError(f"part {shard} given twice: {by_k[k][0]} and {path}")
        by_k[k] = (path, record)
    missing = [f"{k}/{n}" for k in range(1, n + 1) if k not in by_k]
    if missing:
        raise UsageError(f"part{'s' * (len(missing) > 1)} {', '.join(missing)} missing: a run's verdict needs "
                         f"every one of its {n} parts")
    parts = [by_k[k] for k in sorted(by_k)]
    (first_path, first), rest = parts[0], parts[1:]
    for path, record in rest:
        mine, theirs = _run_of(record), _run_of(first)
        differ = [key for key in mine if mine[key] != theirs[key]]
        if differ:
            raise UsageError(f"{path} and {first_path} are parts of different runs ({differ[0]}: "
                             f"{mine[differ[0]]!r} and {theirs[differ[0]]!r})")
    searched = [sid for _, r in parts for sid in r["selection"]["searches"]]
    if sorted(searched) != sorted(first["selection"]["plan"]) or len(set(searched)) != len(searched):
        raise UsageError("the parts' searches are not the run's, each once: were they split by one tpdp-verify?")
    return [r for _, r in parts]


def _run_of(record: dict) -> dict:
    """What names the run a part belongs to."""
    return {**{key: record.get(key) for key in SAME}, "-k": record["selection"]["keyword"],
            "searches": record["selection"]["plan"], "baseline": (record["baseline"] or {}).get("name")}


def _judgement(parts: list[dict | None]) -> dict | None:
    """The baseline's judgement of the whole run: each search judges its own findings and
    reruns its own memo cases, so the parts' counts add up."""
    if not parts[0]:
        return None
    merged = {"name": parts[0]["name"], "blocks": any(p["blocks"] for p in parts)}
    return merged | {k: sum(p.get(k, 0) for p in parts) for k in JUDGED}  # a record before "infra" counted none


def _exit_code(merged: dict, parts: list[dict]) -> int:
    """As the gate's: a signal's code where a part was stopped by one, else the run's verdict's."""
    stopped = [r["exit_code"] for r in parts if r.get("interrupted")]
    return stopped[0] if stopped else statuses.of_counts(merged["counts"], merged["error"]).exit_code


def summary(merged: dict, command: str = "merge") -> str:
    """What merge (or gate --jobs) prints: each part, each search's verdict, and the whole run's."""
    c = merged["counts"]
    out = [f"tpdp-verify {command}: {len(merged['parts'])} parts of profile {merged['profile']}, implementation "
           f"{merged['impl']}, torch {merged['torch']}"]
    out += [f"  part {p['shard']}: exit {p['exit_code']} in {p['seconds']:.1f} s" for p in merged["parts"]]
    out += [f"{p['name']:<38} world {p['world_size']}  {p['status'].upper():<8} {p['drawn']:>4} drawn  "
            f"{p['seconds']:6.1f} s" for p in merged["properties"]]
    b = merged["baseline"]
    out.append(f"{statuses.counted(c)}; {merged['seconds']:.1f} s in all, the longest part "
               f"{max(p['seconds'] for p in merged['parts']):.1f} s")
    verdict = statuses.of_counts(c, merged["error"])
    if b:
        out.append(f"against the baseline {b['name']}: {b['new']} new, {b['changed']} changed, {b['fixed']} fixed, "
                   f"{b['known']} known" + (f", {b['not_asked']} not asked" if b["not_asked"] else "")
                   + (f"; {b['not_rerun']} of the memo's failing cases not rerun" if b["not_rerun"] else "")
                   + f": {verdict.sentence}")
    out += [f"\n{p['report']}" for p in merged["properties"] if p["report"] and p["status"] != Status.INTERRUPTED]
    return "\n".join(out + ["", statuses.verdict_line(verdict, merged["exit_code"])])
