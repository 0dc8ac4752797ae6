"""Helpers for tests: processes that come and go, the sockets they listen on, properties
that diverge."""

import concurrent.futures
import ipaddress
import os
import socket
import subprocess
import sys
import tempfile
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


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (a pool's ranks are its fork server's children)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
        except (ValueError, OSError):  # not a process, or gone while we looked
            continue
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _address(hex_address: str) -> tuple[str, int]:
    """/proc/net/tcp's ``0100007F:1F90`` as ("127.0.0.1", 8080): the address in 32-bit words,
    each in the machine's byte order (little-endian here)."""
    address, port = hex_address.split(":")
    raw = bytes.fromhex(address)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw), int(port, 16)


def listening(pids) -> dict[int, list[tuple[str, int]]]:
    """pid -> the (address, port) of each TCP socket it listens on, from /proc/net/tcp and tcp6."""
    listeners = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":  # TCP_LISTEN
                    listeners[int(cols[9])] = _address(cols[1])
    out = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone
            continue
        links = []
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:  # closed while we looked
                pass
        out[pid] = [listeners[int(t[8:-1])] for t in links if t.startswith("socket:[") and int(t[8:-1]) in listeners]
    return out


def exposed(pids) -> dict[int, list[tuple[str, int]]]:
    """Of ``listening``, the sockets not on the loopback interface (``::`` and 0.0.0.0 too)."""
    def loopback(address: str) -> bool:
        ip = ipaddress.ip_address(address)
        return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)

    return {pid: bad for pid, socks in listening(pids).items() if (bad := [s for s in socks if not loopback(s[0])])}


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
    return str(match[0]), stats.failures[type(match[0]).signature]


# A user's own module, as they write it beside their tests: a model, its TP plan, its input.
# Tests write it out (a pytester file, a folder outside the repository) and import it there.
USER_MLP = """
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def make_model():
    return MLP()


def inputs(n, generator):
    return torch.randn(n, 8, generator=generator)
"""


# Standalone scripts (the faults' and findings' reproductions) run two at a time in the
# background, in the order their tests come: each spends most of its time starting its ranks
# and importing torch, so a second one fills the idle core (docs/performance.md).
_AHEAD = concurrent.futures.ThreadPoolExecutor(max_workers=2)
_RUNS: dict = {}


def script_run(path, every, *, timeout: float, bare_env: bool = False) -> subprocess.CompletedProcess:
    """``python path`` in a fresh directory, its outcome; ``every`` script of the test file is
    started ahead, two at a time. ``bare_env``: only PATH, and HOME the fresh directory."""
    for p in every:
        if p not in _RUNS:
            _RUNS[p] = _AHEAD.submit(_run, p, timeout, bare_env)
    return _RUNS[path].result()


def _run(path, timeout: float, bare_env: bool) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="tpdp-repro-") as here:
        env = {"PATH": "/usr/bin:/bin", "HOME": here} if bare_env else None
        return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                              cwd=here, env=env, stdin=subprocess.DEVNULL)
