"""transformers models as their users build them (random init, tiny), with the TP plans
transformers ships: what tests/test_transformers.py verifies. Imports transformers."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB, SEQ = 64, 8
TINY = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32)


def make_llama():
    return LlamaForCausalLM(LlamaConfig(**TINY))


def make_qwen2():
    return Qwen2ForCausalLM(Qwen2Config(**TINY))


def tokens(n, generator):
    """The model's keyword arguments: token ids, and the same ids as labels (its own loss)."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


def model_loss(out, batch):
    """The loss the model computes from its labels: the batch's mean."""
    return out.loss


# transformers' own plan for Llama, with o_proj given the wrong style
WRONG_O_PROJ = dict(LlamaConfig.base_model_tp_plan, **{"layers.*.self_attn.o_proj": "colwise"})
