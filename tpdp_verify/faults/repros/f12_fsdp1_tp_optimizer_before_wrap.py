"""Fault 12 (torch 2.13.0): with TP, FSDP1 trains nothing an optimizer built before wrapping holds.

FSDP1 with use_orig_params=True keeps the user's parameter objects, so an optimizer built
before wrapping trains the model: plain FSDP1 does. With TP the parameters are DTensors;
FlatParamHandle._init_flat_param_and_metadata (torch/distributed/fsdp/_flat_param.py) flattens
each one's local shard (DTensorExtensions.pre_flatten_transform) and keeps *that* as the
original parameter (_convert_to_params), so the module computes with new tensors and the
optimizer's DTensors get no gradient: the step moves nothing. A (dp=2, tp=1) mesh is the
smallest world; a (2, 2) mesh on 4 ranks does the same. Run: python f12_fsdp1_tp_optimizer_before_wrap.py
"""

import datetime
import os
import signal
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD, TIMEOUT = 2, 60


def one_step(model, fsdp_kwargs=None) -> tuple[float, list[bool]]:
    """Build SGD on `model`, wrap it in FSDP1 (unless fsdp_kwargs is None: one device) and
    take one step: (largest change of a parameter the model computes with, for each
    parameter the optimizer holds whether it got a gradient)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # before wrapping, as plain FSDP1 allows
    if fsdp_kwargs is not None:
        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"), **fsdp_kwargs)
    local = lambda t: (t.to_local() if isinstance(t, DTensor) else t).detach().clone()  # noqa: E731
    before = [local(p) for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()  # the same batch on every rank
    optimizer.step()
    moved = max((local(p) - b).abs().max().item() for p, b in zip(model.parameters(), before) if b.numel())
    return moved, [p.grad is not None for p in optimizer.param_groups[0]["params"]]


def on_rank(rank: int, send) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    models = {k: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)) for k in ("one", "plain", "tp")}
    for model in models.values():
        model.load_state_dict(models["one"].state_dict())
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))
    parallelize_module(models["tp"], mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    send("one", one_step(models["one"]))
    send("plain", one_step(models["plain"], {"process_group": dist.group.WORLD}))
    send("tp", one_step(models["tp"], {"device_mesh": mesh["dp"]}))


# --- boilerplate: gloo ranks on loopback, joined with a timeout --------------------------

def rank_entry(rank: int, port: int, queue) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo listens on loopback only
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    # on_rank sends plain values (no tensors) as it goes; an exception it lets out is a bug of this file
    on_rank(rank, lambda key, value: queue.put((rank, key, value)))
    queue.put((rank, "done", True))
    dist.destroy_process_group()


def launch() -> tuple[dict, dict]:
    """Run on_rank on WORLD ranks: ({rank: {key: value}}, {rank: 'hung' | 'aborted with SIG..' | 'raised'}),
    the second for ranks that did not finish on_rank."""
    listener = socket.create_server(("127.0.0.1", 0))  # a free port, loopback only
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], WORLD + 1, is_master=True,
                          wait_for_workers=False, master_listen_fd=listener.detach())
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_entry, args=(r, store.port, queue), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {r: {} for r in range(WORLD)}, time.monotonic() + TIMEOUT

    def drain():
        while not queue.empty():
            rank, key, value = queue.get()
            results[rank][key] = value

    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        drain()
        if any(p.exitcode for p in procs) or all("done" in r for r in results.values()):
            deadline = min(deadline, time.monotonic() + 5)  # a rank died, or all finished: 5 s more
        time.sleep(0.05)
    drain()
    failed = {}
    for rank, p in enumerate(procs):
        if p.exitcode is None:
            failed[rank] = "hung"
            p.kill()
            p.join()
        elif p.exitcode != 0:
            failed[rank] = f"aborted with {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else "raised"
        if results[rank].pop("done", False) and rank in failed:  # in teardown, after its work: not ours
            print(f"note: rank {rank} {failed.pop(rank)} after finishing on_rank", file=sys.stderr)
    return results, failed


def main() -> int:
    results, failed = launch()
    if failed:
        print(f"repro error: ranks {failed} (see stderr)", file=sys.stderr)
        return 2

    def over_ranks(key):  # (largest change on any rank, parameters that got a gradient on some rank, held)
        graded = [any(g) for g in zip(*(r[key][1] for r in results.values()))]
        return max(r[key][0] for r in results.values()), sum(graded), len(graded)

    one, plain, tp = over_ranks("one"), over_ranks("plain"), over_ranks("tp")
    print(f"expected: one SGD step, the optimizer built before wrapping, moves a parameter by up to {one[0]:.4f} "
          f"on one device and {plain[0]:.4f} under plain FSDP1 ({plain[1]} of {plain[2]} held got a gradient)")
    print(f"actual:   FSDP1 + TP (FSDP1 on mesh['dp'] of a ({WORLD}, 1) mesh): it moves a parameter by up to "
          f"{tp[0]:.4f}; {tp[1]} of the {tp[2]} parameters the optimizer holds got a gradient")
    present = tp[1] < tp[2] or abs(tp[0] - one[0]) > 1e-6
    print("fault present" if present else "fault absent")
    return 1 if present else 0


if __name__ == "__main__":
    sys.exit(main())
