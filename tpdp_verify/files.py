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


RUNS_KEPT = 20  # rank-log directories of ended runs kept in the cache: the newest, one a run
LIVE = ".live"  # in a run's directory: the file its run holds locked while it lives (flock)
_HELD: dict[str, int] = {}  # this process's run directories -> the descriptor that holds each one's lock


def cache_dir() -> Path:
    """$TPDP_VERIFY_CACHE, else $XDG_CACHE_HOME/tpdp-verify, else ~/.cache/tpdp-verify."""
    given = os.environ.get("TPDP_VERIFY_CACHE")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpdp-verify"


def inductor_cache() -> str:
    """Where torch's inductor keeps its cache in tpdp-verify's processes, unless the user names
    one (TORCHINDUCTOR_CACHE_DIR): importing torch's optimizers makes it, in the temp dir by
    default, and it stays there after every run."""
    return str(cache_dir() / "torchinductor")


def run_directory() -> str:
    """A fresh directory for one run's rank logs, under the cache's runs/ (named by when it
    started), held for as long as this process lives. The oldest beyond RUNS_KEPT are removed,
    so an afternoon of runs leaves 20, not one a run in the temp dir; but only those whose
    run has ended: gates, plan runs, shards and pytest workers share one cache, and an age
    says nothing of whether a run still writes there."""
    runs = cache_dir() / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    now = time.time_ns()
    stamp = time.strftime("%Y%m%d-%H%M%S-", time.localtime(now / 1e9)) + f"{now % 10**9:09d}-"
    # made under a dot name and renamed once locked: a pruner never sees it unheld
    staging = tempfile.mkdtemp(prefix="." + stamp, dir=runs)
    _HELD[staging] = _hold(Path(staging))
    made = os.path.join(runs, os.path.basename(staging)[1:])
    os.rename(staging, made)
    _HELD[made] = _HELD.pop(staging)
    _prune(runs)
    return made


def _hold(directory: Path) -> int:
    """Lock ``directory``'s LIVE file for the rest of this process (the kernel lets it go
    however the process ends, so a killed run never pins its directory). The descriptor is
    not inheritable: ranks forked or spawned later neither hold nor release it."""
    import fcntl

    fd = os.open(directory / LIVE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _prune(runs: Path) -> None:
    """Remove the directories of ended runs beyond the newest RUNS_KEPT of them. A run lives
    while its LIVE file is locked; the lock is taken here before removing, so two pruners
    never remove one directory twice, and nothing of a living run is touched."""
    import fcntl
    import shutil

    ended = []
    for d in sorted((p for p in runs.iterdir() if not p.name.startswith(".")), key=lambda p: p.name):
        if str(d) in _HELD:
            continue
        try:
            fd = os.open(d / LIVE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:  # removed meanwhile by another pruner, or not a directory of ours
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its run lives
            os.close(fd)
            continue
        ended.append((d, fd))
    for d, fd in ended[:max(0, len(ended) - RUNS_KEPT)]:
        shutil.rmtree(d, ignore_errors=True)  # removed while locked: no other pruner reads it half gone
    for _, fd in ended:
        os.close(fd)
