"""Fault 14 (torch 2.13.0): FSDP1 alone, with an ignored module, in half precision aborts a rank.

No TP. A model whose ignored first layer leaves a frozen layer at the head of FSDP1's flat
parameter, in bfloat16, on 2 ranks: rank 0's shard holds only frozen parameters, so in
FSDP.summon_full_params(with_grads=True) its flat gradient is None
(FlatParamHandle._reset_flat_param_grad_info_if_needed) and FlatParamHandle.unshard_grad
(torch/distributed/fsdp/_flat_param.py) stands in zeros made without a dtype: float32, while
rank 1 all-gathers bfloat16. gloo sees a size mismatch and aborts rank 1 (SIGABRT); rank 0
raises on the float32 gradient. The same in float32 works; so does training without
summon_full_params; any model whose flat parameter starts with a frozen layer aborts alike,
ignored module or not. Run: python f14_fsdp1_ignored_half_precision_abort.py
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
DTYPE = torch.bfloat16


class FrozenMLP(nn.Module):
    """A trainable input layer (the one FSDP1 is told to ignore), then an MLP whose first layer is frozen."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(1, 1)
        self.mlp = nn.Sequential(nn.Linear(1, 2), nn.GELU(), nn.Linear(2, 1))
        self.mlp[0].requires_grad_(False)

    def forward(self, x):
        return self.mlp(torch.tanh(self.inp(x)))


def full_grads(model, fsdp: bool) -> dict:
    """The trained MLP layer's gradients after one backward, read whole as FSDP1 offers them."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if fsdp:
        model = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"), ignored_modules=[model.inp])
    model(torch.ones(2, 1, dtype=DTYPE)).sum().backward()  # the same batch on every rank
    with FSDP.summon_full_params(model, with_grads=True) if fsdp else torch.no_grad():
        inner = model.module if fsdp else model
        return {f"mlp.2.{n}": p.grad.float().flatten().tolist() for n, p in inner.mlp[2].named_parameters()}


def on_rank(rank: int, send) -> None:
    torch.manual_seed(0)
    one, wrapped = FrozenMLP().to(DTYPE), FrozenMLP().to(DTYPE)
    wrapped.load_state_dict(one.state_dict())
    send("one", full_grads(one, fsdp=False))
    try:
        send("fsdp", full_grads(wrapped, fsdp=True))
    except RuntimeError as exc:  # the fault: the stand-in float32 gradient meets a bfloat16 parameter
        if "dtype" not in str(exc):
            raise
        send("raised", f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}")


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
    if "raised" in failed.values():
        print(f"repro error: ranks {failed} (see stderr)", file=sys.stderr)
        return 2
    one = results.get(0, results.get(1, {})).get("one") or {}
    print(f"expected: FSDP.summon_full_params(with_grads=True) gives each rank the gradients one device computes "
          f"({', '.join(f'{n} {g}' for n, g in one.items())}), as it does in float32")
    actual = [f"rank {r} {how}" for r, how in failed.items()]
    actual += [f"rank {r} raised {out['raised']}" for r, out in results.items() if "raised" in out]
    errors = [max(abs(a - b) for n, g in out["one"].items() for a, b in zip(out["fsdp"][n], g))
              for out in results.values() if "fsdp" in out]
    actual += [f"ranks {sorted(r for r, o in results.items() if 'fsdp' in o)}: max abs difference "
               f"from one device {max(errors):.3g}"] if errors else []
    print(f"actual:   {DTYPE} on {WORLD} ranks: {'; '.join(actual)}")
    present = bool(failed) or len(errors) < WORLD or max(errors) > 0
    print("fault present" if present else "fault absent")
    return 1 if present else 0


if __name__ == "__main__":
    sys.exit(main())
