"""The Python stacks of ranks that hung, as faulthandler dumps them: each rank's frames, the
innermost frame of the user's own code, and the stack as a reader wants it (the user's
frame first, the pool's own machinery left out)."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from tpdp_verify import signature

_BLOCK = re.compile(r"^(?P<head>Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$", re.M)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)\s*$', re.M)
# a rank's own machinery: the pool's loop, the process start, the orphan watcher's thread
_MACHINERY = (f"{os.sep}tpdp_verify{os.sep}ranks{os.sep}pool.py", f"{os.sep}multiprocessing{os.sep}",
              f"{os.sep}threading.py")
_ENTRY = f"{os.sep}tpdp_verify{os.sep}ranks{os.sep}rank.py"  # its main: where a rank's own frames begin


class Frame(NamedTuple):
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        shown = signature.readable(self.file) if signature.is_users(self.file) else signature.short(self.file)
        return f"{shown}:{self.line} in {self.function}"


def frames(dump: str) -> list[Frame]:
    """The frames of the thread that was running the call (faulthandler's current thread,
    else its first), innermost first, down to the rank's entry point (``rank.main``). The
    frames below it are those of the process the rank was forked from: a command that
    forked the ranks' server from itself was inside its caller's frames (a test, a
    notebook cell) at that moment, and each rank still holds them; none is where it hung."""
    blocks = list(_BLOCK.finditer(dump))
    current = next((b for b in blocks if b["head"] == "Current thread"), blocks[0] if blocks else None)
    if current is None:
        text = dump
    else:
        after = [b.start() for b in blocks if b.start() > current.start()]
        text = dump[current.end():after[0] if after else len(dump)]
    stack = [Frame(m["file"], int(m["line"]), m["function"]) for m in _FRAME.finditer(text)]
    entry = next((i for i, f in enumerate(stack) if f.function == "main" and os.path.abspath(f.file).endswith(_ENTRY)),
                 None)
    return stack if entry is None else stack[:entry + 1]


def pending(dumps: dict[int, str]) -> str:
    """The innermost torch.distributed frame of the silent ranks: the collective they wait in."""
    for dump in dumps.values():
        for f in frames(dump):
            path = f.file.replace(os.sep, "/")
            if "/torch/distributed/" in path:
                return f"torch/distributed/{path.rsplit('/torch/distributed/', 1)[1]}:{f.function}"
    return ""


def where(stack: list[Frame]) -> str:
    """Where a rank was: its innermost frame of the user's own code; else its innermost
    torch.distributed frame (the collective it waits in) or frame, and the first frame
    outside torch that called it."""
    user = next((f for f in stack if signature.is_users(f.file)), None)
    if user is not None:
        return f"at {user}"
    if not stack:
        return "no Python frame"
    inner = next((f for f in stack if f"{os.sep}torch{os.sep}distributed{os.sep}" in f.file), stack[0])
    caller = next((f for f in stack if not signature.in_torch(f.file) and not _machinery(f.file)), None)
    return f"in {inner}" + (f", called from {caller}" if caller and caller != inner else "")


def report(dumps: dict[int, str]) -> str:
    """A line a rank saying where it was, then each rank's stack without the pool's frames."""
    parsed = {r: frames(d) for r, d in sorted(dumps.items())}
    out = [f"rank {r}: {where(stack)}" for r, stack in parsed.items()]
    for r, stack in parsed.items():
        shown = [f"  {f}" for f in stack if not _machinery(f.file)]
        out += [f"--- rank {r} stack (innermost first; the pool's own frames left out) ---", *shown]
    return "\n".join(out)


def _machinery(path: str) -> bool:
    return path.startswith("<") or any(m in os.path.abspath(path) for m in _MACHINERY)
