"""An environment holding a torch release, installed once into the cache and reused.

A baseline release answers by replay in an interpreter of its own (tpdp_verify.runner.replay's
``PythonSide``): a venv under the cache directory with that torch and the hypothesis and
numpy this tpdp-verify runs with (tpdp-verify itself reaches it as a view of its packages).
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tpdp_verify.errors import UsageError
from tpdp_verify.files import cache_dir

READY = ".tpdp-verify-ready"  # written last: a venv without it was cut short, and is made again


def where(release: str) -> Path:
    return cache_dir() / "envs" / f"torch-{release}"


def environment(release: str, progress=print) -> str:
    """The python of an environment holding torch ``release``: made now if there is none,
    with pip's progress lines passed on; a UsageError (one line) where it cannot be made."""
    venv = where(release)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.with_name(venv.name + ".lock"), "w") as lock:  # parts of one run (--jobs) install it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _made(venv, release, progress)


def _made(venv: Path, release: str, progress) -> str:
    python = venv / "bin" / "python"
    if (venv / READY).exists() and python.exists():
        return str(python)
    shutil.rmtree(venv, ignore_errors=True)
    progress(f"baseline: installing torch=={release} once into {venv} (reused by later runs)")
    wanted = [f"torch=={release}", *(f"{p}=={metadata.version(p)}" for p in ("hypothesis", "numpy"))]
    try:
        _run([sys.executable, "-m", "venv", str(venv)], progress)
        _run([str(python), "-m", "pip", "install", "--progress-bar", "off", *wanted], progress)
    except (OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(venv, ignore_errors=True)
        raise UsageError(f"could not install torch=={release} into {venv} ({_why(exc)}): give an environment "
                         "that holds it with --baseline-python PATH") from None
    (venv / READY).write_text(" ".join(wanted) + "\n")
    return str(python)


def _run(command: list[str], progress) -> None:
    """Run ``command``, passing on the lines that say how far it got."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-5:]
        if line.startswith(("Collecting", "Downloading", "Installing", "Successfully")):
            progress(f"baseline:   {line}")
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, command, "\n".join(tail))


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        said = [ln for ln in (exc.output or "").splitlines() if ln.strip()]
        return f"{Path(exc.cmd[0]).name} {' '.join(exc.cmd[1:3])} exited {exc.returncode}" + (
            f": {said[-1].strip()}" if said else "")
    return str(exc)
