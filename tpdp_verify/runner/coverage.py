"""Which keywords of the installed torch's DP entry points no case sets: what a release
engineer running the gate on a newer torch must know the gate did not exercise.

Read from the signatures themselves (``inspect.signature``), so a keyword a new torch adds
shows here the first time the gate runs on it.
"""

from __future__ import annotations

import importlib
import inspect

from tpdp_verify.ranks.entries import SETS

# The entry point (as the report names it) -> where its callable lives.
ENTRY_POINTS = {
    "DistributedDataParallel": ("torch.nn.parallel", "DistributedDataParallel.__init__"),
    "replicate": ("torch.distributed._composable.replicate", "replicate"),
    "replicate (FSDP2-based)": ("torch.distributed._composable.replicate_with_fsdp", "replicate"),
    "fully_shard": ("torch.distributed.fsdp", "fully_shard"),
    "FullyShardedDataParallel": ("torch.distributed.fsdp", "FullyShardedDataParallel.__init__"),
}
_NOT_KEYWORDS = ("self", "module")


def keywords(where: tuple[str, str]) -> list[str] | None:
    """The keyword parameters of the callable at ``where``, or None where this torch has none."""
    module, qualname = where
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    params = inspect.signature(obj).parameters.values()
    return [p.name for p in params if p.name not in _NOT_KEYWORDS and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


# Keywords no case sets on purpose, and why (by name, or by entry point and name); listed
# with the reason, not as news.
REASONS = {
    "device_ids": "a CUDA module on one device; the CPU ranks take none, NCCL ranks set the device instead",
    "output_device": "with device_ids only",
    "dim": "the dimension DP splits the batch on; every case splits dim 0",
    "broadcast_buffers": "torch 2.13's deprecated name of forward_sync_buffers, which cases set",
    "check_reduction": "deprecated: does nothing",
    ("DistributedDataParallel", "mixed_precision"):
        "DDP's _MixedPrecision is CUDA-only in torch 2.13: its root copy hook records CUDA events "
        "('cpu backend doesn't support events' on the CPU, with or without TP); gloo cases cannot run it",
    "delay_all_reduce_named_params":
        "needs the parameter whose gradient autograd computes last (param_to_hook_all_reduce), which depends on "
        "the model's forward; torch 2.13 launches that all-reduce asynchronously and never waits on it, a race "
        "with the optimizer step on gloo",
    "param_to_hook_all_reduce": "with delay_all_reduce_named_params only",
    "offload_policy":
        "CPUOffloadPolicy keeps parameters on the CPU between steps: the CPU ranks hold them there already",
    "cpu_offload": "FSDP1's CPUOffload keeps parameters on the CPU between steps: the CPU ranks hold them there already",
    "param_init_fn": "materializes modules built on the meta device; every case builds its model on the rank's device",
    "sync_module_states": "broadcasts the first dp rank's parameters at wrap time; every rank builds the same model "
                          "from the case's seed, so it copies equal values",
    "ignored_states": "the newer name of ignored_modules, which cases set (Habits.ignored)",
    # Communication order on FSDP1's streams; tests/test_large_dp.py shows they change no value
    "backward_prefetch": "orders FSDP1's all-gathers in backward; the same values (tests/test_large_dp.py)",
    "forward_prefetch": "orders FSDP1's all-gathers in forward; the same values (tests/test_large_dp.py)",
    "limit_all_gathers": "bounds FSDP1's all-gathers in flight; the same values (tests/test_large_dp.py)",
}


def unexercised() -> dict[str, list[str]]:
    """Entry point -> its keywords that no case sets, for each this torch has; an entry point
    no case reaches lists every keyword."""
    out = {}
    for name, where in ENTRY_POINTS.items():
        found = keywords(where)
        if found is not None:
            out[name] = [k for k in found if k not in SETS.get(name, ())]
    return out


def reason(entry: str, keyword: str) -> str:
    """Why no case sets ``keyword`` of ``entry``; "" where none is on record."""
    return REASONS.get((entry, keyword), REASONS.get(keyword, ""))


def summary_line(missing: dict[str, list[str]]) -> str:
    """One line: each entry point's unset keywords, those not set on purpose in parentheses."""
    def named(entry: str, ks: list[str]) -> str:
        return ", ".join([k for k in ks if not reason(entry, k)] + [f"({k})" for k in ks if reason(entry, k)])

    listed = "; ".join(f"{name}: {named(name, ks)}" for name, ks in missing.items() if ks)
    return (f"keywords of this torch's DP entry points that no case sets: {listed or 'none'}"
            + (" (in parentheses: not set on purpose, the JSON says why)" if listed else ""))


def record(missing: dict[str, list[str]]) -> dict:
    """For the JSON: entry point -> keyword -> why it is not set ("" where no case reaches it yet)."""
    return {name: {k: reason(name, k) for k in ks} for name, ks in missing.items()}
