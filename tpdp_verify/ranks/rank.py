"""The rank side of the pool (tpdp_verify.ranks.pool): what a spawned rank runs, and what the
functions sent by ``RankPool.run`` may use inside it (``device_mesh``, ``device_type``,
``caught``). A rank joins its process group, then answers each pickled call with one named
reply: ``Ok`` (the result, what the call caught, the rank's resident memory) or ``Error``
(the traceback and the pickled exception); the parent adds ``Stuck`` for a rank still
waiting after another raised."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import logging
import math
import os
import pickle
import shutil
import signal
import socket
import threading
import traceback
import warnings
from typing import Any, NamedTuple

from tpdp_verify.errors import UsageError
from tpdp_verify.files import inductor_cache

STOP = b"stop"  # the parent's last message to a rank


class Left(NamedTuple):
    """What a call left in its rank for the calls after it (pool.py decides by it whether
    the next call may run on these ranks)."""

    groups: tuple | None  # each group's (name, ranks, collectives issued); None: not observable
    changed: str = ""  # torch's process-wide state the call left changed, in words


class Ok(NamedTuple):
    result: Any
    caught: str = ""  # what the call caught and returned as a finding (``caught``)
    rss: int = 0  # the rank's resident bytes after the call
    left: Left | None = None


class Error(NamedTuple):
    traceback: str
    exception: bytes | None = None  # pickled, where it pickles
    left: Left | None = None


class Stuck(NamedTuple):
    """Not a rank's: the parent's word for a rank still busy after another raised."""

    why: str


Reply = Ok | Error | Stuck

_MESHES: dict = {}
_DEVICE_TYPE = "cpu"


class Stdio:
    """This process's stdout and stderr, sent to a rank as file descriptors (how
    multiprocessing passes a pipe), for a rank forked from a server that has none."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return Stdio.received, (DupFd(1), DupFd(2))

    @staticmethod
    def received(out, err) -> tuple[int, int]:
        return out.detach(), err.detach()


_CAUGHT = ""  # what the current call caught and returns in its result (see caught)
CAUGHT_PART = "signature part: "  # how a caught exception's signature part travels in its text


def on_device(kind: str) -> None:
    """This rank's device type from now on (a rank of an NCCL group: ``cuda``)."""
    global _DEVICE_TYPE
    _DEVICE_TYPE = kind


def device_type() -> str:
    """``"cuda"`` on an NCCL pool, ``"cpu"`` on gloo; call inside a rank."""
    return _DEVICE_TYPE


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """The rank's cached DeviceMesh for (shape, names), created collectively on first use.

    Every rank runs the same function with the same arguments, so every rank reaches
    the first use of a key at the same point and creates its subgroups together.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), tuple(names) if names is not None else None)
    mesh = _MESHES.get(key)
    if mesh is None:
        if math.prod(key[0]) != dist.get_world_size():
            raise UsageError(
                f"mesh {key[0]} holds {math.prod(key[0])} ranks but the pool has "
                f"{dist.get_world_size()}; choose a shape whose product is the world size"
            )
        mesh = _MESHES[key] = init_device_mesh(_DEVICE_TYPE, key[0], mesh_dim_names=key[1])
    return mesh


def caught(what: str, part: str = "") -> None:
    """Say, inside a rank, that this call caught an exception (``what``, and its signature
    part: tpdp_verify.signature) and returns it in its result, as a finding. Should other
    ranks then not answer, they are presumably waiting in a collective for this one: the
    pool gives them the error grace and restarts them, as when a rank raises, instead of
    waiting for the timeout (RankFailed, not a hang)."""
    global _CAUGHT
    _CAUGHT = what + (f"\n{CAUGHT_PART}{part}" if part else "")


def _loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def _portable(result: Any) -> Any:
    """Tensors come back detached and on CPU; DTensors must be made plain first."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only

    def plain(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            raise TypeError("a rank returned a DTensor; return .full_tensor() or .to_local()")
        return t.detach().cpu()

    return tree_map_only(torch.Tensor, plain, result)


def _rss() -> int:
    """This process's resident memory in bytes; 0 where /proc cannot say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _state() -> dict | None:
    from tpdp_verify import torch_internals

    try:
        return torch_internals.process_state()
    except Exception:  # a torch that reads otherwise: nothing can be said left unchanged
        return None


def _left(before: dict | None) -> Left:
    """What the call left: its groups' counts, and what it changed of the process's state
    (where either cannot be read, the pool takes the ranks for changed: fresh ones follow)."""
    from tpdp_verify import torch_internals

    try:
        groups = torch_internals.group_collectives()
    except Exception:
        groups = None
    after = _state()
    if before is None or after is None:
        return Left(groups, "torch's process-wide state could not be read")
    return Left(groups, torch_internals.changed(before, after))


def reply(call: bytes) -> bytes:
    """Run one pickled (fn, args) and pickle what happened: ok, the result, what it caught
    and the rank's resident memory after it; or error; and what the call left in the rank."""
    global _CAUGHT
    _CAUGHT = ""
    before = _state()
    try:
        fn, args = pickle.loads(call)
        result = _portable(fn(*args))
        from tpdp_verify.ranks import wire

        return wire.dumps(Ok(result, _CAUGHT, _rss(), _left(before)))
    except Exception as exc:  # report every failure; BaseException still ends the rank
        try:
            exc_bytes = pickle.dumps(exc)
        except Exception:
            exc_bytes = None
        return pickle.dumps(Error(traceback.format_exc(), exc_bytes, _left(before)))


def _exit_when_orphaned(lifeline, stack_file: str) -> None:
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    # the parent is gone (killed, it could not clean up): nobody will ever ask this rank
    # anything again, nor read the directory of the ranks' stacks it made
    shutil.rmtree(os.path.dirname(stack_file), ignore_errors=True)
    os._exit(70)


def main(rank, world_size, backend, port, conn, lifeline, timeout_s, stack_file, log_file=None,
               stdio=(1, 2)) -> None:
    """Entry point of a spawned rank: join the group, then serve calls until told to stop."""
    if log_file:  # stdout and stderr, C++'s included (torch's warnings, gloo's logs), to the file
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    else:  # the parent's, as Stdio sent them
        for fd, target in zip(stdio, (1, 2)):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # On SIGUSR1 the rank writes every thread's Python stack, even when stuck in C++
    # (a collective): what the parent reports for a hang.
    # chain=False: the handler is installed with SA_RESTART, so a dump never interrupts a call.
    faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=True, chain=False)
    # DTensor's advice to construct from detached tensors fires inside torch's own
    # redistribute; on every rank and every example it would bury the report.
    warnings.filterwarnings("ignore", message="To construct DTensor from torch.Tensor")
    # FSDP2's advice against in-place ops on a view its root returns: the loop makes none.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # A failed shape propagation logs its traceback before raising; the raise is reported.
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    threading.Thread(target=_exit_when_orphaned, args=(lifeline, stack_file), daemon=True).start()
    try:
        # Spawned ranks are on one host: their listeners (gloo's pairs, NCCL's bootstrap) go on
        # the loopback interface whatever the environment names for multi-host runs.
        loopback = _loopback_interface()
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
        os.environ["NCCL_SOCKET_IFNAME"] = loopback
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache())  # as the fork server's
        import torch
        import torch.distributed as dist

        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if backend == "nccl":
            torch.cuda.set_device(rank)
            on_device("cuda")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        # What every reply needs (_portable), imported now, under the start-up timeout: on a
        # busy machine a generation's first call would otherwise spend seconds of its own
        # timeout importing DTensor, and a short timeout would call that a hang.
        import torch.distributed.tensor  # noqa: F401
        import torch.utils._pytree  # noqa: F401
        # What the rank holds now (torch's modules, the group) lives as long as the rank:
        # kept out of the garbage collector's passes, whose full ones would walk it all
        # (a third of a second each at world size 4; docs/performance.md).
        gc.freeze()
    except Exception:
        conn.send_bytes(pickle.dumps(Error(traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(Ok("ready", "", _rss())))
    while True:
        try:
            call = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if call == STOP:
            break
        conn.send_bytes(reply(call))
    dist.destroy_process_group()
