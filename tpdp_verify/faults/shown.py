"""Which torch releases show each catalogued fault: what each reproduction did when run on
each release (``shown.json``: each release's exit code a fault; 1: present, 0: absent, else
the reproduction could not tell). Filled by the releases job (tpdp_verify.faults.releases),
read by ``Fault.releases``."""

from __future__ import annotations

import json
import re
from pathlib import Path

SHOWN = Path(__file__).parent / "shown.json"


def recorded() -> dict[str, dict[str, int | None]]:
    """release -> {fault number: the reproduction's exit code there (None: it did not finish)}."""
    return json.loads(SHOWN.read_text())["releases"]


def showing(number: int) -> tuple[str, ...]:
    """The releases whose run of fault ``number``'s reproduction shows it (exit 1), oldest first."""
    return tuple(r for r, codes in sorted(recorded().items(), key=lambda kv: _order(kv[0]))
                 if codes.get(str(number)) == 1)


def _order(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", release)[:3])
