"""The single-device oracle: the unsharded model, the global batch, one process.

It runs twice: in the case's dtype (float32 unless the case says bfloat16 or float16), the
rounded run, whose rounding error earns the tolerance, and in float64, the shadow taken as
exact (see tpdp_verify.judging.tolerance).
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import torch

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.errors import UsageError
from tpdp_verify.ranks.loop import Run, Trace, build, make_optimizer, train


class Oracle(NamedTuple):
    rounded: Trace  # the case's dtype: its rounding error against the shadow earns each bound
    shadow: Trace  # float64


def run(case: TrainCase, dtype: torch.dtype | None = None, capture: bool = False) -> Trace:
    """The case on one device: every sample of every global batch, no wrapper."""
    model = build(case, dtype)
    substituted = float64_kernels(model) if dtype == torch.float64 else []
    handles = dict(model.named_parameters(remove_duplicate=False))
    trace = train(case, Run(model, model, slice(None), handles=handles),
                  lambda: make_optimizer(case, model.parameters()), capture, dtype)
    if trace.error and case.user is not None:  # a user's model that cannot train unsharded: theirs to fix
        precision = " in float64 (the exact run every bound is measured against)" if dtype == torch.float64 else ""
        raise UsageError(f"the model does not train on one device{precision}: {trace.error.splitlines()[0]}; "
                         "tpdp-verify compares the sharded run with that one, so make it train unsharded first")
    if trace.error:  # the oracle is the fixed point: if it cannot train, the case is ours to fix
        raise RuntimeError(f"the single-device oracle failed on {case!r}: {trace.error}")
    trace.substituted = substituted
    return trace


def float64_kernels(model) -> list[str]:
    """Where the model runs a kernel that has no float64 path, the same math in another
    kernel its library offers, for the float64 run alone; what was put in whose place (the
    report says it). The ranks run the model as it comes.

    transformers' MoE experts go through ``grouped_mm`` (no float64 kernel) unless told
    ``set_experts_implementation("eager")``: a loop over the experts, each a plain matmul."""
    said = []
    config = getattr(model, "config", None)
    experts = getattr(config, "_experts_implementation", None)
    if experts not in (None, "eager") and callable(getattr(model, "set_experts_implementation", None)):
        model.set_experts_implementation("eager")
        said.append(f"the MoE experts ran eagerly (experts_implementation 'eager' for {experts!r}, which "
                    "has no float64 kernel)")
    kept = _kept_in_float32(model)
    if kept:
        said.append(f"what the model keeps in float32 at any dtype (_keep_in_fp32_modules_strict: {', '.join(kept)}) "
                    "stayed float32, as transformers keeps it under bfloat16 and float16")
    return said


def _kept_in_float32(model) -> list[str]:
    """A transformers model's modules declared float32 at any dtype
    (``_keep_in_fp32_modules_strict``: an MoE router whose forward casts its input
    ``.float()``) kept so: transformers' loader keeps them float32 under bfloat16 and float16,
    not under float64, where that forward would meet a float64 weight. The globs that matched,
    matched as transformers' loader matches them (``*`` any run of characters, searched in the
    parameter's or buffer's name; core_model_loading.build_glob_alternation), without
    importing transformers: the core never imports an optional extra."""
    globs = sorted(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    patterns = {glob: re.compile(glob.replace("*", ".*")) for glob in globs}
    matched = set()
    for prefix, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                full = f"{prefix}.{name}" if prefix else name
                found = [glob for glob, pattern in patterns.items() if pattern.search(full)]
                if t is None or t.dtype != torch.float64 or not found:
                    continue
                if isinstance(t, torch.nn.Parameter):
                    t.data = t.data.float()
                else:
                    store[name] = t.float()
                matched.add(found[0])
    return [g for g in globs if g in matched]


@functools.lru_cache(maxsize=32)  # shrinking replays a case many times
def oracle(case: TrainCase, capture: bool = False) -> Oracle:
    return Oracle(run(case, case.torch_dtype, capture), run(case, torch.float64, capture))
