"""Fault 19 (torch 2.13.0): DTensor programs that fail on the CPU in the SPMD form.

Run as DTensor's own program (the SPMD form: no TP style hooks localizing activations between
modules), three pieces of a Llama model raise on CPU ranks; a 1-D tp mesh is enough:
scaled_dot_product_attention (aten._scaled_dot_product_flash_attention_for_cpu has no sharding
strategy in torch/distributed/tensor/_ops/_matrix_ops.py); a Linear over a vocab-sharded
embedding's [batch, seq, dim] output (the flattening view keeps the _MaskPartial, whose mask has
the tokens' shape: IndexError in _ops/_mask_buffer.py:MaskBuffer.apply_mask); the embedding's
output read twice, as a residual does (the first reduction releases the mask: AssertionError in
placement_types.py:_MaskPartial._reduce_value). Run: python f19_dtensor_spmd_programs_fail_on_cpu.py
"""

import os
import socket
import sys
import traceback
import warnings
from datetime import timedelta
from time import monotonic, sleep

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5
VOCAB, DIM, HEADS = 8, 4, 2


def weights() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(VOCAB, DIM, generator=gen), "w1": torch.randn(DIM, DIM, generator=gen),
            "tokens": torch.randint(VOCAB, (2, 3), generator=gen), "qkv": torch.randn(3, 2, HEADS, 3, 2, generator=gen)}


def attention(t):  # a Llama block's attention core: [batch, heads, seq, head_dim], heads sharded over tp
    return F.scaled_dot_product_attention(t["qkv"][0], t["qkv"][1], t["qkv"][2], is_causal=True)


def embedding_then_linear(t):  # embedding, then a Linear over [batch, seq, dim] (the tied model's MLP)
    return F.linear(F.embedding(t["tokens"], t["embed"]), t["w1"])


def embedding_then_residual(t):  # the embedding's output read twice: a block's h + attention(norm(h))
    h = F.embedding(t["tokens"], t["embed"])
    return h + F.rms_norm(h, (DIM,))


PROGRAMS = (attention, embedding_then_linear, embedding_then_residual)


def one_device() -> dict:
    return {p.__name__: p(weights()) for p in PROGRAMS}


def on_rank(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    layout = {"embed": Shard(0), "w1": Shard(0), "tokens": Replicate(), "qkv": Shard(2)}  # vocab rows, heads
    got = {}
    for program in PROGRAMS:
        t = {k: distribute_tensor(v, mesh, [layout[k]]) for k, v in weights().items()}
        try:  # DTensor's own program: no TP style's hooks redistributing between the ops
            got[program.__name__] = program(t).full_tensor().tolist()  # plain values: the rank exits once it answers
        except (NotImplementedError, IndexError, AssertionError) as exc:
            if not is_fault(exc):
                raise
            got[program.__name__] = said(exc)
    return got


def is_fault(exc: Exception) -> bool:
    text = str(exc)
    return ("_scaled_dot_product_flash_attention_for_cpu" in text and "sharding strategy" in text
            or "The shape of the mask" in text
            or isinstance(exc, AssertionError) and "_reduce" in traceback.extract_tb(exc.__traceback__)[-1].name)


def said(exc: Exception) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1]
    text = (str(exc).splitlines() or [""])[0] or f"in {os.path.basename(where.filename)}:{where.name}"
    return f"{type(exc).__name__}: {text}"


def describe(expected: dict) -> str:
    return "DTensor runs each as one device does: " + ", ".join(
        f"{name} max |out| {out.abs().max():.4f}" for name, out in expected.items())


def judge(expected: dict, answers: list) -> tuple[str, bool]:
    parts, present = [], False
    for name, want in expected.items():
        got = answers[0][name] if isinstance(answers[0][name], str) else torch.tensor(answers[0][name])
        wrong = isinstance(got, str) or not torch.allclose(got, want, atol=1e-5)
        present |= wrong
        parts.append(f"{name} " + (f"raised {got}" if isinstance(got, str) else
                                   f"max |out| {got.abs().max():.4f}" + " (wrong)" * wrong))
    return f"on {WORLD} CPU ranks: " + "; ".join(parts), present


def main() -> int:
    expected = one_device()
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    actual, present = judge(expected, [value for _, value in results.values()])
    print(f"expected: {describe(expected)}")
    print(f"actual:   {actual}")
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
