"""The conformance table: every architecture of the installed transformers that ships a TP
plan, on a tiny config derived from its config class, verified through transformers' own
stack (tpdp_verify.integrations.transformers) under each layout: TP alone, TP with FSDP2,
HSDP, and EP where the architecture has an expert plan.

    python -m tpdp_verify.integrations.conformance [--markdown docs/transformers-conformance.md]
        [--json FILE] [-k SUBSTRING | -k =MODEL_TYPE] [--layouts tp,tp_fsdp2,hsdp,ep]

Each cell is PASS, n/a, the finding (tpdp_verify.integrations.findings) that explains its
departure, or where and how it departs; a cell that cannot run says why (a config that does
not build small, a model class transformers does not map). The command exits 1 when a cell
departs that no finding explains: a new finding to look at.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

VOCAB, SEQ = 64, 8
# Every size small, and what TP and EP split divisible by 2: heads, key-value heads, experts.
# A config takes the fields it has (by name, or by its attribute_map's alias). The table's
# own choice, not the user's model: these are built here, from the config classes.
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, moe_intermediate_size=16,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, top_k_experts=2,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            mamba_n_heads=4, index_n_heads=4, index_head_dim=8, index_topk=8, vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8, global_head_dim=8, moe_hidden_size=16, zero_expert_num=2,
            shared_expert_intermediate_size=16, shared_experts_intermediate_size=16, index_kpool=4,
            num_kv_shared_layers=0, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_head_dim=8, linear_num_heads=4, intermediate_size_mlp=32,
            # Qwen4-Exp's token indexer, which its model builds whether or not the config sets it (QSA: one key head)
            indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2,
            # a composite model's vision and audio parts, and what joins them to the text part
            image_size=32, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
            out_hidden_size=32, projector_hidden_size=16, ext_pw_out_channel=16,
            depthwise_separable_out_channel=16, nemo_conv_channels=16, adapter_in_dim=32, adapter_out_dim=32,
            # a Qwen-style vision encoder's merge of m x m patches into a token: none, so that an image of
            # one patch is a row (Inputs' grid_thw kind: every input's dim 0 the batch that dp splits)
            spatial_merge_size=1, merge_size=1, adapter_merge_size=1,
            # dropout off: its draws differ by design between a sharded and an unsharded run
            attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, residual_dropout=0.0,
            classifier_dropout=0.0)
# Sizes some configs take as their __post_init__'s keyword arguments, not as fields
# (Gemma 4's and EmbeddingGemma 2's full-attention layers: a wider head, their own kv heads).
TINY_BUILDER = dict(global_head_dim=8, num_global_key_value_heads=2)
# Layer kinds where the default's do not run: LFM2-MoE's default leaves them unset, and its
# model reads config.layer_types[i]; GraniteMoeHybrid's default is linear attention alone, whose
# cache has no attention layer to count its length. The kinds the modeling code names.
LAYER_KINDS = {"lfm2_moe": ("conv", "full_attention"), "granitemoehybrid": ("linear_attention", "full_attention")}
# The same for a config whose MLP kind a layer is unset by default (DeepSeek-OCR 2's text part,
# whose layers read config.mlp_layer_types[i]): one layer of each kind.
MLP_KINDS = {"deepseek_ocr2_text": ("dense", "sparse")}
# A field the model reads whatever its layer kinds, which the config's default leaves unset: Step
# 3.7's text model builds a sliding-window mask every forward (modeling_step3p7.py:892), its
# sliding_window defaults to None. Not TINY's: a window set turns sliding on where None means off
# (Mixtral's). A window shorter than the tiny sequence, so that the mask it builds masks.
UNSET_READ = {"step3p5": dict(sliding_window=SEQ // 2)}
# What a composite hands its part beside token ids, by the argument's name: its length (the
# states' rows a sample), each row the config's width. An encoder's states, for a decoder that
# is a part alone (T5Gemma 2's, whose forward refuses to run without them); a conditioning the
# layers read, one a sample (Voxtral Realtime's text model: the composite's time embedding,
# ``t_cond``, handed down through the model's **kwargs to its layers).
BESIDE_IDS = {"encoder_hidden_states": SEQ, "t_cond": 1}
# A count a part's forward requires, given whole to every rank (tpdp_verify.plan.case.CONSTANTS):
# DeepSeek-OCR 2's encoder reads its first num_patches positions as the image's (attended both
# ways), the rest as its queries (causal).
COUNTS = {"num_patches": SEQ // 2}
MAX_PARAMETERS = 2_000_000  # a tiny model holds well under a million


class Layout(NamedTuple):
    name: str
    mesh: tuple[int, ...]
    parallelize: str  # the name in tpdp_verify.integrations.transformers
    experts_only: bool = False  # only for architectures with an expert plan


LAYOUTS = {l.name: l for l in (
    Layout("tp", (1, 2), "parallelize"),
    Layout("tp_fsdp2", (2, 2), "parallelize"),
    Layout("hsdp", (2, 1, 2), "parallelize"),
    Layout("ep", (2, 2), "expert_parallel", experts_only=True),
)}


@dataclasses.dataclass(frozen=True)
class Tiny:
    """model_fn of one architecture: its model class (causal LM, else the base model) on
    the tiny config. A module-level class, so that the ranks rebuild it by name."""

    model_type: str

    def __call__(self) -> torch.nn.Module:
        config, cls = tiny_config(self.model_type), model_class(self.model_type)
        with torch.device("meta"):  # sized first: a field the derivation misses can hold gigabytes
            probe = _built(cls, config)
        sizes = {n: p.numel() for n, p in probe.named_parameters()}
        if sum(sizes.values()) > MAX_PARAMETERS:
            biggest = max(sizes, key=sizes.get)
            raise ValueError(f"the tiny config still makes {sum(sizes.values()) / 1e6:.1f}M parameters "
                             f"({biggest}: {list(probe.get_parameter(biggest).shape)}), beyond "
                             f"{MAX_PARAMETERS / 1e6:.0f}M: a size field of {type(config).__name__} that TINY "
                             "does not set")
        return cls(config)


def _built(cls, config):
    """``cls(config)``, where the model reads a TINY size its config class does not declare
    (the Qwen3-Omni talker's ``shared_expert_intermediate_size``: a hub config.json carries
    it as an extra key) given it as such a key."""
    while True:
        try:
            return cls(config)
        except AttributeError as exc:
            missing = getattr(exc, "name", None)
            if missing not in TINY or hasattr(config, missing):
                raise
            setattr(config, missing, TINY[missing])


def tiny_config(model_type: str):
    """The config class's defaults with every TINY field it has; its layer types cut to one
    layer of each kind (in their order), a multimodal rotary split cut to the tiny head; its
    sub-configs (a composite model's text and vision parts) tiny alike; and, where the class
    refuses grouped-query attention, as many key-value heads as heads."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if _mapped_class(model_type) is None:  # a composite's part: as its composite builds it, where one does
        built = _as_a_part(cls)
        if built is not None:
            return built
    return _tiny(cls, model_type)


def _as_a_part(part):
    """The config a composite builds for its part ``part``, from the tiny config of the
    composite that holds it directly (a part of a part: the Qwen3-Omni talker's text): the
    composite's __post_init__ fills what the part's class alone leaves unset. What it leaves
    unset still, the composites further out fill (T5Gemma 2's dropout rate, which its top
    config hands down to its encoder's text part, and its encoder config does not); only
    that: an outer one may build the part at full size (the Qwen3-Omni top's talker). None
    where no composite builds one."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    holders = []
    for model_type in CONFIG_MAPPING.keys():
        try:
            top = CONFIG_MAPPING[model_type]
        except Exception:  # a config whose module does not import here
            continue
        for path in _paths(top, part):  # the holder at each level of the path, the part below it
            holder = top
            for i, name in enumerate(path):
                holders.append((holder, path[i:]))
                holder = holder.sub_configs[name]
    found = None
    for holder, path in sorted(dict.fromkeys(holders), key=lambda held: len(held[1])):  # the innermost first
        try:
            built = _tiny(holder, holder.model_type)
        except Exception:  # this composite does not build small; another may
            continue
        for name in path:
            built = getattr(built, name, None)
        if isinstance(built, part) and found is None:
            found = built
        elif isinstance(built, part):
            for name, value in vars(built).items():
                if not hasattr(found, name):
                    setattr(found, name, value)
    return found


def _paths(cls, part, above: tuple = ()):
    """The sub-config names from the composite config class ``cls`` down to its part ``part``."""
    for name, held in (getattr(cls, "sub_configs", None) or {}).items():
        if held is part and cls is not part:
            yield (name,)
        elif isinstance(held, type) and held is not cls and held not in above:
            yield from ((name, *rest) for rest in _paths(held, part, above + (cls,)))


def _tiny(cls, model_type: str):
    from transformers import PreTrainedConfig

    default = cls()
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(vars(default))
    aliases = dict(getattr(cls, "attribute_map", {}) or {})
    given = {}
    for key, value in TINY.items():
        name = key if key in fields else aliases.get(key)
        if name in fields and name not in given:
            if name.endswith("head_dim") and default.__dict__.get(name) == 0:
                continue  # a head the model turns off (GLM-5 Next's NoPE: qk_rope_head_dim 0) stays off
            given[name] = _as_declared(cls, name, value)
    builder = inspect.getsource(cls.__post_init__) if "__post_init__" in vars(cls) else ""
    given |= {k: v for k, v in TINY_BUILDER.items() if k not in fields and f'"{k}"' in builder}
    for name, part in (getattr(cls, "sub_configs", None) or {}).items():
        if name in fields and isinstance(part, type) and issubclass(part, PreTrainedConfig) and part.model_type:
            given[name] = _tiny(part, part.model_type)
    if "kv_lora_rank" in given and "num_key_value_heads" in given:  # MLA: a key-value head a head
        given["num_key_value_heads"] = given["num_attention_heads"]
    if "pixel_shuffle_ratio" in fields:  # Llama 4's projector reads the shuffle's hidden / ratio^2 channels
        given["intermediate_size"] = round(given["hidden_size"] / default.pixel_shuffle_ratio ** 2)
    given |= UNSET_READ.get(model_type, {})
    if model_type in MLP_KINDS:
        given["mlp_layer_types"] = list(MLP_KINDS[model_type])
    types = list(LAYER_KINDS.get(model_type) or getattr(default, "layer_types", None) or ())
    kinds = list(dict.fromkeys(types))
    if kinds and "layer_types" in fields:
        given["layer_types"] = kinds * (2 if len(kinds) == 1 else 1)
        given["num_hidden_layers"] = len(given["layer_types"])
    elif kinds and "num_hidden_layers" in given:  # layer types computed from a period: enough layers for each
        given["num_hidden_layers"] = max(2, max(types.index(k) for k in kinds) + 1)
    given |= _per_layer_lists(cls, default, fields, given)
    given |= _tiny_ropes(getattr(default, "rope_parameters", None), kinds, given, default, model_type)
    try:
        built = cls(**given)
    except Exception as exc:
        if "num_key_value_heads" not in str(exc) or "num_key_value_heads" not in given:
            raise
        built = cls(**dict(given, num_key_value_heads=given.get("num_attention_heads", 4)))
    overrides = _tiny_overrides(built)
    return cls(**dict(given, per_layer_config=overrides)) if overrides else built


def _tiny_overrides(built) -> dict | None:
    """A layer's own sizes (``per_layer_config``) that its __post_init__ fills at full size
    (Dots 3's sliding layers: 64 heads, kv_lora_rank 1024), as the tiny config's own: the layer
    differs in kind, not in size; an MLA layer's head the sum it is there (validate_architecture:
    head_dim = qk_nope_head_dim + qk_rope_head_dim). None where none is at full size."""
    spec = built.__dict__.get("_heterogeneity_spec")
    layers = {i: dict(o) for i, o in (getattr(spec, "per_layer_overrides", None) or {}).items()}
    tiny = {i: {k: built.__dict__.get(k, v) if k in TINY else v for k, v in o.items()} for i, o in layers.items()}
    mla = ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim")
    for i, o in layers.items():
        if all(k in o for k in mla) and o["head_dim"] == o["qk_nope_head_dim"] + o["qk_rope_head_dim"]:
            tiny[i]["head_dim"] = tiny[i]["qk_nope_head_dim"] + tiny[i]["qk_rope_head_dim"]
    return tiny if tiny != layers else None


def _per_layer_lists(cls, default, fields: set, given: dict) -> dict:
    """The config's lists of an entry a layer that it does not derive from num_hidden_layers (a
    fixed schedule: MuseSpark's audio pyramid, patch_sizes, hidden_sizes and depths; Dots 3's
    vision MLP kinds, mlp_layer_types, and the experts a layer it derives from them), cut to the
    tiny layers: a list of kinds to one layer of each kind (more layers where it has more kinds
    than the layer types), a list of a TINY size (hidden_sizes) to that size, another to its
    first layers."""
    n = default.__dict__.get("num_hidden_layers")
    if not isinstance(n, int) or "num_hidden_layers" not in given:
        return {}
    try:
        more = cls(num_hidden_layers=n + 1)
    except Exception:  # the config refuses its fixed lists at another length: each is fixed
        more = None
    fixed = {name: list(value) for name in sorted(fields - {"layer_types"})
             if isinstance(value := default.__dict__.get(name), (list, tuple)) and len(value) == n
             and not (more is not None and len(more.__dict__.get(name) or ()) == n + 1)}
    kinds = {name: list(dict.fromkeys(v)) for name, v in fixed.items() if all(isinstance(k, str) for k in v)}
    layers = max([given["num_hidden_layers"], *map(len, kinds.values())])
    out = {name: (kinds[name] * layers)[:layers] if name in kinds else value[:layers] for name, value in fixed.items()}
    out |= {name: [TINY[name[:-1]]] * layers for name in fixed if name[:-1] in TINY}  # hidden_sizes: hidden_size each
    if out and layers > given["num_hidden_layers"]:
        out["num_hidden_layers"] = layers
        if "layer_types" in given:
            out["layer_types"] = (given["layer_types"] * layers)[:layers]
    return out


def _as_declared(cls, name: str, value):
    """A TINY size as the field declares it: a size a modality for a field that takes a list
    only (ERNIE-VL's text and vision experts: ``moe_intermediate_size: list[int] | None``)."""
    declared = str({f.name: f.type for f in dataclasses.fields(cls)}.get(name)) if dataclasses.is_dataclass(cls) else ""
    list_only = "list[int]" in declared and "int" not in declared.replace("list[int]", "")
    return [value, value] if list_only else value


def _tiny_ropes(rope, kinds: list[str], given: dict, default, model_type: str) -> dict:
    """The rotary parameters for the tiny head (and a wider head where a partial rotary
    would turn too few dims), whether one rotary or a rotary a layer kind."""
    if rope == {} and kinds:  # no rotary given, which the model reads a layer kind each (Cohere Compass)
        rope = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in kinds}
    if not isinstance(rope, dict) or not rope:
        return {}
    head = given.get("head_dim") or given.get("hidden_size", 32) // given.get("num_attention_heads", 4)
    per_kind = all(isinstance(v, dict) for v in rope.values())
    kinds_ropes = rope if per_kind else {"": rope}
    out = {}
    if "head_dim" in given and any(int(head * (r.get("partial_rotary_factor") or 1.0)) % 4
                                   for r in kinds_ropes.values()):  # M-RoPE's axes take frequencies in pairs
        head = out["head_dim"] = 16
    ropes = {k: _tiny_rope(v, head, default, model_type) for k, v in kinds_ropes.items()}
    return out | {"rope_parameters": ropes if per_kind else ropes[""]}


def _tiny_rope(rope: dict, head: int, default, model_type: str) -> dict:
    """A rotary's parameters for the tiny head: its multimodal sections (given, or the model's
    own default where the config gives none) cut to the rotated half, the two sections that
    are equal there (the axes the model pairs: ERNIE-VL stacks h with w) equal still."""
    own = rope.get("mrope_section") or _multimodal_rotary(model_type)
    if not own:
        return rope
    factor = rope.get("partial_rotary_factor") or getattr(default, "partial_rotary_factor", None) or 1.0
    half = int(head * factor) // 2  # the model's own default sections are the full size's
    rest = next((i for i, s in enumerate(own) if list(own).count(s) == 1), 0) if len(own) == 3 else 0
    sections = [half // 4] * 3
    sections[rest] = half - 2 * (half // 4)
    return dict(rope, mrope_section=sections)


def _multimodal_rotary(model_type: str) -> list[int] | None:
    """The sections the model splits its rotary frequencies into by its own default where the
    config gives none (``rope_parameters.get("mrope_section", [16, 24, 24])``), or None."""
    import re

    cls = model_class(model_type)
    module = sys.modules.get(cls.__module__) if cls is not None else None
    found = re.search(r'get\("mrope_section", \[([\d, ]+)\]', inspect.getsource(module)) if module else None
    return [int(s) for s in found.group(1).split(",")] if found else None


def model_class(model_type: str):
    """The model class a row builds: the class transformers maps its config to, or a
    composite's part's own (part_class)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return _mapped_class(model_type) or part_class(CONFIG_MAPPING[model_type])


def _mapped_class(model_type: str):
    """The causal LM, else the base model, transformers maps the config to."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    parts = set((getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {}).values())
    for names in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES):
        found = getattr(transformers, names.get(model_type) or "", None)
        # a causal LM of a composite's text part takes that part's config (Llama 4's), not the composite's
        if isinstance(found, type) and getattr(found, "config_class", None) not in parts:
            return found
    return None


def part_class(config_class):
    """A composite model's part that transformers maps no class to (Qwen2.5-Omni's thinker
    text model, Llama 4's vision model): the model class its modeling module builds on that
    config alone, as the composite builds it; one that takes token ids first. Else a class
    of the composite's that the module builds on the part's config (T5Gemma's encoder and
    decoder: ``T5GemmaEncoder(config.encoder)``, their config_class the composite's). None
    where the module has neither."""
    import importlib

    from transformers import PreTrainedModel

    try:
        module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    found = list({id(c): c for _, c in sorted(vars(module).items()) if isinstance(c, type)
                  and issubclass(c, PreTrainedModel) and getattr(c, "config_class", None) is config_class
                  and "forward" in vars(c)}.values())  # not the part's abstract PreTrainedModel
    if not found:  # ``Cls(config.<part>)`` in the module: the composite's first such part first, as _as_a_part's
        source = inspect.getsource(module)
        classes = [c for _, c in sorted(vars(module).items())
                   if isinstance(c, type) and issubclass(c, PreTrainedModel) and "forward" in vars(c)]
        names = dict.fromkeys(n for c in classes for n, held in (getattr(c.config_class, "sub_configs", None)
                                                                 or {}).items() if held is config_class)
        found = [c for n in names for c in classes if f"{c.__name__}(config.{n})" in source]
    takes_ids = [c for c in found if list(inspect.signature(c.forward).parameters)[1:2] == ["input_ids"]]
    return (takes_ids or found or [None])[0]


def tokens(n: int, generator: torch.Generator) -> dict:
    return {"input_ids": torch.randint(3, VOCAB, (n, SEQ), generator=generator)}


@dataclasses.dataclass(frozen=True)
class Inputs:
    """input_fn of a row whose model does not take token ids, named by the forward's argument
    that asks for it: the embeddings a composite hands its part (Qwen3-Omni's talker:
    ``inputs_embeds``), with any count it requires (COUNTS); token ids with what the composite
    hands beside them (BESIDE_IDS); images for a vision model (``pixel_values``, the config's channels at
    its image size); a Qwen-style encoder's flattened patches (``grid_thw``: its first argument
    a row of channels x temporal x patch^2 an image, each image one patch, as the merge of none
    in TINY allows, so that dim 0 stays the batch dp splits); Gemma 4's patch sequences
    (``pixel_position_ids``: pooling_kernel_size^2 patches an image, pooled into one token); a
    draft model's context (``context_hidden_states``: DFlash's noise embeddings and the target
    model's hidden states at each target layer). Module-level, as Tiny."""

    model_type: str
    kind: str  # one of KINDS

    def __call__(self, n: int, generator: torch.Generator) -> dict:
        config = tiny_config(self.model_type)
        if self.kind in BESIDE_IDS:  # an encoder's states as wide as the decoder's cross-attention reads them
            width = getattr(config, "cross_attention_hidden_size", None) or config.hidden_size
            return tokens(n, generator) | {self.kind: torch.randn(n, BESIDE_IDS[self.kind], width, generator=generator)}
        if self.kind == "inputs_embeds":
            required = [p.name for p in inspect.signature(model_class(self.model_type).forward).parameters.values()
                        if p.default is p.empty]
            return {"inputs_embeds": torch.randn(n, SEQ, config.hidden_size, generator=generator)} \
                | {k: v for k, v in COUNTS.items() if k in required}
        if self.kind == "context_hidden_states":
            width = len(config.target_layer_ids) * config.hidden_size
            return {"noise_embeds": torch.randn(n, SEQ, config.hidden_size, generator=generator),
                    "context_hidden_states": torch.randn(n, SEQ, width, generator=generator)}
        channels = getattr(config, "in_channels", None) or getattr(config, "num_channels", 3)
        patch = getattr(config, "patch_size", 14)
        patch = patch if isinstance(patch, int) else patch[0]
        if self.kind == "grid_thw":
            temporal = getattr(config, "temporal_patch_size", None) or getattr(config, "patch_temporal", 1)
            first = list(inspect.signature(model_class(self.model_type).forward).parameters)[1]
            return {first: torch.randn(n, channels * temporal * patch ** 2, generator=generator),
                    "grid_thw": torch.ones(n, 3, dtype=torch.long)}
        if self.kind == "pixel_position_ids":
            side = getattr(config, "pooling_kernel_size", 1)
            grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1)
            return {"pixel_values": torch.rand(n, side * side, channels * patch ** 2, generator=generator),
                    "pixel_position_ids": grid.reshape(1, -1, 2).expand(n, -1, -1).clone()}
        side = getattr(config, "image_size", 32)
        side = side if isinstance(side, int) else side[0]
        return {"pixel_values": torch.randn(n, getattr(config, "num_channels", 3), side, side, generator=generator)}


KINDS = ("inputs_embeds", "pixel_values", "grid_thw", "pixel_position_ids", "context_hidden_states", *BESIDE_IDS)


def input_fn(model_type: str, causal: bool):
    """What the row's model takes: token ids (with labels for a causal LM's own loss), else
    the first of Inputs' kinds its forward takes by name (as the loop passes it: model_keys)
    and runs on, tried on one device in float32 (a part's forward may name input_ids and
    still refuse them). Token ids where none runs: the row then says how they fail."""
    from tpdp_verify.ranks.loop import model_keys

    ids = tokens_and_labels if causal else tokens
    model = Tiny(model_type)()
    kinds = [k for k in KINDS if model_keys(model, {k: None})]
    for fn in [ids] + [Inputs(model_type, k) for k in kinds]:
        try:
            with torch.no_grad():
                model(**fn(2, torch.Generator().manual_seed(0)))
        except Exception:
            continue
        return fn
    return ids


def tokens_and_labels(n: int, generator: torch.Generator) -> dict:
    """A causal LM's own loss: the same ids as labels."""
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


def own_loss(out, batch) -> torch.Tensor:
    """The loss a causal LM computes from its labels (the batch's mean)."""
    return out.loss


def architectures(only: list[str] | None = None) -> dict[str, dict]:
    """model_type -> its config class, model class, its TP plan's styles and whether it
    has an expert plan, for every config class of the installed transformers with a
    ``base_model_tp_plan`` (whose model_type holds one of ``only``, or is one written ``=name``,
    where given)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = {}
    for model_type in sorted(CONFIG_MAPPING.keys()):
        if only and not any(model_type == s[1:] if s.startswith("=") else s in model_type for s in only):
            continue
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:  # a config whose module does not import here: not shipped usable
            continue
        plan = getattr(cls, "base_model_tp_plan", None)
        if plan:
            model = model_class(model_type)
            out[model_type] = {"config": cls.__name__, "model": model.__name__ if model else None,
                               "styles": sorted(set(plan.values())),
                               "experts": bool(getattr(cls, "base_model_ep_plan", None))}
    return out


def run_row(model_type: str, arch: dict, layout: Layout, pools: dict) -> dict:
    """One architecture under one layout: its verdict, or why it could not run."""
    from tpdp_verify import verify_plan
    from tpdp_verify.errors import PoolError, UsageError
    from tpdp_verify.integrations import transformers as stack
    from tpdp_verify.integrations.findings import explained

    if layout.experts_only and not arch["experts"]:
        return {"result": "n/a", "detail": "no expert plan"}
    if arch["model"] is None:
        return {"result": "composite part", "detail": "no model class builds this config alone"}
    causal = arch["model"].endswith("ForCausalLM")
    start = time.monotonic()
    try:
        report = verify_plan(Tiny(model_type), parallelize_fn=getattr(stack, layout.parallelize),
                             dp_alone_fn=stack.dp_alone, dp="own", mesh=layout.mesh,
                             input_fn=_input_fn(model_type, causal), loss_fn=own_loss if causal else None,
                             steps=2, pool=pools[math.prod(layout.mesh)], replay=replay(model_type, layout))
    except UsageError as exc:
        said = " ".join(str(exc).split())  # a model that cannot be verified may be a finding itself (T7)
        return {"result": "not run", "detail": said, "finding": explained(model_type, said),
                "seconds": round(time.monotonic() - start, 1)}
    except PoolError as exc:  # the ranks would not start again: the harness's, no verdict
        return {"result": "INFRA", "detail": " ".join(str(exc).split()), "seconds": round(time.monotonic() - start, 1)}
    said = str(report)
    finding = "" if report.ok else explained(model_type, said)
    return {"result": report.status.label, "departs": not report.ok, "finding": finding,
            "detail": "" if report.ok else _departure(report), "seconds": round(time.monotonic() - start, 1),
            "substituted": report.one_device.substituted}


def _input_fn(model_type: str, causal: bool):
    """input_fn, or token ids where the model does not build (verify_plan says why)."""
    try:
        return input_fn(model_type, causal)
    except Exception:
        return tokens_and_labels if causal else tokens


def replay(model_type: str, layout: Layout) -> str:
    return f"python -m tpdp_verify.integrations.conformance -k {model_type} --layouts {layout.name}"


def _departure(report) -> str:
    """Where and how a report departs, in a line: the first module, the first failed check."""
    verdict = report.one_device if not report.one_device.ok else report.plain_ddp
    failed = next((c for c in verdict.checks if not c.ok), None)
    said = f"{failed.name}: {failed.detail}" if failed else "values beyond their bound"
    where = f"{verdict.module_is} {verdict.first_module}: " if verdict.first_module else ""
    return " ".join((where + said).split())[:300]


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every row that departs is a known finding, 1 when one is not (a new one to
    look at), 2 on bad arguments."""
    parser = argparse.ArgumentParser(prog="python -m tpdp_verify.integrations.conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="only", action="append",
                        help="architectures whose model_type holds this (=NAME: is NAME)")
    parser.add_argument("--layouts", default=list(LAYOUTS), type=_layouts,
                        help=f"comma separated, of {', '.join(LAYOUTS)} (default: all)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--rank-output", help="a directory for the ranks' output (default: a temporary one)")
    args = parser.parse_args(argv)
    layouts = [LAYOUTS[n] for n in args.layouts]
    archs = architectures(args.only)
    if not archs:
        parser.error(f"no architecture of transformers' that ships a TP plan has a model_type holding "
                     f"{' or '.join(map(repr, args.only))}")
    rows: dict[str, dict] = {k: {**v, "layouts": {}} for k, v in archs.items()}
    with tempfile.TemporaryDirectory(prefix="tpdp-conformance-") as scratch:
        _run(rows, layouts, args, args.rank_output or scratch)
    new = [(k, n) for k, row in rows.items() for n, cell in row["layouts"].items()
           if cell.get("departs") and not cell.get("finding") or cell["result"] == "INFRA"]
    print(f"{len(rows)} architectures, {sum(len(r['layouts']) for r in rows.values())} cells; "
          + (f"{len(new)} depart with no finding to explain them, or had no verdict: "
             f"{', '.join(f'{k} {n}' for k, n in new)}" if new else "every departure is a known finding"))
    return 1 if new else 0


def _layouts(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    wrong = [n for n in names if n not in LAYOUTS]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(wrong) or repr(text)}: layouts are {', '.join(LAYOUTS)}")
    return names


def _run(rows: dict, layouts: list[Layout], args, logs: str) -> None:
    """Every row under every layout, on one pool a world size; the outputs written after each."""
    from tpdp_verify.ranks.pool import RankPool, warm_up

    warm_up(("transformers", "tpdp_verify.integrations.transformers", __name__))
    pools = {world: RankPool(world, timeout=120.0, output=logs)
             for world in sorted({math.prod(layout.mesh) for layout in layouts})}
    try:
        for model_type, row in rows.items():
            for layout in layouts:
                cell = row["layouts"][layout.name] = run_row(model_type, row, layout, pools)
                print(f"{model_type:32} {layout.name:9} {cell['result']:10} {cell.get('detail', '')[:120]}",
                      flush=True)
                _write(args, rows, layouts)
    finally:
        for pool in pools.values():
            pool.close()


def _write(args, rows: dict, layouts: list[Layout]) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, layouts))


INTRO = ("# transformers conformance",
         "",
         "Every architecture of the installed transformers whose config ships a `base_model_tp_plan`, built",
         "from its config class with every size small (`TINY` in tpdp_verify/integrations/conformance.py:",
         "heads, key-value heads and experts divisible by 2, one layer of each kind), trained 2 steps",
         "through transformers' own stack (`tpdp-verify plan --stack transformers`: its TP layers, its EP,",
         "its FSDP2 with the model's `fsdp_plan`) and judged against one device in float64 and against",
         "transformers' own DP alone. A causal LM trains on its own loss from labels; a base model on the",
         "mean square of its output. A composite model's part that transformers maps no class to (a",
         "multimodal model's text part) runs as the model class its modeling module builds on that config,",
         "its config as the composite builds it; one whose forward refuses token ids gets what its composite",
         "would hand it, by the forward's argument names (`Inputs`): embeddings (Qwen3-Omni's talker, with a",
         "count it requires: DeepSeek-OCR 2's encoder), an encoder's states beside token ids (a decoder alone),",
         "the layers' conditioning (Voxtral Realtime's), images, or a vision encoder's flattened patches with",
         "their grid. Each image is then one patch (the merge sizes 1, so that every input's dim 0 is the batch",
         "dp splits): its attention attends to one token, and the query and key projections' sharding is not",
         "exercised there. Regenerate (about 25 minutes on 2 cores):",
         "",
         "    python -m tpdp_verify.integrations.conformance --markdown docs/transformers-conformance.md",
         "",
         "A cell is PASS; n/a (EP for an architecture without an expert plan); DIVERGES with a finding's",
         "code (below: whose code, its reproduction, `tpdp-verify report T1` drafts the issue) or a torch",
         "fault of the catalog (docs/known-divergences.md), or with where",
         "and how it departs where no finding explains it yet; composite part: a part no model class builds",
         "alone (its composite's classes take the composite's config); or not run, with why: a tiny config",
         "or input this derivation does not fit to the architecture (a limitation of the table, not",
         "a verdict: the architecture's own tester config and inputs would lift it). Layouts: tp",
         "(DistributedConfig(tp_size=2)), tp_fsdp2 (fsdp_size=2), hsdp (dp_replicate_size=2), ep (ep_size=2,",
         "experts split by expert).")


def markdown(rows: dict, layouts: list[Layout]) -> str:
    """The table: a row an architecture, a cell a layout's verdict (a finding by its code),
    after a count of each kind of cell and the findings' list."""
    import transformers

    from tpdp_verify.faults import CATALOG
    from tpdp_verify.integrations.findings import FINDINGS, TORCH_FAULTS

    catalog = {f.number: f for f in CATALOG}

    cells = {(k, l.name): _cell(row["layouts"].get(l.name)) for k, row in rows.items() for l in layouts}
    kinds = sorted({c.split(":")[0] for c in cells.values()})
    counts = ["| cell | " + " | ".join(l.name for l in layouts) + " |", "|---|" + "---|" * len(layouts)]
    counts += [f"| {kind} | " + " | ".join(str(sum(cells[k, l.name].split(":")[0] == kind for k in rows))
                                            for l in layouts) + " |" for kind in kinds]
    found = [f"- **{f.code}** ({f.project}, {', '.join(f.architectures)}): {f.title}. At fault: `{f.source}`. "
             f"Fix: {f.fix}. Reproduction: `python tpdp_verify/integrations/repros/{f.repro}`" for f in FINDINGS]
    found += [f"- **fault {n}** (torch, {', '.join(seen.architectures)}): {catalog[n].title}. "
              f"`tpdp-verify explain {n}`; reproduction: `tpdp-verify report {n}`" for n, seen in TORCH_FAULTS.items()]
    head = ["| architecture | model | " + " | ".join(f"{l.name} ({'x'.join(map(str, l.mesh))})" for l in layouts)
            + " |", "|---|---|" + "---|" * len(layouts)]
    body = [f"| {k} | {row['model'] or ''} | " + " | ".join(cells[k, l.name].replace("|", "\\|") for l in layouts)
            + " |" for k, row in rows.items()]
    return "\n".join([*INTRO, "", f"Measured on transformers {transformers.__version__}, torch {torch.__version__}, "
                      f"2 cores, gloo: {len(rows)} architectures.", "", "## Count", "", *counts, "",
                      "## Findings", "", *found, "", "## The table", "", *head, *body]) + "\n"


def _cell(row: dict | None) -> str:
    """A layout's verdict as the table says it: PASS, n/a, a finding's code, or what departs."""
    if row is None:
        return ""
    if row["result"] in ("not run", "composite part"):
        return f"{row['result']}: {row['finding'] + ': ' if row.get('finding') else ''}{row['detail']}"
    if row.get("finding"):
        return f"{row['result']}: {row['finding']}"
    return row["result"] + (f": {row['detail']}" if row.get("detail") else "")


if __name__ == "__main__":
    sys.exit(main())
