"""What a failure consists of, as stable parts: its identity, by which the baseline release's
answer on the same case is compared (tpdp_verify.runner.baseline).

A verdict's signature is the set of everything that failed in it, not only the first
thing: each failed check by its identifier (``check:parameters-stay-registered-in-order``),
the kind of value that departs first (``value:gradient``), an exception by its type and
the API of the code under test that the harness called
(``raised:RuntimeError at torch/nn/parallel/distributed.py:__init__``; the innermost frame,
which moves when torch refactors, is a detail of the report), a rank that
died by its signal (``crash:SIGABRT``), ranks that hung (``hang``).

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
        return rest.replace("-", " ")
    if head == "value":
        return rest.replace("-", " ") + " beyond its bound"
    if head == "crash":
        return f"a rank died ({rest})"
    if head == "raised":
        return f"raised {rest}"
    return part


def name(part: str) -> str:
    """A part as an identifier-like name: "check:frozen-parameters-stay-unchanged" ->
    FrozenParametersStayUnchanged, "value:gradient" -> GradientBeyondItsBound,
    "raised:RuntimeError at ..." -> RaisesRuntimeError, "crash:SIGABRT" -> CrashSIGABRT."""
    head, _, rest = part.partition(":")
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


def _pick(frames: list[tuple[str, str]], type_name: str) -> str:
    """``raised:<type> at <file>:<function>``, the frame where the code under test was entered."""
    entered = _entered(frames)
    if entered is None:
        return f"raised:{type_name}"
    return f"raised:{type_name} at {short(entered[0])}:{entered[1]}"


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
    return _pick(_frames(exc), type(exc).__name__)


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
    """The same from a formatted traceback (what a rank's reply carries)."""
    frames = [(m["file"], m["function"]) for m in _FRAME.finditer(tb)]
    last = [ln for ln in tb.strip().splitlines() if ln and not ln.startswith(" ")]
    type_name = last[-1].split(":")[0].rsplit(".", 1)[-1] if last else "Exception"
    return _pick(frames, type_name)
