"""The user guide's worked example (docs/user-guide.md): verify a Llama-style block's TP plan.

Run from this directory:  python llama_plan.py [right|wrong] [torch|reference]
"""

import sys

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tpdp_verify import verify_plan
from tpdp_verify.fixtures.models import TransformerBlock  # RMSNorm, RoPE attention, SwiGLU

DIM, HIDDEN, HEADS, SEQ = 16, 32, 4, 8


def make_block():
    return TransformerBlock(DIM, HIDDEN, HEADS, SEQ)


# torchtitan's plan for a block: project in column-parallel, out row-parallel.
PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
}

# The mistake: w2, a row-parallel layer, declared column-parallel.
WRONG_PLAN = {**PLAN, "feed_forward.w2": ColwiseParallel()}


def inputs(n, generator):
    """n sequences of SEQ tokens of width DIM, drawn from the generator given."""
    return {"input": torch.randn(n, SEQ, DIM, generator=generator),
            "target": torch.randn(n, SEQ, DIM, generator=generator)}


def loss(out, batch):
    """One loss per sample: the mean square error over its tokens."""
    return (out - batch["target"]).pow(2).mean((1, 2))


if __name__ == "__main__":
    plan = WRONG_PLAN if sys.argv[1:2] == ["wrong"] else PLAN
    impl = sys.argv[2] if len(sys.argv) > 2 else "torch"
    report = verify_plan(make_block, plan, mesh=(2, 2), input_fn=inputs, loss_fn=loss, impl=impl)
    print(report)
    sys.exit(0 if report.ok else 1)
