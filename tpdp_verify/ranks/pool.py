"""Persistent ranks: spawn once, then run many checks on one real process group.

``RankPool(world_size)`` spawns ``world_size`` processes that join a process group
(gloo on CPU, NCCL when every rank has its own GPU) through a TCPStore the parent
hosts on 127.0.0.1, on a port the OS picks, so pools never collide.  The ranks then
serve ``pool.run(fn, *args)`` until the pool is closed.  Every socket of a spawned pool
listens on the loopback interface only, the store's and the ranks' own (gloo's, NCCL's
bootstrap): the store has no authentication, and whoever reached it could write the
group's keys.

The parent is the judge of liveness: a call that some ranks do not answer within its
timeout, or a rank that dies, tears the ranks down (SIGKILL) and the next call spawns
fresh ones; so does a call that raised with a group out of step or left torch's
process-wide state changed (``_keeps``), so that no call's outcome depends on the ones
before it.  Ranks cannot outlive the parent: each watches a lifeline pipe whose only
writer is the parent, and exits when it closes, however the parent ended.

Started under torchrun (``RANK`` and ``WORLD_SIZE`` in the environment), the same API
attaches to the launcher's process group instead: ``run`` calls ``fn`` on this rank and
all-gathers the replies, so every rank sees every result.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import weakref
from typing import Any, Callable

from tpdp_verify import stacks as stacks_of
from tpdp_verify.errors import PoolError, RankDied, RankFailed, RankTimeout, UsageError
from tpdp_verify.files import inductor_cache
from tpdp_verify.ranks import rank as rank_side
from tpdp_verify.ranks.rank import Error, Ok, Reply, Stuck

# What the gate and the pytest plugin pass as max_rss_growth: a rank seeing new shapes
# grows steadily (torch's shape-keyed caches), about 60 KB a training case; recycling it
# once it has grown 8% keeps it under 10% (bench/bench_endurance.py, docs/performance.md)
# and costs a fresh generation, about 3 s, every few hundred such cases.
MAX_RSS_GROWTH = 0.08
BASELINE_CALL = 20  # a generation's size is taken after this call: imports and meshes are in
# the shortest hang timeout after a first hang (RankPool's after_hang): a first call after a
# respawn (meshes, imports) takes a few seconds on 2 cores, a release case at world size 8 more
HANG_FLOOR = 20.0
# a call the ranks have not answered for this long is said to be waiting, and where, once: a
# hang is otherwise silent until the call's timeout (two minutes by default)
WAITING_NOTICE = 10.0

# What a rank imports before its first call, once, in the fork server the ranks fork from.
# torch._dynamo: DTensor and FSDP import it on a rank's first call (a second on 2 cores).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.fsdp", "torch._dynamo", "torch.utils._pytree", "numpy.random",
           "tpdp_verify.ranks.tp_dp", "tpdp_verify.ranks.checkpoint"]


def _context():
    """Ranks fork from a server that imported torch once, where the platform forks: each
    spawned rank importing torch itself costs seconds, and 4 ranks on 2 cores wait for each
    other's. The server is a fresh interpreter (nothing of this process's state, threads or
    patches goes with it); each rank still imports ``__main__`` and the caller's sys.path
    as a spawned one would. ``TPDP_VERIFY_START_METHOD=spawn`` spawns each rank afresh
    (bench/bench_plan.py compares the two)."""
    wanted = os.environ.get("TPDP_VERIFY_START_METHOD", "forkserver")
    if wanted != "forkserver" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def warm_up(modules: tuple[str, ...] = (), here: bool = False) -> None:
    """Start the fork server now, with ``modules`` too (a user's model module, which may
    import transformers), if it is not running yet. A module that fails to import there is
    imported by each rank as usual.

    ``here``: this process is a command that has computed nothing yet (the CLI, first
    thing): it imports what the server would and forks the server from itself, so a command
    imports torch once, not twice (about 3 CPU-seconds of each ``gate`` and ``plan``; every
    short one pays it whole, docs/performance.md). Otherwise (a library call, after whatever
    the caller ran) the server is a fresh interpreter whose imports overlap the caller's."""
    if _under_launcher():
        return
    ctx = _context()
    if ctx.get_start_method() != "forkserver":
        return
    preload = PRELOAD + [m for m in modules if m not in PRELOAD]
    ctx.set_forkserver_preload(preload)
    _start_server(ctx, preload if here else None)


def _start_server(ctx, fork_after: list[str] | None = None) -> None:
    """The fork server, started with no terminal: a spawned one outlives this process by
    its imports' seconds, and holding this process's stdout would keep a pipe reading it
    open that long. Each rank gets this process's stdout and stderr itself (``rank.Stdio``).
    ``fork_after``: this process imports those modules and forks the server from itself
    (``_fork_server``), where this Python's multiprocessing allows it."""
    from multiprocessing import forkserver

    if ctx.get_start_method() != "forkserver" or forkserver._forkserver._forkserver_pid is not None:
        return
    _short_socket_dir()
    with _this_sys_path():
        if fork_after is not None and _forkable():
            for name in fork_after:  # as the spawned server does: what fails is each rank's to import
                with contextlib.suppress(Exception):
                    __import__(name)
        try:
            saved = [os.dup(fd) for fd in (0, 1, 2)]
        except OSError:  # a process without all three (a daemon): the server gets what there is
            forkserver.ensure_running()
            return
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:  # what this process printed goes out now, not to /dev/null below
                stream.flush()  # (and a forked server has none of it in a buffer to write again)
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            if not (fork_after is not None and _forkable() and _fork_server()):
                forkserver.ensure_running()
        finally:
            for fd, old in zip((0, 1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
            os.close(null)


def _forkable() -> bool:
    """Whether the fork server can be forked from this process: one Python thread (a fork
    copies only the caller's), and this Python's forkserver as ``_fork_server`` knows it
    (Python 3.11's; one that differs, say by a key on its control socket, is spawned)."""
    import inspect
    import threading
    from multiprocessing import forkserver

    server = forkserver._forkserver
    return (hasattr(os, "fork") and threading.active_count() == 1
            and list(inspect.signature(forkserver.main).parameters) == ["listener_fd", "alive_r", "preload",
                                                                         "main_path", "sys_path"]
            and all(hasattr(server, a) for a in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid"))
            and not hasattr(server, "_forkserver_authkey"))


def _fork_server() -> bool:
    """multiprocessing's ``ForkServer.ensure_running``, with the server forked from this
    process instead of spawned: the same listener, the same "alive" pipe (the server ends
    when every holder of its write end has), the same loop (``forkserver.main``) with
    nothing left to import. The server keeps only the descriptors a spawned one gets, and
    the signal handlers and hooks of a fresh interpreter, not this command's."""
    from multiprocessing import connection, forkserver, resource_tracker

    resource_tracker.ensure_running()  # its descriptor goes to each rank, from this process
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()  # this process's streams flushed (_start_server)
    if pid == 0:  # the server: never returns
        code = 1
        try:
            _as_a_fresh_interpreter(keep={listener.fileno(), alive_r})
            forkserver.main(listener.fileno(), alive_r, [], None, None)
        except SystemExit:  # every client gone: main's own way out
            code = 0
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _as_a_fresh_interpreter(keep: set[int]) -> None:
    """In the forked server: the descriptors, signal handlers, hooks and standard streams a
    spawned server starts with (descriptors 0-2 are /dev/null already), so neither it nor
    the ranks it forks hold this command's pipes or run its handlers. ``sys.stderr`` too: a
    caller that replaced it (pytest's capture, a notebook) would otherwise have each rank
    print into a copy of that object, not to its descriptor 2, which holds its log.

    The caller's other descriptors are pointed at /dev/null, not closed: its Python objects
    that hold them (a logging handler's file, as pytest's on /dev/null) live on here and in
    each rank, and a closed number is the next one a rank opens, its connection to the
    parent among them: a warning logged through the root logger went into that connection."""
    import logging
    import warnings

    for name in ("stdin", "stdout", "stderr"):
        if getattr(sys, f"__{name}__") is not None:
            setattr(sys, name, getattr(sys, f"__{name}__"))

    fds = [int(n) for n in os.listdir("/proc/self/fd")] if os.path.isdir("/proc/self/fd") else range(3, 1024)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd > 2 and fd not in keep and fd != null:
            with contextlib.suppress(OSError):  # not open: the listing's own, the fallback's range
                os.fstat(fd)
                os.dup2(null, fd)
    os.close(null)
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    sys.unraisablehook = sys.__unraisablehook__
    warnings.showwarning = getattr(warnings, "_showwarning_orig", warnings.showwarning)
    root = logging.getLogger()  # the caller's configuration of it (pytest's handlers, a notebook's)
    for handler in root.handlers[:]:  # writes nowhere here: a rank's records go to its stderr, as spawned
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


def _server_died() -> str:
    """Why the ranks' fork server would end as it starts a rank, in a line: it imports torch
    and the preloaded modules with this process's sys.path, whose first entry is the script's
    (or the current) directory, so a file there named as a standard module (enum.py, types.py)
    stands in for it. This process imported the real one before that entry was put first."""
    shadows = sorted(f"{os.path.join(d or os.getcwd(), name)}.py" for d in sys.path[:1]
                     for name in getattr(sys, "stdlib_module_names", ())
                     if os.path.isfile(os.path.join(d or os.getcwd(), f"{name}.py")))
    return ("the ranks' fork server ended as it started a rank"
            + (f": {', '.join(shadows)} shadows the standard library's module of that name there; rename it"
               if shadows else "; TPDP_VERIFY_START_METHOD=spawn starts each rank afresh and shows its error"))


# An AF_UNIX socket's path holds at most 107 bytes; the fork server's is
# TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, 33 bytes past TMPDIR.
_SOCKET_PATH_MAX, _SOCKET_PAST_TMPDIR = 107, 33


def _short_socket_dir() -> None:
    """Where TMPDIR is too long for the fork server's socket (a CI job's, pytest's nested
    temp dirs), multiprocessing's own temp dir (it holds the socket, and goes at exit) is
    made in the system's default instead, /tmp: binding the socket would fail."""
    from multiprocessing import util

    if len(tempfile.gettempdir()) + _SOCKET_PAST_TMPDIR <= _SOCKET_PATH_MAX or not os.access("/tmp", os.W_OK):
        return
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        util.get_temp_dir()  # made once a process, and kept: the socket goes there
    finally:
        tempfile.tempdir = saved


@contextlib.contextmanager
def _this_sys_path():
    """The fork server imports from this process's sys.path, as its ranks do. Python before
    3.13 starts it with ``-c`` and drops the path multiprocessing hands it, so it would
    import from the working directory first: from a checkout's root, its ``tpdp_verify``
    folder (or a folder named like any module PRELOAD lists) would stand for the installed
    package in every rank. PYTHONSAFEPATH (3.11+) keeps the working directory out. Its
    imports make torch inductor's cache directory, in the temp dir unless one is named, and
    leave it there: it goes with tpdp-verify's cache where the user names none (the ranks'
    too, ``rank.main``)."""
    keys = ("PYTHONPATH", "PYTHONSAFEPATH", "TORCHINDUCTOR_CACHE_DIR")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    os.environ["PYTHONSAFEPATH"] = "1"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _choose_backend(backend: str, world_size: int) -> str:
    import torch

    if backend not in ("auto", "gloo", "nccl"):
        raise UsageError(f"backend must be auto, gloo or nccl, not {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise UsageError(
            f"backend nccl needs one GPU a rank: {world_size} ranks, {gpus} GPUs; "
            "use --tpdp-backend gloo or fewer ranks"
        )
    return backend


def _loopback_store(world_size: int, timeout: float):
    """The parent's TCPStore, listening on 127.0.0.1 only. Given a host, TCPStore still
    listens on every interface (``::``, IPv4 too), so it gets a socket already bound here
    (``master_listen_fd``), which it owns from then on and closes with itself."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one
        listener.listen(world_size + 1)
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    return dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout), master_listen_fd=listener.detach())


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# After a rank raised, the others are given the error grace to finish; ranks that used no
# CPU for IDLE_WINDOW seconds (IDLE_CPU at most, each) are blocked in a collective for it,
# and reported stuck at once. A rank that computes, even starved on a loaded machine, uses
# far more. Where /proc is missing, the grace is waited out.
IDLE_WINDOW, IDLE_CPU, IDLE_POLL = 1.0, 0.02, 0.25


class _Idleness:
    """Whether ranks used (almost) no CPU over the last IDLE_WINDOW seconds."""

    def __init__(self, pids: list[int]):
        self.pids, self.since = pids, time.monotonic()
        self.used = self._cpu()

    def _cpu(self) -> dict[int, float] | None:
        ticks, out = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100, {}
        for rank, pid in enumerate(self.pids):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                return None
            out[rank] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        return out

    def __call__(self, ranks: list[int]) -> bool:
        if self.used is None or time.monotonic() - self.since < IDLE_WINDOW:
            return False
        now = self._cpu()
        if now is None:
            return False
        idle = all(now[r] - self.used[r] <= IDLE_CPU for r in ranks)
        self.since, self.used = time.monotonic(), now
        return idle


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _shutdown(procs, conns, lifeline, graceful: bool, stack_dir: str = "") -> None:
    """Stop the ranks: ask politely if idle, SIGKILL whatever is left after a moment."""
    if graceful:
        for conn in conns:
            try:
                conn.send_bytes(rank_side.STOP)
            except OSError:
                pass
        deadline = time.monotonic() + 10.0
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()
    for conn in (*conns, lifeline):
        conn.close()
    if stack_dir:
        shutil.rmtree(stack_dir, ignore_errors=True)


class _Ranks:
    """One generation of spawned ranks; a hang, a death, or a call that leaves them unfit for
    the next (``_keeps``) retires it and the pool makes another."""

    def __init__(self, world_size: int, backend: str, start_timeout: float, pg_timeout: float,
                 output: str | None = None):
        ctx = _context()
        _start_server(ctx)
        self.limit = start_timeout  # the running call's timeout, for its message
        self.store = _loopback_store(world_size, start_timeout)
        lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
        self.procs, self.conns = [], []
        self.stack_dir = tempfile.mkdtemp(prefix="tpdp-stacks-")
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=rank_side.main,
                args=(rank, world_size, backend, self.store.port, child_end, lifeline_r, pg_timeout,
                      os.path.join(self.stack_dir, f"rank{rank}.txt"),
                      output and os.path.join(output, f"world{world_size}-rank{rank}.log"),
                      (1, 2) if output else rank_side.Stdio()),
                name=f"tpdp-rank-{rank}",
                daemon=True,
            )
            try:
                proc.start()
            except EOFError:  # the fork server died importing what every rank imports
                raise PoolError(_server_died()) from None
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        lifeline_r.close()
        self.lifeline = lifeline_w
        self.busy = False
        self.asked = 0  # calls sent to this generation
        self.calls = 0  # calls this generation has answered
        self.baseline: dict[int, int] = {}  # rank -> resident bytes after call BASELINE_CALL
        self.outgrown = False  # a rank has grown past the pool's max_rss_growth
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, lifeline_w, True,
                                           self.stack_dir)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stacks(self, ranks: list[int], wait: float = 2.0) -> dict[int, str]:
        """Each live rank's Python stack, every thread, as faulthandler writes it on SIGUSR1."""
        paths = {r: os.path.join(self.stack_dir, f"rank{r}.txt") for r in ranks if self.procs[r].is_alive()}
        for r, p in paths.items():
            with contextlib.suppress(OSError):
                os.truncate(p, 0)  # an earlier dump's: the rank writes on at its offset, after zeros
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        deadline, sizes = time.monotonic() + wait, {}
        while time.monotonic() < deadline:  # until every file is written and stops growing
            time.sleep(0.1)
            now = {r: os.path.getsize(p) if os.path.exists(p) else 0 for r, p in paths.items()}
            if all(now.values()) and now == sizes:
                break
            sizes = now
        out = {}
        for r, p in paths.items():
            with contextlib.suppress(OSError), open(p) as f:
                out[r] = f.read().lstrip("\x00")
        return out

    def close(self, graceful: bool = True) -> None:
        self._finalizer.detach()
        _shutdown(self.procs, self.conns, self.lifeline, graceful and not self.busy, self.stack_dir)

    def collect(self, what: str, deadline: float, grace: float,
                waiting: Callable[[str], None] | None = None) -> dict[int, Reply]:
        """Wait for one reply from every rank, or raise on timeout or death; ``waiting`` is told
        once, WAITING_NOTICE seconds on, which ranks have not answered and where they wait."""
        pending = dict(enumerate(self.conns))
        replies: dict[int, Reply] = {}
        graced, idle = False, None
        notice = time.monotonic() + WAITING_NOTICE if waiting else math.inf
        while pending:
            left = deadline - time.monotonic()
            blocked = graced and idle(sorted(pending))  # waiting in a collective for the rank that raised
            if left <= 0 or blocked:
                if graced:  # an error came first: report it, naming who was stuck and how it showed
                    why = (f"blocked {IDLE_WINDOW:g} s later, using no CPU (waiting in a collective for the "
                           "failed rank)") if blocked else f"busy {grace:g} s later (waiting in a collective for the failed rank?)"
                    return replies | {r: Stuck(why) for r in pending}
                stacks = self.stacks(sorted(pending))
                pending_in = stacks_of.pending(stacks)
                raise RankTimeout(
                    f"{_ranks_text(pending)} of {len(self.conns)} did not answer within the "
                    f"{self.limit:g} s timeout running {what}"
                    + (f" ({_ranks_text(replies)} answered)" if replies else "")
                    + "; the ranks were killed and the next run respawns them"
                    + (f"\npending: {pending_in}" if pending_in else ""),
                    sorted(pending), stacks, pending_in,
                )
            waitables = {c: r for r, c in pending.items()}
            waitables |= {self.procs[r].sentinel: r for r in pending}
            wait = min(left, IDLE_POLL) if graced else min(left, max(0.0, notice - time.monotonic()))
            for ready in multiprocessing.connection.wait(list(waitables), timeout=wait):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                conn = pending[rank]
                try:
                    if ready is not conn and not conn.poll():
                        raise EOFError
                    replies[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self.procs[rank].join(5.0)
                    code = self.procs[rank].exitcode
                    raise RankDied(
                        f"rank {rank} of {len(self.conns)} {_describe_exit(code)} while running "
                        f"{what}; the ranks were killed and the next run respawns them",
                        rank, code,
                    ) from None
                del pending[rank]
            if pending and time.monotonic() >= notice:
                notice = math.inf
                waiting(self._waiting(what, sorted(pending)))
            if not graced and pending and _raised(replies):
                graced, idle = True, _Idleness([p.pid for p in self.procs])
                deadline = min(deadline, time.monotonic() + grace)
        return replies

    def _waiting(self, what: str, pending: list[int]) -> str:
        stacks = self.stacks(pending)
        inside = stacks_of.pending(stacks) or "; ".join(
            f"rank {r} {stacks_of.where(stacks_of.frames(d))}" for r, d in sorted(stacks.items()) if d)
        return (f"{_ranks_text(pending)} of {len(self.conns)} {'has' if len(pending) == 1 else 'have'} not answered "
                f"{what} for {WAITING_NOTICE:g} s"
                + (f"; waiting in {inside}" if inside else "")
                + f"; they count as hung at the {self.limit:g} s timeout")

    def note(self, replies: dict[int, Reply], growth: float) -> None:
        """Count an answered call and watch the ranks' memory against their baseline."""
        self.calls += 1
        rss = {r: reply.rss for r, reply in replies.items() if isinstance(reply, Ok)}
        if self.calls == BASELINE_CALL:
            self.baseline = rss
        self.outgrown = any(rss.get(r, 0) > size * (1 + growth) for r, size in self.baseline.items() if size)

    def call(self, payload: bytes, what: str, timeout: float, grace: float,
             waiting: Callable[[str], None] | None = None) -> dict[int, Reply]:
        self.busy, self.limit = True, timeout
        self.asked += 1
        for conn in self.conns:
            conn.send_bytes(payload)
        replies = self.collect(what, time.monotonic() + timeout, grace, waiting)
        self.busy = any(isinstance(r, Stuck) for r in replies.values())
        return replies


def _raised(replies: dict[int, Reply]) -> bool:
    """Whether the code a run called raised on some rank (or a rank caught what it raised)."""
    return any(isinstance(r, Error) or (isinstance(r, Ok) and r.caught) for r in replies.values())


def _in_step(replies: dict[int, Reply]) -> bool:
    """Whether every member of every group has issued as many collectives as the others.
    Ranks that raise part-way through their collectives can leave bytes sent and never
    read in a group, and the next run's collective would read them (gloo aborts a rank on
    a size it did not expect, and takes equal sizes for data); in step, none is left."""
    counts: dict[str, dict[int, int]] = {}
    members: dict[str, set[int]] = {}
    for rank, reply in replies.items():
        groups = reply.left.groups if getattr(reply, "left", None) else None
        if groups is None:
            return False
        for name, ranks, issued in groups:
            counts.setdefault(name, {})[rank] = issued
            members[name] = set(ranks)
    return all(set(by_rank) == members[name] and len(set(by_rank.values())) == 1
               for name, by_rank in counts.items())


def _keeps(replies: dict[int, Reply]) -> bool:
    """Whether the ranks that answered ``replies`` may take the next call, so that no case's
    outcome depends on the cases before it. Not when the call left torch's process-wide
    state changed on some rank (a mode, a table DTensor reads on every op: loss_parallel
    leaves its handlers installed when its body raises). Not when it raised on some rank
    (or a rank caught what it raised) with a group out of step. Ranks that raised in step,
    as torch's own checks raise on every rank alike, keep their warm caches: a fresh
    generation's first call costs about three times a warm one's (docs/performance.md)."""
    if any(getattr(reply, "left", None) is None or reply.left.changed for reply in replies.values()):
        return False
    return not _raised(replies) or _in_step(replies)


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _output_directory(path: str) -> str:
    """The ranks' output directory, made where it is missing (else each rank would die at
    start-up opening its log there, and say nothing of why)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot make the ranks' output directory {path}: {exc.strerror}; "
                         "give a directory you can write to") from None
    return path


class RankPool:
    """``world_size`` ranks on a real process group, kept for many ``run`` calls.

    Args:
        world_size: number of ranks; under torchrun, ``None`` or the launcher's size.
        backend: ``"auto"`` (NCCL when there is one GPU a rank, else gloo), ``"gloo"``
            or ``"nccl"``.
        timeout: seconds a ``run`` may take before the silent ranks are declared hung.
        start_timeout: seconds the ranks may take to start and join the group.
        error_grace: after a rank raises, seconds the others get to finish before they
            are presumed stuck in a collective with it and the pool is restarted.
        max_rss_growth: once a rank's resident memory exceeds its size after its
            generation's 20th call by this fraction, the pool stops the generation and
            the next call spawns a fresh one (``None``: never). Torch caches sharding
            decisions and fake-tensor dispatches per tensor shape, without bound, so a
            rank that sees thousands of new shapes grows steadily (docs/performance.md).
            Spawned pools on Linux only: under torchrun the launcher owns the ranks.
        output: a directory for the ranks' stdout and stderr, C++'s included (torch's
            warnings, gloo's logs): a file a rank (``world<N>-rank<R>.log``), appended to by
            each generation. ``None``: the terminal's, as the parent's.
        after_hang: once a run has hung, later runs count as hung after this many times
            the slowest run that answered (at least HANG_FLOOR seconds, at most
            ``timeout``), unless a run names its own timeout. A build that hangs once
            hangs in many cases, and shrinking replays them: each would cost the whole
            timeout. ``None``: always ``timeout``.
    """

    def __init__(
        self,
        world_size: int | None = None,
        backend: str = "auto",
        *,
        timeout: float = 120.0,
        start_timeout: float = 180.0,
        error_grace: float = 10.0,
        max_rss_growth: float | None = None,
        after_hang: float | None = None,
        output: str | None = None,
        waiting: Callable[[str], None] | None = None,
    ):
        self.attached = _under_launcher()
        if self.attached:
            launched = int(os.environ["WORLD_SIZE"])
            if world_size not in (None, launched):
                raise UsageError(
                    f"torchrun launched {launched} ranks but the pool asked for {world_size}; "
                    "pass world_size=None or match --nproc-per-node"
                )
            world_size = launched
        if not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"world_size must be a positive integer, not {world_size!r}")
        if timeout <= 0 or start_timeout <= 0 or error_grace < 0:
            raise UsageError("timeout and start_timeout must be positive, error_grace non-negative")
        if max_rss_growth is not None and not (isinstance(max_rss_growth, (int, float)) and max_rss_growth > 0):
            raise UsageError(f"max_rss_growth must be a positive fraction (0.08: 8%) or None, not {max_rss_growth!r}")
        self.world_size = world_size
        self.backend = _choose_backend(backend, world_size)
        self.timeout, self.start_timeout, self.error_grace = timeout, start_timeout, error_grace
        self.max_rss_growth = max_rss_growth
        self.after_hang = after_hang
        self.output = output and _output_directory(output)
        self.waiting = waiting  # told when a call has gone unanswered for WAITING_NOTICE seconds
        self.hung = False  # a run has hung (see after_hang)
        self.slowest = 0.0  # seconds of the slowest run that answered
        self.spawns = 0  # how many generations of ranks this pool has started
        self._ranks: _Ranks | None = None
        if self.attached:
            self._owns_group = self._attach()
        else:
            self._start()

    # -- lifecycle ---------------------------------------------------------

    def _start(self) -> None:
        self._ranks = _Ranks(
            self.world_size, self.backend, self.start_timeout, self.timeout + self.start_timeout, self.output
        )
        self.spawns += 1
        try:
            replies = self._ranks.collect("start-up", time.monotonic() + self.start_timeout, 0.0)
            errors = {r: reply.traceback for r, reply in replies.items() if isinstance(reply, Error)}
            if errors:
                rank = min(errors)
                raise PoolError(
                    f"{_ranks_text(errors)} failed to join the {self.backend} process group; "
                    f"rank {rank}:\n{errors[rank]}"
                )
        except BaseException:  # PoolError, or interrupted while the ranks start: none is left behind
            self._retire(graceful=False)
            raise

    def _attach(self) -> bool:
        import torch
        import torch.distributed as dist

        if self.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            rank_side.on_device("cuda")
        if dist.is_initialized():
            return False
        dist.init_process_group(self.backend, timeout=datetime.timedelta(seconds=self.timeout))
        return True

    def _retire(self, graceful: bool) -> None:
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            ranks.close(graceful)

    def close(self) -> None:
        """Stop the ranks (idempotent). Attached pools leave the launcher's group alone."""
        if self.attached:
            if self._owns_group:
                import torch.distributed as dist

                dist.destroy_process_group()
                self._owns_group = False
            return
        self._retire(graceful=True)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the current ranks (empty when attached or between generations)."""
        return self._ranks.pids if self._ranks else []

    @property
    def fresh(self) -> bool:
        """Whether the next call runs on ranks that have run nothing before it (a new
        generation); never under a launcher, whose ranks are the job's."""
        return not self.attached and (self._ranks is None or self._ranks.outgrown or not self._ranks.asked)

    def __repr__(self) -> str:
        mode = "attached" if self.attached else f"spawns={self.spawns}"
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, {mode})"

    # -- calls -------------------------------------------------------------

    def run(self, fn: Callable, /, *args: Any, timeout: float | None = None) -> list:
        """Run ``fn(*args)`` on every rank; return the results in rank order.

        ``fn`` and ``args`` must be picklable (a module-level function, plain data).
        Raises RankFailed when ``fn`` raised on any rank, RankTimeout or RankDied (both
        PoolError) when ranks hung or died; after those the next call respawns the ranks.
        """
        what = f"`{_name(fn)}`"
        try:
            payload = pickle.dumps((fn, args))
        except Exception as exc:
            raise UsageError(
                f"cannot send {what} to the ranks ({exc}); use a module-level function and "
                "picklable arguments"
            ) from None
        if self.attached:
            replies = self._gather_attached(payload)
        else:
            if self._ranks is not None and self._ranks.outgrown:
                self._retire(graceful=True)  # before the call, so the ranks that answered stay up
            if self._ranks is None:
                self._start()
            start = time.monotonic()
            try:
                replies = self._ranks.call(payload, what, timeout or self._timeout(), self.error_grace, self.waiting)
            except BaseException as exc:  # hang, death, or the caller interrupted (Ctrl-C, timeout)
                self.hung = self.hung or isinstance(exc, RankTimeout)
                self._retire(graceful=False)
                raise
            self.slowest = max(self.slowest, time.monotonic() - start)
            if self._ranks.busy or not _keeps(replies):
                self._retire(graceful=False)
            elif self.max_rss_growth:
                self._ranks.note(replies, self.max_rss_growth)
        return self._results(what, replies)

    def _timeout(self) -> float:
        if not (self.hung and self.after_hang):
            return self.timeout
        return min(self.timeout, max(HANG_FLOOR, self.after_hang * self.slowest))

    def _gather_attached(self, payload: bytes) -> dict[int, Reply]:
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, rank_side.reply(payload))
        return {rank: pickle.loads(reply) for rank, reply in enumerate(gathered)}

    def _results(self, what: str, replies: dict[int, Reply]) -> list:
        errors = {r: reply for r, reply in replies.items() if isinstance(reply, Error)}
        stuck = sorted(r for r, reply in replies.items() if isinstance(reply, Stuck))
        stuck_why = next((reply.why for reply in replies.values() if isinstance(reply, Stuck)), "")
        if not errors and not stuck:
            return [replies[r].result for r in range(self.world_size)]
        if not errors:  # ranks that caught an exception left the others in a collective
            errors = {r: Error(f"(caught and returned) {reply.caught}")
                      for r, reply in replies.items() if isinstance(reply, Ok) and reply.caught}
        exceptions = {}
        for rank, error in errors.items():
            try:
                exceptions[rank] = pickle.loads(error.exception) if error.exception else None
            except Exception:
                exceptions[rank] = None
        first = min(errors)
        message = f"{what} raised on {_ranks_text(errors)} of {self.world_size}"
        if stuck:
            message += (
                f"; {_ranks_text(stuck)} {'was' if len(stuck) == 1 else 'were'} still {stuck_why}, "
                "so the ranks were restarted"
            )
        message += f"\n--- rank {first} ---\n{errors[first].traceback.rstrip()}"
        raise RankFailed(message, {r: e.traceback for r, e in errors.items()}, exceptions, stuck)


class Pools:
    """Pools of ranks, one per world size, each started on first use (a pytest session's)."""

    def __init__(self, backend: str, timeout: float, output: str | None = None):
        self.backend, self.timeout, self.output = backend, timeout, output
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size, self.backend, timeout=self.timeout,
                                              max_rss_growth=MAX_RSS_GROWTH, output=self.output)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
