"""The torch releases tpdp-verify runs on, checked before anything imports torch's modules:
on an older torch the first import fails deep inside torch (a missing ParallelStyle), which
says nothing about what to do."""

from __future__ import annotations

import re
from importlib import metadata

from tpdp_verify.errors import UsageError

# the lowest torch its tests and smoke gate run on: 2.11 and 2.12 measured (docs/performance.md,
# "Older releases"); make test pins 2.13.0
LOWEST = (2, 11)


def check() -> None:
    """Raise a one-line UsageError unless the installed torch is LOWEST or newer."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise UsageError("torch is not installed: pip install 'torch>=2.11'") from None
    if release(version) < LOWEST:
        raise UsageError(f"tpdp-verify runs on torch {LOWEST[0]}.{LOWEST[1]} or newer, the lowest its tests run on; "
                         f"this environment has torch {version}: install a newer one (pip install 'torch>=2.11')")


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "2.13.0+cpu" or "2.15.0.dev20261101"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)
