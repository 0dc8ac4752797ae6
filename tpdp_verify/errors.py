"""What can go wrong, and the exit code each failure maps to.

Exit codes (documented in docs/cli.md): 0 every check passed, 1 a divergence was
found, 2 usage or input error, 3 infrastructure failure (the harness itself: ranks that would not start, a check the
ranks could not run, an internal error of tpdp-verify). Ranks that crash or hang while
the code under test runs are a finding (tpdp_verify.runner.property.finding), so exit 1.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_DIVERGENCE = 1
EXIT_USAGE = 2
EXIT_INFRA = 3
EXIT_NOT_ASKED = 4


class UsageError(ValueError):
    """The caller asked for something that cannot work; the message says what to do."""

    exit_code = EXIT_USAGE


class PoolError(RuntimeError):
    """The ranks themselves failed (hang, crash, start-up); the pool respawns on next use."""

    exit_code = EXIT_INFRA


class RankTimeout(PoolError):
    """Some ranks did not answer within the call's timeout.

    ``stacks`` maps each silent rank to its Python stack (every thread) at the timeout;
    ``pending`` names the innermost torch.distributed frame they wait in ("" if none).
    """

    def __init__(self, message: str, silent: list[int], stacks: dict | None = None, pending: str = ""):
        super().__init__(message)
        self.silent = silent
        self.stacks = stacks or {}
        self.pending = pending


class RankDied(PoolError):
    """A rank process exited while the pool was waiting on it."""

    def __init__(self, message: str, rank: int, exitcode: int | None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.signal = _signal_name(exitcode)


def _signal_name(exitcode: int | None) -> str:
    """"SIGABRT" for a process killed by that signal; "" for one that exited."""
    import signal

    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class RankFailed(Exception):
    """The function raised on one or more ranks.

    ``tracebacks`` maps rank -> formatted traceback; ``exceptions`` maps rank -> the
    exception object where it could be pickled back; ``stuck`` lists ranks still busy
    after the grace period (the pool was restarted because of them).
    """

    exit_code = EXIT_DIVERGENCE

    def __init__(self, message: str, tracebacks: dict, exceptions: dict, stuck: list[int]):
        super().__init__(message)
        self.tracebacks = tracebacks
        self.exceptions = exceptions
        self.stuck = stuck
