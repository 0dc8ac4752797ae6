"""transformers finding T3 (transformers 5.23.0, any torch): Doge's attention cannot run under
its own TP plan: its dynamic mask is built for every key-value head on a rank that holds some.

DogeAttention computes dt_states = dt_proj(value_states of every kv head), one value per kv head,
then exp(A * softplus(dt_states)) as the mask added to each head's attention weights. The
model's base_model_tp_plan splits q, k and v colwise (this rank's heads) and makes dt_proj
rowwise, which sums its partial products into all num_key_value_heads outputs on every rank.
The mask so has every kv head while the rank's attention has its own: the forward raises
("The size of tensor a (2) must match the size of tensor b (4)") at inference and in training.
No style of the plan keeps dt_proj's output to the rank's heads. Sharded by transformers' own
code (DistributedConfig(tp_size=2), maybe_distribute_model), 2 ranks.
Run: python t3_doge_mask_over_every_head.py (needs torch and transformers)
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
MARK, WHEN = "must match the size of tensor b", "inference"  # what the ranks raise, and when
EXPECTED = "the forward runs under TP as unsharded"


def tiny():
    from transformers import DogeConfig, DogeForCausalLM

    torch.manual_seed(0)
    return DogeForCausalLM(DogeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      max_position_embeddings=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2))


def loss(model):
    """The model's own loss over token ids as labels."""
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids, labels=ids).loss


# --- boilerplate: one step under transformers' own TP, and whether it raised ---------------

def sharded(model):
    """``model`` as transformers shards it: DistributedConfig(tp_size=WORLD), maybe_distribute_model."""
    from transformers.distributed import DistributedConfig

    config, _, meshes = type(model).prepare_distribute_model(DistributedConfig(tp_size=WORLD))
    return type(model).maybe_distribute_model(model, config, meshes)


def attempt(model, train: bool) -> str:
    """"ran", or what the forward (and, training, the backward) raised."""
    try:
        with torch.set_grad_enabled(train):
            value = loss(model)
            if train:
                value.backward()
    except RuntimeError as exc:
        return f"raised RuntimeError: {str(exc).splitlines()[0].split('. ')[0]}"
    return "ran"


def on_rank(rank: int) -> dict:
    model = sharded(tiny())
    return {"inference": attempt(model, train=False), "training": attempt(model, train=True)}


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    unsharded = attempt(tiny(), train=True)
    got = {rank: value for rank, (_, value) in results.items()}
    print(f"expected: {EXPECTED} (unsharded: {unsharded})")
    print("actual:   " + "; ".join(f"rank {rank}: inference {said['inference']}, training {said['training']}"
                                   for rank, said in sorted(got.items())))
    present = unsharded == "ran" and all(MARK in said[WHEN] for said in got.values())
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
