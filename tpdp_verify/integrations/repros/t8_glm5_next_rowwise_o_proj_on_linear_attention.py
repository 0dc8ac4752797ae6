"""transformers finding T8 (transformers 5.23.0, any torch): GLM-5-Next's text model cannot run
under its own TP plan: the plan's rowwise o_proj rule also takes its linear-attention layers,
whose query, key and value projections it leaves whole.

Glm5NextTextConfig.base_model_tp_plan shards the indexed (MLA) attention by head: q_b_proj and
kv_b_proj colwise, "layers.*.self_attn.o_proj": "rowwise". But the model's default layer_types
make three layers in four "linear_attention" (Glm5NextTextLinearAttention, Kimi's KDA), whose
projection out is also named self_attn.o_proj, and the plan has no rule for that block's q_proj,
k_proj, v_proj, g_b_proj or b_proj. The rule still matches its o_proj, which so holds half of
every row of its weight while its input is every head, whole: transformers' RowwiseParallel
declares that full-width input the rank's shard of in_features, and the product fails -- in
training ("shape '[16, 16]' is invalid for input of size 512", inside DTensor's linear) and at
inference ("mat1 and mat2 shapes cannot be multiplied"). A plan keyed by module name cannot tell
the two attention blocks apart. Sharded by transformers' own code (DistributedConfig(tp_size=2),
maybe_distribute_model), one layer of each kind, 2 ranks.
Run: python t8_glm5_next_rowwise_o_proj_on_linear_attention.py (needs torch and transformers)
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
MARK, WHEN = "is invalid for input of size", "training"  # what the ranks raise, and when
EXPECTED = "training steps under TP as unsharded"


def tiny():
    from transformers import Glm5NextTextConfig, Glm5NextTextModel

    torch.manual_seed(0)
    return Glm5NextTextModel(Glm5NextTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        v_head_dim=8, index_topk=8, index_head_dim=8, index_n_heads=4, index_kpool=4, linear_head_dim=8,
        linear_num_heads=4, n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0,
        layer_types=["linear_attention", "indexed_attention"], mlp_layer_types=["dense", "dense"]))


def loss(model):
    """The mean square of the model's last hidden state (a base model: no head, no loss of its own)."""
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids).last_hidden_state.square().mean()


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
