"""Plans as the ecosystem writes them, turned into what ``parallelize_module`` takes.

transformers names its TP styles with strings (a model's ``tp_plan``, its config's
``base_model_tp_plan``); here each string maps to torch's own ParallelStyle with the layouts
transformers registers for it (transformers.distributed.tensor_parallel: "colwise" is
ColwiseParallel(input Replicate, output Shard(-1)), ...). Strings naming styles that torch
has no ParallelStyle for (transformers' packed, MoE and MLA layers) are refused in one line.
Keys written relative to a model's base model (``base_model_tp_plan``'s ``layers.*...``)
resolve under its ``base_model_prefix``. Nothing here imports transformers.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

from tpdp_verify.errors import UsageError

AUTO = "auto"  # the model's own plan: transformers' ``model.tp_plan``


def _styles() -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1)),
        "rowwise": lambda: RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    }


def accepted() -> str:
    return ", ".join(_styles())


def torch_plan(model: nn.Module, plan) -> dict:
    """``plan`` (a dict of module path -> ParallelStyle or transformers' style string, or
    "auto") as parallelize_module takes it for ``model``."""
    if plan == AUTO:
        plan = getattr(model, "tp_plan", None)
        if not isinstance(plan, dict) or not plan:
            raise UsageError(f"plan='auto' takes the model's own TP plan (transformers' model.tp_plan); "
                             f"{type(model).__name__} has none: give a plan dict or parallelize_fn")
    styles, out = _styles(), {}
    for key, style in plan.items():
        if isinstance(style, str):
            if style not in styles:
                raise UsageError(f"plan key {key!r}: style {style!r} is not one tpdp-verify can map to torch's "
                                 f"ParallelStyles; the strings it accepts (as transformers maps them): {accepted()}")
            style = styles[style]()
        out[_prefixed(model, key)] = style
    return out


def resolve(model: nn.Module, key: str) -> list[str]:
    """The modules a plan key reaches, as parallelize_module walks it: each dotted atom an
    fnmatch pattern over the children's names."""
    found = [("", model)]
    for atom in key.split(".") if key else []:
        found = [(f"{path}.{name}" if path else name, child) for path, module in found
                 for name, child in module.named_children() if fnmatch(name, atom)]
    return [path for path, _ in found]


def _prefixed(model: nn.Module, key: str) -> str:
    """``key`` under the model's base-model prefix when it names nothing from the root but
    names something from there (a config's base_model_tp_plan on a causal-LM wrapper)."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or resolve(model, key) or not isinstance(getattr(model, prefix, None), nn.Module):
        return key
    return f"{prefix}.{key}" if resolve(model, f"{prefix}.{key}") else key
