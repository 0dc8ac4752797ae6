"""Writing a file whole or not at all: what every output and the baseline file need, so
that a run killed at any moment leaves the previous file or the complete new one, never
half of one that CI would read as a verdict."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile


def write_whole(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file in the same
    folder, then renamed over it (os.replace, atomic), so that a kill at any moment leaves
    the previous file or the complete new one. The file keeps its mode (a new one gets the
    umask's, as open() gives it); a link is followed, and stays."""
    target = os.path.realpath(path)
    directory, name = os.path.split(target)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
        os.replace(temporary, target)
    except BaseException:  # an error, or the first interrupt: no temporary file left behind
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: set it back at once
    os.umask(mask)
    return mask
