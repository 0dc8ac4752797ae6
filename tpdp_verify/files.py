"""Where tpdp-verify writes: a file whole or not at all (what every output and the memo
need, so that a run killed at any moment leaves the previous file or the complete new one,
never half of one that CI would read as a verdict); and the cache directory, which holds
the user's memo, the environments of baseline releases and each run's rank logs."""

from __future__ import annotations

import contextlib
import gzip
import os
import stat
import tempfile
import time
from pathlib import Path


def write_whole(path: str, text: str, compressed: bool = False) -> None:
    """Write ``text`` to ``path`` whole or not at all: into a temporary file in the same
    folder, then renamed over it (os.replace, atomic), so that a kill at any moment leaves
    the previous file or the complete new one. The file keeps its mode (a new one gets the
    umask's, as open() gives it); a link is followed, and stays. ``compressed``: gzip, with no
    time in its header (the same text, the same bytes)."""
    target = os.path.realpath(path)
    directory, name = os.path.split(target)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            data = text.encode("utf-8")
            f.write(gzip.compress(data, mtime=0) if compressed else data)
        os.replace(temporary, target)
    except BaseException:  # an error, or the first interrupt: no temporary file left behind
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: set it back at once
    os.umask(mask)
    return mask


RUNS_KEPT = 20  # rank-log directories kept in the cache: the newest, one a run


def cache_dir() -> Path:
    """$TPDP_VERIFY_CACHE, else $XDG_CACHE_HOME/tpdp-verify, else ~/.cache/tpdp-verify."""
    given = os.environ.get("TPDP_VERIFY_CACHE")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpdp-verify"


def run_directory() -> str:
    """A fresh directory for one run's rank logs, under the cache's runs/ (named by when it
    started); the oldest beyond RUNS_KEPT are removed, so an afternoon of runs leaves 20,
    not one a run in the temp dir."""
    import shutil

    runs = cache_dir() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    now = time.time_ns()
    made = tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-", time.localtime(now / 1e9))
                            + f"{now % 10**9:09d}-", dir=runs)
    for old in sorted(runs.iterdir(), key=lambda p: p.name)[:-RUNS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    return made
