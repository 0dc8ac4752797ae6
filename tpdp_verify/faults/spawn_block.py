"""The one spawn block every reproduction carries: its ranks, loopback rendezvous and timeouts.

A reproduction must stand alone (``python FILE``, torch only), so each file ends with the
same block, from ``MARKER`` on. The first fault's file holds it; a change is made there and
copied into every other file with ``python -m tpdp_verify.faults.spawn_block``.
"""

from __future__ import annotations

from pathlib import Path

MARKER = "# --- boilerplate: WORLD gloo ranks on 127.0.0.1"


def block(path: Path) -> str:
    """A file's block, from the marker on ("" where it has none)."""
    text = path.read_text()
    return text[text.index(MARKER):] if MARKER in text else ""


def differing(paths: list[Path]) -> list[Path]:
    """The files whose block is not the first file's."""
    return [p for p in paths[1:] if block(p) != block(paths[0])]


def sync(paths: list[Path]) -> list[Path]:
    """Copy the first file's block into each other file that has the marker; the files changed."""
    changed = [p for p in differing(paths) if block(p)]
    for p in changed:
        text = p.read_text()
        p.write_text(text[:text.index(MARKER)] + block(paths[0]))
    return changed


if __name__ == "__main__":  # python -m tpdp_verify.faults.spawn_block [FILE ...]: the catalog's, and those given
    import sys

    from tpdp_verify.faults import CATALOG

    done = sync([f.repro_path for f in CATALOG] + [Path(p) for p in sys.argv[1:]])
    print(f"copied fault {CATALOG[0].number}'s spawn block into {len(done)} files"
          + "".join(f"\n  {p.name}" for p in done))
