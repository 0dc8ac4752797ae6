"""transformers finding T7 (transformers 5.23.0, any torch): Qwen3-Omni-MoE's talker model,
built from its config, leaves its experts' weights uninitialized.

Qwen3OmniMoeTalkerModel's sparse blocks hold their experts in Qwen3OmniMoeTalkerTextExperts,
whose gate_up_proj and down_proj are made with torch.empty. The model's _init_weights
(Qwen3OmniMoePreTrainedModel's) initializes the thinker's sparse block only
(Qwen3OmniMoeThinkerTextSparseMoeBlock), so the talker's experts keep whatever memory held:
two builds from the same seed differ, and so do the ranks of a distributed job that each build
the model (what tpdp-verify's check that every rank builds the same weights met). Loading a
checkpoint overwrites them; training from the config starts from garbage. Whether two
processes' garbage differs depends on their heaps (ranks forked from one server may hold the
same), so each rank here builds the model with torch's deterministic mode filling what
torch.empty makes with NaN: a weight the model's init writes holds no NaN.
Run: python t7_qwen3_omni_talker_experts_uninitialized.py (needs torch and transformers)
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
NAMES = ("experts.gate_up_proj", "experts.down_proj")


def tiny():
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerModel

    talker = Qwen3OmniMoeConfig(talker_config={"text_config": dict(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=16)}).talker_config.text_config
    torch.manual_seed(0)
    return Qwen3OmniMoeTalkerModel(talker)


def on_rank(rank: int) -> dict:
    """How many entries of each expert weight this rank's build left as torch.empty made them."""
    torch.use_deterministic_algorithms(True)  # and fill_uninitialized_memory (its default): NaN
    try:
        model = tiny()
    finally:
        torch.use_deterministic_algorithms(False)
    return {n: int(p.isnan().sum()) for n, p in model.named_parameters() if n.endswith(NAMES)}


def main() -> int:
    results = run_ranks()
    if (code := bail_out(results)) is not None:
        return code
    if not results[0][1]:  # nothing compared is not an answer
        print(f"no parameter named *{NAMES[0]} or *{NAMES[1]}: this transformers has other names", file=sys.stderr)
        return 2
    left = sorted({n for _, value in results.values() for n, nans in value.items() if nans})
    print(f"expected: the model's init writes all {len(results[0][1])} expert weights each rank builds "
          "(torch.empty's memory filled with NaN)")
    print(f"actual:   {len(left)} of them still hold NaN" + (f" ({left[0]}, ...)" if left else ""))
    present = bool(left)
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
