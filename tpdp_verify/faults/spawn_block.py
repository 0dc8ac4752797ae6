"""The one spawn block every reproduction carries: its ranks, loopback rendezvous and timeouts.

A reproduction must stand alone (``python FILE``, torch only), so each file ends with the
same block, from ``MARKER`` on. The first fault's file holds it; a change is made there and
copied into every other file with ``python -m tpdp_verify.faults.spawn_block``. The same
holds for the findings' reproductions, and the blocks of steps those of one kind share
(``python -m tpdp_verify.integrations.findings``).
"""

from __future__ import annotations

from pathlib import Path

MARKER = "# --- boilerplate: WORLD gloo ranks on 127.0.0.1"
_ANY = "\n# --- boilerplate: "  # where a file's next block begins


def block(path: Path, marker: str = MARKER) -> str:
    """A file's block, from ``marker`` to the next block or the end ("" where it has none).
    The spawn block ends every file; the findings' reproductions carry a block of their
    kind's steps before it (tpdp_verify.integrations.findings.BLOCKS)."""
    text = path.read_text()
    if marker not in text:
        return ""
    start = text.index(marker)
    end = text.find(_ANY, start + 1)
    return text[start:] if end < 0 else text[start:end + 1]


def differing(paths: list[Path], marker: str = MARKER) -> list[Path]:
    """The files whose block is not the first file's."""
    return [p for p in paths[1:] if block(p, marker) != block(paths[0], marker)]


def sync(paths: list[Path], marker: str = MARKER) -> list[Path]:
    """Copy the first file's block into each other file that has the marker; the files changed."""
    changed = [p for p in differing(paths, marker) if block(p, marker)]
    for p in changed:
        text, old = p.read_text(), block(p, marker)
        start = text.index(marker)
        p.write_text(text[:start] + block(paths[0], marker) + text[start + len(old):])
    return changed


if __name__ == "__main__":  # python -m tpdp_verify.faults.spawn_block: the catalog's reproductions
    from tpdp_verify.faults import CATALOG

    done = sync([f.repro_path for f in CATALOG])
    print(f"copied fault {CATALOG[0].number}'s spawn block into {len(done)} files"
          + "".join(f"\n  {p.name}" for p in done))
