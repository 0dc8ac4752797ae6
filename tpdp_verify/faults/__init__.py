"""The faults torch shows, as data: which failure each explains, and how to report it upstream.

A record (``Fault``) says what goes wrong, where in torch, what it costs a user, the
workaround, the releases that show it, the upstream issue, and a standalone reproduction
(``repros/``: one file, torch only). Its ``shows`` say which signature parts it explains on
which cases: a part is explained where a record's rule names it (a pattern), its property,
and the case's facts (``facts``) match. A failure is explained when every part of its
signature is; the faults that explain it are named in every report. A failure no record
explains is news, whatever the baseline release says of it.

The catalog does not judge: known, NEW and CHANGED are the baseline release's answers on the
same case (tpdp_verify.runner.baseline). It names.
"""

from __future__ import annotations

from tpdp_verify.faults.catalog import CATALOG
from tpdp_verify.faults.record import Explanation, Fault, Shows, facts
from tpdp_verify.status import Found

__all__ = ["CATALOG", "Explanation", "Fault", "Shows", "explain", "facts", "find", "tally"]


def explain(prop: str, drawn: dict | None, sig) -> Explanation:
    """The faults that explain a failure of ``prop`` on the case ``drawn`` with signature ``sig``."""
    known = facts(drawn)
    found, unexplained = {}, []
    for part in sig:
        by = [f for f in CATALOG if any(s.explains(part, prop, known) for s in f.shows)]
        for f in by:
            found[f.number] = f
        if not by:
            unexplained.append(part)
    return Explanation(tuple(found[n] for n in sorted(found)), tuple(unexplained))


def find(ref: str) -> Fault | None:
    """A fault by its number ("15", "fault 15"), its name, or its repro's file name."""
    ref = ref.strip().lower().removeprefix("fault").strip()
    for f in CATALOG:
        if ref in (str(f.number), f.name.lower(), f.repro.lower(), f.repro.lower().removesuffix(".py")):
            return f
    return None


def tally(properties: list[dict]) -> dict:
    """How many of a run's known failures (a gate record's ``properties``) the catalog explains,
    by which faults, and those it does not (each known failure once a search): news, though
    the release shows them."""
    known = [(p, f) for p in properties for f in p["findings"] if f["status"] == Found.KNOWN]
    by: dict[int, int] = {}
    for _, f in known:
        for x in f.get("faults", ()):
            by[x["number"]] = by.get(x["number"], 0) + 1
    return {"known": len(known), "explained": sum(not f.get("unexplained") for _, f in known),
            "by_fault": {str(n): by[n] for n in sorted(by)},
            "unexplained": [{"property": p["name"], "world_size": p["world_size"], "parts": f["unexplained"]}
                            for p, f in known if f.get("unexplained")]}
