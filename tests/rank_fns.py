"""Functions the tests send to ranks: module-level, so spawned ranks can import them."""

import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist

from tpdp_verify.ranks.rank import caught, device_mesh, device_type


def rank_and_sum(tag):
    t = torch.tensor([float(dist.get_rank())], device=device_type())
    dist.all_reduce(t)
    return dist.get_rank(), tag, t


def mesh_identity():
    mesh = device_mesh((2, 2), ("dp", "tp"))
    return id(mesh), mesh is device_mesh((2, 2), ("dp", "tp")), mesh.mesh_dim_names, mesh["tp"].size()


def wrong_mesh():
    device_mesh((3,))


def raise_on(rank):
    if dist.get_rank() == rank:
        raise ValueError(f"boom on {rank}")
    return "fine"


def raise_while_others_reduce(rank):
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} leaves the collective")
    dist.all_reduce(torch.ones(1))


def reduce_alone_then_raise():
    """Rank 0 starts an all_reduce the others never join, and every rank raises: rank 0's
    collectives are now one ahead of the others'."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(39), async_op=True)
    raise ValueError(f"rank {dist.get_rank()} raised")


def catch_while_others_reduce(rank):
    """``rank`` catches an exception and returns it, as the training loop does with a
    finding, while the others enter an all_reduce it never joins."""
    if dist.get_rank() == rank:
        caught(f"rank {rank} caught it")
        return "the error, in the result"
    dist.all_reduce(torch.ones(1))
    return "reduced"


_HOARD = []


def hoard(megabytes):
    """Keep ``megabytes`` of written memory alive in this rank: its RSS grows by as much."""
    _HOARD.append(torch.ones(megabytes << 18))
    return len(_HOARD)


def raise_in_loss_parallel():
    """Every rank raises inside torch's loss_parallel(), which (on 2.13) installs its loss
    handlers in DTensor's dispatcher before it yields and removes them after, outside
    ``finally``: the raise leaves them installed in the process."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        raise ValueError(f"rank {dist.get_rank()} raised inside loss_parallel")


def loss_handlers_installed():
    from tpdp_verify import torch_internals

    return "aten._log_softmax.default" in torch_internals.process_state()["DTensor's custom op handlers"]


def reduce_then_raise():
    """Every rank joins an all_reduce, then raises: the group stays in step."""
    dist.all_reduce(torch.ones(3))
    raise ValueError(f"rank {dist.get_rank()} raised after the collective")


def everyone_catches():
    caught(f"rank {dist.get_rank()} caught it")
    return dist.get_rank()


def lone_collective(rank):
    """``rank`` enters an all_reduce that no other rank joins: a real hang."""
    if dist.get_rank() == rank:
        dist.all_reduce(torch.ones(1))
    return "returned"


def barrier_unless(rank):
    """Every rank but ``rank`` waits in a barrier that ``rank`` never enters."""
    if dist.get_rank() != rank:
        dist.barrier()
    return "returned"


def die_on(rank, how):
    if dist.get_rank() == rank:
        if how == "exit":
            os._exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            ctypes.string_at(0)
        if how == "abort":  # as a C++ enforce in gloo's transport does
            os.abort()
    time.sleep(60)


def sleep_and_reduce(seconds):
    """Rank 0 sleeps while the others already wait for it in an all_reduce: a signal that
    cut either the sleep or the collective would show in the sum or as an error."""
    if dist.get_rank() == 0:
        time.sleep(seconds)
    t = torch.ones(1) * dist.get_rank()
    dist.all_reduce(t)
    return t


def sleep(seconds):
    time.sleep(seconds)
    return seconds


def return_dtensor():
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(torch.ones(2), device_mesh((dist.get_world_size(),)), [Replicate()])


def speak_and_say_parent():
    """Print on stdout and write to fd 2 as C++ would; return the process this rank forked from."""
    print(f"rank {dist.get_rank()} says hello", flush=True)
    os.write(2, f"rank {dist.get_rank()} writes to fd 2\n".encode())
    return os.getppid()


_RAN: list = []


def dies_after_another_run(rank):
    """``rank`` segfaults if its process has run this before: a fault an earlier case left."""
    if _RAN and dist.get_rank() == rank:
        ctypes.string_at(0)
    _RAN.append(rank)
    return dist.get_rank()


def observe_fsdp1_with(case, impl, keywords):
    """``observe(case, impl)`` with FSDP1 constructed with ``keywords`` beside its own."""
    import torch.distributed.fsdp as fsdp

    from tpdp_verify.ranks.tp_dp import observe

    real = fsdp.FullyShardedDataParallel

    class With(real):
        def __init__(self, module, **kwargs):
            super().__init__(module, **kwargs, **keywords)

    fsdp.FullyShardedDataParallel = With
    try:
        return observe(case, impl)
    finally:
        fsdp.FullyShardedDataParallel = real


def print_to_sys_stderr(text):
    """Python's print to ``sys.stderr``, as torch's Python warnings reach it."""
    import sys

    print(f"rank {dist.get_rank()} {text}", file=sys.stderr, flush=True)


def log_to_the_root_logger(text):
    """A record through Python's root logger, as a library's warning reaches it; the rank's
    tensor answer after it."""
    import logging

    logging.getLogger().warning("rank %d %s", dist.get_rank(), text)
    return torch.arange(4) + dist.get_rank()
