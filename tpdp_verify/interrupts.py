"""SIGINT and SIGTERM as an exception a command catches, so that a run cut short keeps what
it judged (docs/cli.md, "Exit codes").

Within ``caught()`` the first of either signal raises ``Interrupted`` in the main thread,
wherever it is (a rank call, hypothesis, the judging; where Python would ignore it, it is
delivered again): the pool retires its ranks as the exception passes, and the command
writes its outputs. Any later one ends the process at once: the outputs are each written
whole or not at all (outputs.write_whole), and the ranks end with this process (their
lifeline).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The first SIGINT or SIGTERM; a KeyboardInterrupt, so whatever lets Ctrl-C through lets it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's: 130 for SIGINT, 143 for SIGTERM


def within(exc: BaseException) -> Interrupted | None:
    """The Interrupted that ``exc`` was raised from or while handling, or, failing that, the
    one this process received already, if any. A library may turn the interrupt into an
    error of its own as it passes (hypothesis, interrupted as its engine starts or as it
    records a case, fails a check on its own state, and may keep no link to the interrupt:
    its FlakyStrategyDefinition): that is the interrupt still, never the tool's failure."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        exc = pending.pop()
        if not isinstance(exc, BaseException) or id(exc) in seen:
            continue
        if isinstance(exc, Interrupted):
            return exc
        seen.add(id(exc))
        pending += [exc.__cause__, exc.__context__, *_held(getattr(exc, "exceptions", ()))]
    return _received


def _held(exceptions) -> list[BaseException]:
    """The exceptions an error carries, whatever holds them: a group's tuple, RankFailed's
    dict by rank, anything else a library sets (nothing there is walked but exceptions)."""
    if isinstance(exceptions, dict):
        exceptions = exceptions.values()
    try:
        return [e for e in exceptions if isinstance(e, BaseException)]
    except TypeError:  # not iterable
        return []


def _at_once(signum: int, frame) -> None:
    os.write(2, f"tpdp-verify: {signal.Signals(signum).name} again: stopped at once\n".encode())
    os._exit(128 + signum)


_received: Interrupted | None = None  # the first signal, within caught()


def _first(signum: int, frame) -> None:
    global _received
    _switch(_first, _at_once)
    _received = Interrupted(signum)
    raise _received


def _switch(old, new) -> None:
    for s in SIGNALS:
        if signal.getsignal(s) is old:
            signal.signal(s, new)


def _swallowed(unraisable) -> None:
    """The handler runs wherever the main thread is, and that may be where Python reports an
    exception and goes on (a gc callback, as hypothesis installs one; a __del__): an
    Interrupted raised there would be lost. Send the signal again, a moment later from
    another thread (from this one the handler would run at once, here), so that it is
    raised once the main thread is back in code that lets it through; anything else goes
    to the hook there was."""
    if not isinstance(unraisable.exc_value, Interrupted):
        _hook(unraisable)
        return
    signum = unraisable.exc_value.signum
    while True:
        try:
            _switch(_at_once, _first)
            # to the main thread itself: a wait it is in (a rank's reply) ends, as for the first
            later = threading.Timer(0.05, signal.pthread_kill, (threading.main_thread().ident, signum))
            later.daemon = True
            later.start()
            return
        except Interrupted:  # the previous delivery came while this ran: once more
            continue


_hook = sys.unraisablehook


@contextlib.contextmanager
def caught():
    """Within: SIGINT and SIGTERM raise Interrupted, once; in the main thread only (Python's
    rule for handlers). A signal this process was started ignoring stays ignored: a shell
    starts background jobs with SIGINT ignored, and Ctrl-C is not theirs."""
    global _hook, _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _first)
    _hook, sys.unraisablehook = sys.unraisablehook, _swallowed
    _received = None
    try:
        yield
    finally:
        _received = None
        sys.unraisablehook = _hook
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
