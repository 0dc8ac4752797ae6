"""What a failure consists of, as stable parts: its identity, by which the baseline release's
answer on the same case is compared (tpdp_verify.runner.baseline).

A verdict's signature is the set of everything that failed in it, not only the first
thing: each failed check by its identifier (``check:parameters-stay-registered-in-order``),
the kind of value that departs first (``value:gradient``), an exception by its type, the
API of the code under test that the harness called and its message with what varies by
case left out (``raised:RuntimeError at torch/_tensor.py:backward: _chunk_cat expects
non-empty tensor``: two faults that raise under one API are two failures; the innermost
frame, which moves when torch refactors, is a detail of the report), a rank that died by
its signal (``crash:SIGABRT``), ranks that hung (``hang``).

Parts name no rank, no step, no parameter and no number, and a check's identifier is its
name, never its message (the ``detail``, which says what was seen and may be reworded):
the same fault gives the same parts on every case it shows in and on either release, and
a fault that adds anything gives a part the old release does not show on that case.
"""

from __future__ import annotations

import os
import re
import traceback

Signature = tuple[str, ...]  # sorted, distinct parts

HANG = "hang"


def slug(name: str) -> str:
    """A check's identifier from its name: "parameters stay registered, in order" ->
    "parameters-stay-registered-in-order"."""
    return "-".join(re.findall(r"[a-z0-9_]+", name.lower()))


def check(name: str) -> str:
    return f"check:{slug(name)}"


def value(what: str) -> str:
    """A kind of value beyond its bound: gradient, parameter, optimizer state, output, loss, buffer."""
    return f"value:{slug(what)}"


def crash(signal: str) -> str:
    return f"crash:{signal or 'exit'}"


def of(parts) -> Signature:
    return tuple(sorted(set(parts)))


def describe(part: str) -> str:
    """A part as a reader says it: "check:frozen-parameters-stay-unchanged" -> "frozen
    parameters stay unchanged", "value:gradient" -> "gradient beyond its bound"."""
    head, _, rest = part.partition(":")
    if head == "check":
        return _spelled(rest)
    if head == "value":
        return _spelled(rest) + " beyond its bound"
    if head == "crash":
        return f"a rank died ({rest})"
    if head == "raised":
        return f"raised {rest}"
    return part


def _spelled(slugged: str) -> str:
    """A slug as its name was spelled: slug() dropped the apostrophes ("t's shard" ->
    "t-s-shard"), and a part's identity keeps the slug, for the memos hold it."""
    return re.sub(r"(?<=n)-t(?=-|$)", "'t", re.sub(r"(?<=[a-z0-9_])-s(?=-|$)", "'s", slugged)).replace("-", " ")


def name(part: str) -> str:
    """A part as an identifier-like name: "check:frozen-parameters-stay-unchanged" ->
    FrozenParametersStayUnchanged, "value:gradient" -> GradientBeyondItsBound,
    "raised:RuntimeError at ..." -> RaisesRuntimeError, "crash:SIGABRT" -> CrashSIGABRT."""
    head, _, rest = api(part).partition(":")
    if head == "raised":
        return "Raises" + rest.split(" ")[0]
    if head == "crash":
        return "Crash" + rest
    return "".join(w[:1].upper() + w[1:] for w in re.findall(r"[A-Za-z0-9]+", describe(part)))


# --------------------------------------------------------------------------- exceptions

# The code under test: torch, tpdp-verify's own implementations (tpdp_verify/impls/: the
# reference transform and FSDP extension, under test with --impl reference), and any other
# implementation given by --impl (select registers its module). Every other frame is the
# side that calls it: the harness, the zoo's models, a user's model and its libraries
# (transformers): a fault is named by the torch API they entered, never by the user's code.
_UNDER_TEST = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "impls") + os.sep]
_STDLIB = os.path.dirname(os.__file__) + os.sep


def under_test(path: str) -> None:
    """Count the code in ``path`` (a module's file, or a folder) as under test."""
    path = os.path.abspath(path)
    _UNDER_TEST.append(path if not os.path.isdir(path) else path + os.sep)


def _torch_root() -> str:
    from importlib.util import find_spec

    spec = find_spec("torch")  # found, not imported: this module is imported before torch
    return os.path.dirname(os.path.abspath(spec.origin)) + os.sep if spec and spec.origin else os.sep + "torch" + os.sep


_TORCH = _torch_root()


def _stdlib(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_STDLIB) and "site-packages" not in path


def _harness(filename: str) -> bool:
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH) or path.startswith(tuple(_UNDER_TEST)))


def short(filename: str) -> str:
    """A file as stable text: from its package root (torch/..., tpdp_verify/...), else its name."""
    parts = os.path.abspath(filename).split(os.sep)
    for root in ("torch", "tpdp_verify", "tests"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return os.path.basename(filename)


# Call machinery: every module call, every function torch decorates (no_grad, DCP's
# logging) passes it, so it names no API; the decorated function within does
_CALLING = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "torch/distributed/checkpoint/logger.py")
# tpdp-verify's taps (ranks/taps.py): its functions inside torch's calls, noting what passes
_TAPS = "tpdp_verify/ranks/taps.py"
_WRAPPERS = ("wrapper", "_no_grad_wrapper", "decorate_context")


def _entered(frames: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The frame where the code under test was entered for the call that raised: the
    outermost of the innermost run of frames outside the harness (the harness, or a
    fixture's forward, called it), past the call machinery. A refactor moves the innermost
    frame (torch 2.11 raises DDP's mesh fault in another helper than 2.13); the API the
    harness called stays. Where the harness itself is innermost (a C++ op in a fixture's
    forward raised), the last run it went through before."""
    runs: list[list[tuple[str, str]]] = [[]]
    for frame in frames:
        if frame[0].startswith("<") or _stdlib(frame[0]) or short(frame[0]) == _TAPS:
            continue  # generated code (a dataclass's __init__), contextlib, functools, a tap: the caller's
        if not _harness(frame[0]):
            runs[-1].append(frame)
        elif runs[-1]:
            runs.append([])
    run = next((r for r in reversed(runs) if r), [])
    named = [f for f in run if not short(f[0]).startswith(_CALLING) and f[1] not in _WRAPPERS]
    return (named or run or [None])[0]


def _pick(frames: list[tuple[str, str]], type_name: str, said: str = "") -> str:
    """``raised:<type> at <file>:<function>: <message>``: the frame where the code under test
    was entered, and what the exception said (``message``)."""
    entered = _entered(frames)
    api = f"raised:{type_name}" + (f" at {short(entered[0])}:{entered[1]}" if entered is not None else "")
    said = message(said)
    return f"{api}: {said}" if said else api


# What varies by case and run in a message, each replaced by a placeholder: paths (a file
# of torch's C++ sources, a checkpoint's folder), quoted names (a parameter's, a key's),
# hexadecimal addresses, then numbers (sizes, shapes, ranks, ports), a run of them one.
_VARYING = [
    (re.compile(r"""(?<![\w'"])(?:[\w.~-]*/)+[\w.-]*(?::\d+)?"""), "<path>"),
    (re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`"), "<name>"),
    (re.compile(r"\b0x[0-9a-fA-F]+\b|\b\d+(?:x\d+)+\b"), "<n>"),  # an address; a shape as 8x12
    (re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)*(?:e[-+]?\d+)?(?![\w])"), "<n>"),
    (re.compile(r"<n>(?:\s*(?:,|x|\.|:)\s*<n>)+"), "<n>"),
    (re.compile(r"<name>(?:,\s*<name>)+"), "<name>"),
]
MESSAGE_CHARS = 160


def message(text: str) -> str:
    """An exception's message as part of its identity: its first line (and the next, where
    the first only announces it: "Error(s) in loading state_dict for Linear:"), stripped of
    what varies by case and run (_VARYING), at most MESSAGE_CHARS characters. The same fault
    says the same on every case and on either release; another fault under the same API says
    something else ("_chunk_cat expects non-empty tensor", "index <n> is out of bounds")."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    first = " ".join(lines[:2] if len(lines) > 1 and lines[0].endswith(":") else lines[:1])
    for pattern, placeholder in _VARYING:
        first = pattern.sub(placeholder, first)
    return first[:MESSAGE_CHARS].rstrip()


# What a rank says when a peer it was exchanging with went away (gloo's transport): the
# echo of another rank's failure, which it reaches or not by timing
_PEER_LOST = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|Socket Timeout|Timed out waiting", re.I)


def echoes_left_out(parts) -> set[str]:
    """``parts`` without those that only say a peer went away, where another part says why:
    whether a rank waiting for the one that raised meets the closed connection or is
    stopped first is timing, and the raise is the failure."""
    parts = set(parts)
    own = {p for p in parts if not (p.startswith("raised:") and _PEER_LOST.search(p.partition(": ")[2]))}
    return own or parts


def api(part: str) -> str:
    """A raised part without its message: ``raised:<type> at <file>:<function>``."""
    return part.split(": ", 1)[0] if part.startswith("raised:") else part


def _frames(exc: BaseException) -> list[tuple[str, str]]:
    frames: list[tuple[str, str]] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # a re-raise "from None" keeps the cause's frames
        seen.add(id(e))
        frames = [(f.filename, f.name) for f in traceback.extract_tb(e.__traceback__)] + frames
        e = e.__cause__ or e.__context__
    return frames


def raised(exc: BaseException) -> str:
    """The part for an exception caught where it was raised (in a rank, or here)."""
    return _pick(_frames(exc), type(exc).__name__, str(exc))


def innermost(exc: BaseException) -> str:
    """Where ``exc`` was raised, for readers, never a part (it moves when torch refactors): at
    the user's own frame where one is on the stack (their model, loss, input or parallelize
    function: file, line and function), else in the code under test."""
    user = _user_frame(exc)
    under_test = [f for f in _frames(exc) if not _harness(f[0])]
    inner = f"{short(under_test[-1][0])}:{under_test[-1][1]}" if under_test else ""
    if user is None:
        return f" (raised in {inner})" if inner else ""
    at = f"{readable(user.filename)}:{user.lineno} in {user.name}"
    last = _innermost_frame(exc)
    raised_here = last is not None and (last.filename, last.lineno) == (user.filename, user.lineno)
    return f" (raised at {at})" if raised_here or not inner else f" (raised in {inner}, called from {at})"


def readable(filename: str) -> str:
    """A user's file as they would name it: relative to the current directory where under it."""
    path = os.path.abspath(filename)
    here = os.getcwd() + os.sep
    return path[len(here):] if path.startswith(here) else path


_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep  # tpdp_verify, its zoo and suite included


def is_users(filename: str) -> bool:
    """Whether a frame's file is the user's own code: neither torch nor tpdp-verify (nor a
    view of it: tpdp_verify/ anywhere in the path), nor an installed package, nor the
    standard library."""
    path = os.path.abspath(filename)
    return not (filename.startswith("<") or _stdlib(path) or path.startswith((_TORCH, _OURS))
                or f"{os.sep}tpdp_verify{os.sep}" in path or f"{os.sep}site-packages{os.sep}" in path)


def in_torch(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_TORCH)


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the user's own code."""
    return next((f for f in reversed(_summaries(exc)) if is_users(f.filename)), None)


def _innermost_frame(exc: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1] if frames else None


def _summaries(exc: BaseException) -> list[traceback.FrameSummary]:
    """Every frame of ``exc`` and what it was raised from or while handling, outermost first."""
    frames: list[traceback.FrameSummary] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        frames = list(traceback.extract_tb(e.__traceback__)) + frames
        e = e.__cause__ or e.__context__
    return frames


_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line \d+, in (?P<function>\S+)', re.M)


def raised_from_text(tb: str) -> str:
    """The same from a formatted traceback (what a rank's reply carries): its frames, and the
    line after the last of them that names the exception (``RuntimeError: ...``)."""
    matches = list(_FRAME.finditer(tb))
    frames = [(m["file"], m["function"]) for m in matches]
    after = (tb[matches[-1].end():] if matches else tb).splitlines()
    at = next((i for i, ln in enumerate(after) if ln.strip() and not ln.startswith(" ")), None)
    head = after[at] if at is not None else "Exception"
    type_name, _, said = head.partition(": ") if ": " in head else (head.rstrip(":"), "", "")
    rest = "\n".join(after[at + 1:]) if at is not None else ""
    return _pick(frames, type_name.rsplit(".", 1)[-1].strip(), "\n".join(filter(None, [said, rest])))
