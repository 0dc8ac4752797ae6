"""A verify_plan call as a case: the user's model, plan, data and loss (``UserModel``) in a
``TrainCase``, its arguments checked (``make_case``)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tpdp_verify.cases.training import DP, DP_FORMS, ON_3D_ONLY, ON_3D_TOO, TRAIN_DTYPES, DDPOptions, TrainCase
from tpdp_verify.errors import UsageError


def name_of(fn) -> str:
    """``module:qualname``, how the CLI and the replay line name a function; a script's
    functions by the script's name, the module its directory imports."""
    module = getattr(fn, "__module__", "?")
    if module in ("__main__", "__mp_main__"):
        module = Path(getattr(sys.modules[module], "__file__", module)).stem
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def mean_square(out, batch: dict) -> torch.Tensor:
    """The default per-sample loss: the mean square of each sample's output (of a pytree
    output, its first tensor leaf with the batch's rows: a ModelOutput's logits)."""
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import DTensor

    rows = len(next(v for v in batch.values() if isinstance(v, torch.Tensor)))
    out = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() and len(t) == rows), out)
    if isinstance(out, DTensor):  # whole but for the batch's rows where DP shards them (the SPMD form)
        from torch.distributed.tensor import Replicate

        out = out.redistribute(placements=[p if p.is_shard(0) else Replicate() for p in out.placements])
    return out.reshape(len(out), -1).pow(2).mean(1)


# What input_fn's dict may hold besides tensors: an argument the forward takes whole on every
# rank, the same for every sample (DeepSeek-OCR 2's encoder: ``num_patches: int``), never split.
CONSTANTS = (bool, int, float, str)


def as_batch(value) -> dict:
    """input_fn's result as the training loop takes it: a dict with the model's "input", or
    with the keyword arguments of its forward (and any targets): tensors, each split over dp
    along dim 0, and constants (CONSTANTS), given whole to every rank."""
    if isinstance(value, torch.Tensor):
        return {"input": value}
    if isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()) \
            and all(isinstance(v, (torch.Tensor, *CONSTANTS)) for v in value.values()):
        return value
    raise UsageError(f"input_fn returned {type(value).__name__}: return the model's input tensor, or a dict of "
                     "tensors: the input under 'input' or the forward's keyword arguments by name, and any targets "
                     "(and any argument the forward takes whole on every rank as an int, float, bool or str)")


@dataclass(frozen=True)
class UserModel:
    """A user's model, plan, data and loss, as a case carries them to the ranks (by name)."""

    model_fn: Callable[[], nn.Module]
    plan: object  # a tuple of (key, style) pairs, a callable tp_mesh -> dict, or None
    input_fn: Callable[[int, torch.Generator], object]  # (n samples, generator) -> batch
    loss_fn: Callable | None = None  # (output, batch) -> one loss per sample
    optimizer_fn: Callable | None = None  # parameters -> optimizer
    loss_parallel: bool = False
    parallelize_fn: Callable | None = None  # (model, (dp, tp) mesh) -> the TP'd model, in place of plan
    dp_alone_fn: Callable | None = None  # with dp="own": (model, mesh) -> the same DP without TP

    def fixture(self):
        from hypothesis import strategies as st

        from tpdp_verify.fixtures.zoo import Fixture, Size

        return Fixture(name=name_of(self.model_fn), build=lambda size: self.model_fn(),
                       plan=lambda size: self.plan if callable(self.plan) else dict(self.plan or ()),
                       batch=lambda gen, n, size: as_batch(self.input_fn(n, gen)),
                       per_sample_loss=self.loss_fn or mean_square, sizes=lambda tp: st.just(Size()),
                       loss_parallel=self.loss_parallel, parallelize=self.parallelize_fn,
                       dp_alone=self.dp_alone_fn)


def make_case(model_fn, plan, *, mesh, input_fn, loss_fn, steps, optimizer_fn, dp, dtype, batch,
              accumulate, ddp_options, loss_parallel, seed, parallelize_fn=None, dp_alone_fn=None,
              loss_share=False) -> TrainCase:
    """The TrainCase of a verify_plan call, its arguments checked."""
    if not callable(model_fn) or not callable(input_fn):
        raise UsageError("model_fn and input_fn must be callables: model_fn() -> nn.Module, "
                         "input_fn(n, generator) -> the input of n samples")
    if (plan is None) == (parallelize_fn is None):
        raise UsageError("give a plan (module path -> ParallelStyle) or parallelize_fn(model, mesh), "
                         f"{'not both' if plan is not None else 'one of them'}")
    if dp == "own" and parallelize_fn is None:
        raise UsageError("dp='own' means your parallelize_fn wraps DP itself: give parallelize_fn(model, mesh), "
                         "or a dp for tpdp-verify to wrap the plan's model with")
    if dp_alone_fn is not None and (dp != "own" or not callable(dp_alone_fn)):
        raise UsageError("dp_alone_fn(model, mesh) applies your DP without TP, for the plain-DP run of a "
                         "parallelize_fn that wraps DP itself: give a function, with dp='own'")
    if loss_share and dp != "own":
        raise UsageError("loss_share: each rank's loss is its share of the step's (summed over dp), which needs a DP "
                         "that sums gradients: a parallelize_fn that wraps it, with dp='own' (torchtitan's does)")
    if parallelize_fn is not None and not callable(parallelize_fn):
        raise UsageError(f"parallelize_fn is a {type(parallelize_fn).__name__}; give a function "
                         "(model, mesh) -> model that applies your TP to mesh['tp']")
    if plan is not None and not (callable(plan) or isinstance(plan, dict) or plan == "auto"):
        raise UsageError(f"plan is a {type(plan).__name__}; give a dict as parallelize_module takes it "
                         "(module path -> ParallelStyle, or transformers' style string), a function "
                         "tp_mesh -> dict, or 'auto' for the model's own tp_plan")
    if (not isinstance(mesh, (tuple, list)) or len(mesh) not in (2, 3)
            or not all(isinstance(d, int) and d >= 1 for d in mesh)):
        raise UsageError(f"mesh must be (dp, tp) or (dp_replicate, dp_shard, tp), positive ints, not {mesh!r}")
    if dp not in DP:
        raise UsageError(f"dp must be one of {', '.join(DP)}, not {dp!r}")
    if len(mesh) == 3 and dp not in ON_3D_ONLY + ON_3D_TOO:
        raise UsageError(f"dp={dp!r} takes a 1-D DP mesh; a (dp_replicate, dp_shard, tp) mesh takes "
                         f"{', '.join(ON_3D_ONLY + ON_3D_TOO)}")
    if len(mesh) == 2 and dp in ON_3D_ONLY:
        raise UsageError(f"dp={dp!r} needs a (dp_replicate, dp_shard, tp) mesh, e.g. mesh=(2, 2, 2)")
    dp_ranks = math.prod(mesh[:-1])
    name = str(dtype).removeprefix("torch.")
    if name not in TRAIN_DTYPES:
        raise UsageError(f"dtype must be one of {', '.join(TRAIN_DTYPES)}, not {name}")
    if not isinstance(steps, int) or steps < 1 or not isinstance(accumulate, int) or accumulate < 1:
        raise UsageError(f"steps and accumulate must be positive ints, not {steps!r} and {accumulate!r}")
    batch = 2 * dp_ranks if batch is None else batch
    if not isinstance(batch, int) or batch < dp_ranks or batch % dp_ranks:
        raise UsageError(f"batch={batch!r} does not split over dp={dp_ranks} ranks: give a multiple of {dp_ranks}")
    try:  # a list (bucket_cap_mb_list) as a tuple: a case is hashable
        ddp = DDPOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in (ddp_options or {}).items()})
    except TypeError as exc:
        raise UsageError(f"ddp_options: {exc}; the keys are those of tpdp_verify.cases.training.DDPOptions") from None
    user = UserModel(model_fn, plan if plan is None or callable(plan) or plan == "auto" else tuple(plan.items()),
                     input_fn,
                     loss_fn, optimizer_fn, loss_parallel, parallelize_fn, dp_alone_fn)
    form = DP_FORMS.get("fsdp1_hybrid" if (dp, len(mesh)) == ("fsdp1", 3) else dp, {})
    return TrainCase(model=name_of(model_fn), mesh_shape=tuple(mesh), entry=DP[dp], ddp=ddp, steps=steps,
                     accumulate=accumulate, local_batch=batch // dp_ranks, seed=seed, dtype=name, user=user,
                     loss_reduction="sum_over_count" if loss_share else "", **form)
