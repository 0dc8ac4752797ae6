"""Which torch releases show each catalogued fault: what each reproduction did when run on each.

The catalog names the releases that show a fault from a run of its reproduction there, never
from a guess: ``shown.json`` holds each release's exit code a fault (tpdp_verify.faults.shown,
which ``Fault.releases`` reads). This job fills it; it runs outside ``make test`` (each
release is a throw-away environment of several GB; docs/performance.md, "Newer releases"):

    python -m tpdp_verify.faults.releases /path/to/venv-2.15.0/bin/python [PYTHON ...]

runs every reproduction under each interpreter given and records what it shows under that
interpreter's torch release, keeping every other release's record.
"""

from __future__ import annotations

import json
import sys

from tpdp_verify.faults.shown import SHOWN
from tpdp_verify.files import write_whole


def record(python: str, progress=print) -> tuple[str, dict[str, int | None]]:
    """Run every reproduction under ``python``; its release and each fault's exit code."""
    from tpdp_verify.faults import CATALOG
    from tpdp_verify.faults.issue import run

    codes, release = {}, ""
    for f in CATALOG:
        shown = run(f, python)
        release = shown.torch.split("+")[0]
        codes[str(f.number)] = shown.code
        progress(f"  torch {shown.torch}: fault {f.number:>2} {shown.verdict}")
    return release, codes


def main(pythons: list[str]) -> int:
    if not pythons:
        print("usage: python -m tpdp_verify.faults.releases PYTHON [PYTHON ...]: the interpreters of the "
              "releases to run every reproduction on", file=sys.stderr)
        return 2
    doc = json.loads(SHOWN.read_text())
    for python in pythons:
        release, codes = record(python)
        doc["releases"][release] = codes
        write_whole(str(SHOWN), json.dumps(doc, indent=1, sort_keys=True) + "\n")  # each release as it ends
        unsure = sorted((n for n, c in codes.items() if c not in (0, 1)), key=int)
        print(f"torch {release}: shows {sum(c == 1 for c in codes.values())} of {len(codes)} faults"
              + (f"; could not tell for faults {', '.join(unsure)}" if unsure else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
