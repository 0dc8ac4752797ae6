"""transformers finding T9 (transformers 5.23.0, any torch): Inkling2's text model under TP pairs
the wrong halves of its experts' fused gate and up projection.

Inkling2Experts holds each expert's gate and up projections as one weight, gate_up_proj
(experts, 2 * moe_intermediate_size, hidden), the gate's rows first, and splits their product
locally: gate, up = gate_up.chunk(2, dim=-1) (Inkling2Experts._apply_gate). The model's
base_model_tp_plan makes gate_up_proj "colwise", an even split of those rows: under tp=2 rank 0
holds the gate's rows alone and rank 1 the up's, so rank 0's chunk(2) takes half of the gate for
its gate and the other half for its up, rank 1 likewise with the up's, and down_proj (rowwise)
sums their products. The experts' output, and every gradient before it, is not the unsharded
model's. The 50 other plans that name "layers.*.mlp.experts.gate_up_proj" make it
"packed_colwise", which gives each rank the same slice of the gate and of the up; the conformance
table's row passes with it. Inkling's text plan (InklingTextConfig) has the same rule and its
experts split alike (modeling_inkling.py:335), but its row departs first at torch fault 38, in
its embedding's norm. Sharded by transformers' own code (DistributedConfig(tp_size=2),
maybe_distribute_model), one backward of the model's own loss, 2 ranks; the gradients compared
are the routers' weights', which every rank holds whole and which the experts' output reaches.
Run: python t9_inkling2_experts_gate_up_split_as_one.py (needs torch and transformers)
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
NAMES = ("mlp.gate.weight",)  # the routers' weights, whole on every rank


def tiny():
    from transformers import Inkling2ForCausalLM, Inkling2TextConfig
    from transformers.utils import logging

    logging.set_verbosity_error()  # its note on the reference short convolution
    torch.manual_seed(0)
    return Inkling2ForCausalLM(Inkling2TextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
        max_position_embeddings=64, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


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
