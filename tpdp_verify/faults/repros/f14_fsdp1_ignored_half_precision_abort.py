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

import os
import signal
import socket
import sys
import traceback
import warnings
from datetime import timedelta
from time import monotonic, sleep

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5
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


def on_rank(rank: int) -> dict:
    torch.manual_seed(0)
    one, wrapped = FrozenMLP().to(DTYPE), FrozenMLP().to(DTYPE)
    wrapped.load_state_dict(one.state_dict())
    out = {"one": full_grads(one, fsdp=False)}
    try:
        out["fsdp"] = full_grads(wrapped, fsdp=True)
    except RuntimeError as exc:  # the fault: the stand-in float32 gradient meets a bfloat16 parameter
        if "dtype" in str(exc):
            out["raised"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        elif "by peer" in str(exc):  # the peer aborted first (gloo's size mismatch): its symptom, seen here
            out["lost_peer"] = "lost its peer in the all-gather (Connection reset by peer)"
        else:
            raise
    return out


def main() -> int:
    results = run_ranks()
    # A rank killed by a signal (gloo's SIGABRT on the mismatched all-gather) is the fault's symptom.
    failed = {r: f"aborted with {signal.Signals(-v).name}" for r, (s, v) in results.items() if s == "aborted" and v < 0}
    if (code := bail_out({r: sv for r, sv in results.items() if r not in failed})) is not None:
        return code
    results = {r: v for r, (s, v) in results.items() if s == "ok"}
    one = results.get(0, results.get(1, {})).get("one") or {}
    print(f"expected: FSDP.summon_full_params(with_grads=True) gives each rank the gradients one device computes "
          f"({', '.join(f'{n} {g}' for n, g in one.items())}), as it does in float32")
    actual = [f"rank {r} {how}" for r, how in failed.items()]
    if any("lost_peer" in out for out in results.values()) and not failed:
        print("a rank lost its peer, but no rank aborted: not this fault's symptom", file=sys.stderr)
        return 2
    actual += [f"rank {r} raised {out['raised']}" for r, out in results.items() if "raised" in out]
    actual += [f"rank {r} {out['lost_peer']}" for r, out in results.items() if "lost_peer" in out]
    errors = [max(abs(a - b) for n, g in out["one"].items() for a, b in zip(out["fsdp"][n], g))
              for out in results.values() if "fsdp" in out]
    actual += [f"ranks {sorted(r for r, o in results.items() if 'fsdp' in o)}: max abs difference "
               f"from one device {max(errors):.3g}"] if errors else []
    print(f"actual:   {DTYPE} on {WORLD} ranks: {'; '.join(actual)}")
    present = bool(failed) or len(errors) < WORLD or max(errors) > 0
    print("fault present" if present else "fault absent")
    return int(present)


# --- boilerplate: WORLD gloo ranks on 127.0.0.1, each answering once; a timeout for hangs ------

def rank_main(rank, port, answers):
    warnings.filterwarnings("ignore")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on loopback too
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    try:
        answers.put((rank, "ok", on_rank(rank)))
    except Exception:
        answers.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def run_ranks() -> dict:
    """{rank: (status, value)}: status ok, error (a bug in this script), hung or aborted."""
    # forkserver: torch and the distributed packages the reproductions use imported once, by the
    # server the ranks are forked from (spawn imports them in each rank: seconds of CPU a rank)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor.parallel",
                                "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch._dynamo"])
    listener = socket.create_server(("127.0.0.1", 0))  # a free port, on loopback only
    port = listener.getsockname()[1]
    # The ranks' rendezvous, hosted here on the listener so that it listens on loopback only.
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach(), timeout=timedelta(seconds=TIMEOUT_S))
    answers = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_main, args=(r, port, answers), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    results, deadline = {}, monotonic() + TIMEOUT_S
    while len(results) < WORLD and monotonic() < deadline:
        while not answers.empty():
            rank, status, value = answers.get()
            results[rank] = (status, value)
            if status != "ok":  # the others may wait for this rank: give them a grace only
                deadline = min(deadline, monotonic() + GRACE_S)
        for r, p in enumerate(procs):
            if r not in results and p.exitcode not in (None, 0) and answers.empty():
                results[r] = ("aborted", p.exitcode)
        sleep(0.05)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    del store  # kept until every rank is done with it
    return {r: results.get(r, ("hung", None)) for r in range(WORLD)}


def bail_out(results) -> int | None:
    """2 when a rank failed in a way that is not this fault (what each said, to stderr), else None.

    This fault neither raises out of on_rank nor hangs nor aborts a rank: any of those is
    a bug in this script or another fault.
    """
    failed = {r: (s, v) for r, (s, v) in results.items() if s != "ok"}
    for r, (status, value) in failed.items():
        detail = {"error": f":\n{value}", "aborted": f" (exit code {value})"}.get(status, "")
        print(f"rank {r} {status}{detail}", file=sys.stderr)
    return 2 if failed else None


if __name__ == "__main__":
    sys.exit(main())
