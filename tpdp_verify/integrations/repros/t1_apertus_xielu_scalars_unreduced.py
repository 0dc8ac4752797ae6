"""transformers finding T1 (transformers 5.23.0, any torch): Apertus under TP trains its xIELU
activation's learned scalars on each rank's shard of the MLP alone.

ApertusMLP computes down_proj(act_fn(up_proj(x))), with act_fn an xIELU holding two learned
scalars, alpha_p and alpha_n. The model's base_model_tp_plan makes up_proj colwise and down_proj
rowwise, so act_fn sees only this rank's columns of the intermediate: each rank's gradient of
alpha_p and alpha_n is a partial sum over its columns. The plan has no rule for mlp.act_fn
("replicated_with_grad_allreduce", which its q_norm and k_norm get for the same reason), so
nothing sums them: every rank steps its own scalars, the ranks' models part, and none matches
the unsharded model. Sharded by transformers' own code (DistributedConfig(tp_size=2),
maybe_distribute_model), one backward of the model's own loss, 2 ranks.
Run: python t1_apertus_xielu_scalars_unreduced.py (needs torch and transformers)
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

WORLD, TIMEOUT_S, GRACE_S = 2, 60, 5
NAMES = ("act_fn.alpha_p", "act_fn.alpha_n")  # the xIELU scalars


def tiny():
    from transformers import ApertusConfig, ApertusForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # its rope config's notes on a tiny context
    torch.manual_seed(0)
    return ApertusForCausalLM(ApertusConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            pad_token_id=0))


def loss(model):
    """The model's own loss over token ids as labels."""
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids, labels=ids).loss


# --- boilerplate: gradients under transformers' own TP against one device's -----------------

def sharded(model):
    """``model`` as transformers shards it: DistributedConfig(tp_size=WORLD), maybe_distribute_model."""
    from transformers.distributed import DistributedConfig

    config, _, meshes = type(model).prepare_distribute_model(DistributedConfig(tp_size=WORLD))
    return type(model).maybe_distribute_model(model, config, meshes)


def grads(model) -> dict:
    """One backward of ``loss``; the gradient of each parameter named by NAMES (a list: it leaves its process)."""
    loss(model).backward()
    return {n: p.grad.tolist() for n, p in model.named_parameters() if n.endswith(NAMES)}


def on_rank(rank: int) -> dict:
    return grads(sharded(tiny()))


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    expected = {n: torch.tensor(g) for n, g in grads(tiny()).items()}
    got = {rank: {n: torch.tensor(g) for n, g in value.items()} for rank, (_, value) in results.items()}
    off = {rank: [n for n in expected if not torch.allclose(theirs[n], expected[n], rtol=1e-4, atol=1e-6)]
           for rank, theirs in got.items()}
    name = next(iter(expected))
    print(f"expected: every rank's {name} gradient is the unsharded model's (sum {expected[name].sum().item():.6g})")
    print("actual:   " + "; ".join(f"rank {rank}: sum {theirs[name].sum().item():.6g}"
                                   for rank, theirs in sorted(got.items()))
          + f"; {sum(map(len, off.values()))} of {len(expected) * WORLD} gradients off")
    present = any(off.values())
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
