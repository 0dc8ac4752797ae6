"""The newcomer's model that bench/bench_plan.py times ``tpdp-verify plan`` on: a tiny LM of
about 0.1 M parameters (RMSNorm, q/k/v/o attention with RoPE, SwiGLU, output head:
fixtures.models.LlamaLM) with the plan a new user writes for it, sequence parallel between
the sublayers; and that plan with a typo."""

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from tpdp_verify.fixtures import plans
from tpdp_verify.fixtures.models import LlamaLM

VOCAB, SEQ = 512, 16


def make() -> LlamaLM:
    return LlamaLM(vocab=VOCAB, dim=64, hidden=172, heads=4, seq=SEQ)  # 115,136 parameters


def tokens(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=generator)


PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    **plans.llama_block("layers.*.", sequence_parallel=True),
}
TYPO = {k.replace("feed_forward.w2", "feed_forwrd.w2"): v for k, v in PLAN.items()}
