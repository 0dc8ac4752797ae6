"""transformers models as their users build them (random init, tiny), with the TP plans
transformers ships: what tests/test_transformers.py verifies. Imports transformers."""

import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

VOCAB, SEQ = 64, 8
TINY = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32)


def make_llama():
    return LlamaForCausalLM(LlamaConfig(**TINY))


def make_qwen2():
    return Qwen2ForCausalLM(Qwen2Config(**TINY))


def make_gemma3():
    """Its head tied to its embedding (tie_word_embeddings), as Gemma ships."""
    return Gemma3ForCausalLM(Gemma3TextConfig(**TINY, head_dim=4))


def make_qwen3_moe():
    """Every layer's MLP a mixture of 4 experts, run through grouped_mm as transformers ships it."""
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, head_dim=4, moe_intermediate_size=8, num_experts=4,
                                              num_experts_per_tok=2))


def tokens(n, generator):
    """The model's keyword arguments: token ids, and the same ids as labels (its own loss)."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


def model_loss(out, batch):
    """The loss the model computes from its labels: the batch's mean."""
    return out.loss


# transformers' own plan for Llama, with o_proj given the wrong style
WRONG_O_PROJ = dict(LlamaConfig.base_model_tp_plan, **{"layers.*.self_attn.o_proj": "colwise"})


def o_proj_colwise(model, mesh):
    """transformers' own stack with a plan override that is wrong: o_proj colwise."""
    from tpdp_verify.integrations.transformers import distribute

    return distribute(model, mesh, tp_plan={"model.layers.*.self_attn.o_proj": "colwise"})
