"""Helpers for tests: processes that come and go, properties that diverge."""

import time

import pytest

from tpdp_verify.judging.divergence import Divergence
from tpdp_verify.runner.property import Stats


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds: float = 15.0) -> list[int]:
    """Wait up to ``seconds`` for every pid to end; return those still alive."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def divergences(prop, pool, impl, profile) -> tuple[list[Divergence], Stats]:
    """Run ``prop``, which must fail; every distinct failure hypothesis found, each a Divergence."""
    stats = Stats()
    with pytest.raises(Exception) as info:
        prop.run(pool, impl, profile, stats)
    found = info.value.exceptions if isinstance(info.value, BaseExceptionGroup) else (info.value,)
    assert all(isinstance(e, Divergence) for e in found), found
    return list(found), stats


def the_one(found, stats, text: str) -> tuple[str, dict]:
    """The message and shrunk draw of the divergence among ``found`` whose message holds ``text``."""
    match = [e for e in found if text in str(e)]
    assert match, f"no divergence says {text!r}: {found}"
    return str(match[0]), stats.failures[type(match[0]).__name__]
