"""The data-parallel entry points a TP'd model can go through, inside a rank.

Each ``wrap_<entry>`` takes the TP'd model and the 2-D (dp, tp) mesh and returns the model
to call forward on, the user's module inside it, and the context that skips gradient
synchronization for accumulation microbatches.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

from torch import nn

from tpdp_verify import torch_internals
from tpdp_verify.cases.training import TrainCase


class Wrapped(NamedTuple):
    model: nn.Module
    inner: nn.Module
    no_sync: object  # () -> context manager
    whole_params: object = None  # see tpdp_verify.ranks.loop.Run
    state_unobserved: str = ""
    # TP layouts of parameters the wrapper holds as plain local shards, where they could not
    # be recorded before it wrapped (a user's own DP: wrap_own)
    layouts: dict | None = None
    # FSDP2 over a whole SPMD mesh (dp_mesh_dims), where a user's own DP set it (wrap_own): that
    # mesh and its dp dims' names (SpmdBatch), on which its batches are DTensors sharded on dp,
    # as for TrainCase.dp_mesh_dims
    spmd: SpmdBatch | None = None


class SpmdBatch(NamedTuple):
    """The mesh a model's batches are DTensors on, and the names of its dims they are split
    over (the rest replicate them): a user's own FSDP2 over its whole SPMD mesh (torchtitan's
    full_dtensor: its own storage mesh, another object than the harness's)."""
    mesh: object
    dp_dims: tuple[str, ...]


def ignored(model: nn.Module, case: TrainCase) -> nn.Module | None:
    """The module the case tells its DP entry point to ignore (Habits.ignored), or None."""
    from tpdp_verify.ranks.loop import ignorable

    return ignorable(model) if case.habits.ignored else None


def dp_mesh(case: TrainCase, mesh):
    """The mesh the case's DP entry point is given: mesh["dp"] (mesh["dp_replicate",
    "dp_shard"] on a 3-D mesh), or a miswiring's (TrainCase.wiring): mesh["tp"], or the
    whole 2-D mesh."""
    return {"dp_over_tp": mesh["tp"], "dp_over_mesh": mesh}.get(case.wiring, mesh[case.dp_dims])


def _ignore_for_ddp(model, case: TrainCase) -> None:
    """DDP's ignore list (Habits.ignored), named on the model as users name it, before any
    transform or wrapper reads it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if (skip := ignored(model, case)) is not None:
        names = [n for n, p in model.named_parameters() if any(p is q for q in skip.parameters())]
        DDP._set_params_and_buffers_to_ignore_for_model(model, names)


def _ddp(model, case: TrainCase, **group):
    """DistributedDataParallel with the case's options, its ignore list and its comm hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    _ignore_for_ddp(model, case)
    ddp = DDP(model, **group, **case.ddp.kwargs())
    if case.ddp.comm_hook is not None:
        register_comm_hook(ddp, case, ddp.process_group)
    return ddp


def register_comm_hook(ddp, case: TrainCase, group) -> None:
    """The case's built-in communication hook, on a DDP or a DDP-based replicate."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = {"allreduce": default_hooks.allreduce_hook, "fp16_compress": default_hooks.fp16_compress_hook,
            "bf16_compress": default_hooks.bf16_compress_hook}[case.ddp.comm_hook]
    ddp.register_comm_hook(group, hook)


def wrap_ddp_mesh(model, case: TrainCase, mesh, impl) -> Wrapped:
    # dp_by_group: the process group where the mesh belongs, so DDP runs no TP transform
    group = {"process_group": mesh["dp"].get_group()} if case.wiring == "dp_by_group" else \
        {"device_mesh": dp_mesh(case, mesh)}
    ddp = _ddp(model, case, **group)
    return Wrapped(ddp, ddp.module, ddp.no_sync)


def wrap_transform_ddp(model, case: TrainCase, mesh, impl) -> Wrapped:
    _ignore_for_ddp(model, case)  # the list first: the transform is DDP's, and may read it
    impl.pre_dp_module_transform(model)
    ddp = _ddp(model, case, process_group=dp_mesh(case, mesh).get_group())
    return Wrapped(ddp, ddp.module, ddp.no_sync)


def wrap_replicate(model, case: TrainCase, mesh, impl) -> Wrapped:
    from torch.distributed._composable.replicate import replicate

    skip = ignored(model, case)
    replicate(model, device_mesh=dp_mesh(case, mesh), ignored_modules=[skip] if skip else None, **case.ddp.kwargs())
    if case.ddp.comm_hook is not None:  # registered when replicate builds its DDP
        register_comm_hook(model, case, dp_mesh(case, mesh).get_group())
    return Wrapped(model, model, lambda: _replicate_no_sync(model))


@contextlib.contextmanager
def _replicate_no_sync(model):
    # replicate() has no no_sync(); its DDP state does, once the first forward built it.
    from torch.distributed._composable.replicate import replicate

    state = replicate.state(model)
    with state._ddp.no_sync() if getattr(state, "_ddp", None) is not None else contextlib.nullcontext():
        yield


def _fsdp2_ignored(model, case: TrainCase) -> dict:
    skip = ignored(model, case)
    return {"ignored_params": set(skip.parameters())} if skip is not None else {}


def wrap_fully_shard(model, case: TrainCase, mesh, impl) -> Wrapped:
    from torch.distributed.fsdp import fully_shard

    where = {"mesh": mesh, "dp_mesh_dims": spmd_dims(case)} if case.dp_mesh_dims else {"mesh": dp_mesh(case, mesh)}
    placed = {"shard_placement_fn": shard_placement(case, mesh)} if case.fsdp.shard_dim else {}
    fully_shard(model, **where, **placed, **_fsdp2_ignored(model, case), **case.fsdp.kwargs(case.entry))
    return Wrapped(model, model, lambda: _fsdp2_no_sync(model))


def shard_placement(case: TrainCase, mesh):
    """fully_shard's shard_placement_fn for FSDP2Options.shard_dim, as users write one (a
    grouped expert weight sharded on its second dim): that dim where the parameter (its tp
    shard) splits evenly over the ranks FSDP shards over, which torch requires off dim 0;
    else dim 0."""
    from torch.distributed.tensor import Shard

    # HSDP (on the 2-D DP mesh, or dp_mesh_dims both) shards over dp_shard; the rest over every dp dim
    names = ("dp_shard",) if len(case.dp_dims) == 2 and case.dp_mesh_dims != "shard" else case.dp_dims
    ranks = math.prod(mesh.size(mesh.mesh_dim_names.index(n)) for n in names)

    def place(param):
        local = param.to_local() if hasattr(param, "to_local") else param
        dim = case.fsdp.shard_dim
        return Shard(dim) if local.dim() > dim and local.shape[dim] % ranks == 0 else Shard(0)

    return place

def spmd_dims(case: TrainCase):
    """The DataParallelMeshDims of the case's SPMD form: its dp dimensions sharded, replicated
    (flattened where two), or on a 3-D mesh dp_replicate replicated and dp_shard sharded."""
    from torch.distributed.fsdp import DataParallelMeshDims

    dims = case.dp_dims[0] if len(case.dp_dims) == 1 else case.dp_dims
    if case.dp_mesh_dims == "both":
        return DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    return DataParallelMeshDims(**{case.dp_mesh_dims: dims})


def wrap_replicate_fsdp(model, case: TrainCase, mesh, impl) -> Wrapped:
    """The FSDP2-based replicate (torchtitan's): FSDP2's machinery, parameters replicated over dp."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    where = {"mesh": mesh, "dp_mesh_dims": spmd_dims(case)} if case.dp_mesh_dims else {"mesh": dp_mesh(case, mesh)}
    replicate(model, **where, **_fsdp2_ignored(model, case), **case.fsdp.kwargs(case.entry))
    return Wrapped(model, model, lambda: _fsdp2_no_sync(model))


@contextlib.contextmanager
def _fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# The optimizer holds FSDP1's flat shards; the public way to read its state whole,
# FSDP.optim_state_dict, is itself wrong on torch 2.13 with or without TP (exp_avg comes
# back holding exp_avg_sq; docs/properties.md), so it cannot serve as the reading.
FSDP1_STATE = ("FSDP1 keeps it flat-sharded and FSDP.optim_state_dict misreports it "
               "(docs/properties.md); the parameters after every step are compared instead")


def wrap_fsdp1(model, case: TrainCase, mesh, impl) -> Wrapped:
    """FSDP1 on the dp sub-mesh (2-D on a 3-D mesh, with a hybrid sharding strategy): the
    DTensorExtensions path, which flattens each DTensor parameter with the transform's
    flatten/unflatten pair."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    from tpdp_verify.ranks.rank import device_type

    # FSDP1 runs on the CPU only when told to: without device_id it looks for an accelerator.
    device = torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")
    skip = ignored(model, case)
    strategy = {"sharding_strategy": ShardingStrategy[case.fsdp1_strategy]} if case.fsdp1_strategy else {}
    # dp_by_group: the process group where the mesh belongs, so FSDP1 installs no DTensor extension
    group = {"process_group": mesh["dp"].get_group()} if case.wiring == "dp_by_group" else \
        {"device_mesh": dp_mesh(case, mesh)}
    return _driven_fsdp1(FSDP(model, **group, use_orig_params=True, device_id=device,
                              ignored_modules=[skip] if skip else None, **strategy, **case.fsdp1.kwargs(model)))


def _driven_fsdp1(fsdp) -> Wrapped:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from tpdp_verify.ranks.loop import user_named

    @contextlib.contextmanager
    def whole_params():
        with FSDP.summon_full_params(fsdp, with_grads=True):
            yield dict(user_named(fsdp.module.named_parameters(remove_duplicate=False)))

    return Wrapped(fsdp, fsdp.module, fsdp.no_sync, whole_params, FSDP1_STATE)


def wrap_own(model, case: TrainCase, mesh, impl) -> Wrapped:
    """dp="own": the user's parallelize function applied DP itself; find which entry point,
    to drive its microbatches as it expects."""
    entry = own_entry(model)
    if entry is None and case.dp == 1:  # one dp rank: a stack that applies no DP of one (transformers' fsdp_size=1)
        return Wrapped(model, model, contextlib.nullcontext)
    if entry is None:
        raise RuntimeError("dp='own' but parallelize_fn applied no DP: wrap the model in DDP, replicate, "
                           "fully_shard or FSDP on mesh['dp'], or let tpdp-verify wrap it (dp='ddp', ...)")
    if entry in ("fully_shard", "replicate_fsdp"):  # FSDP2's parameters stay DTensors, their layouts in sight
        return Wrapped(model, model, lambda: _fsdp2_no_sync(model), spmd=spmd_batch(model))
    if entry == "fsdp1":
        return _driven_fsdp1(model)
    wrapped = (Wrapped(model, model, lambda: _replicate_no_sync(model)) if entry == "replicate" else
               Wrapped(model, model.module, model.no_sync))
    return wrapped._replace(layouts=hidden_layouts(wrapped.inner, case, mesh))


def own_entry(model: nn.Module) -> str | None:
    """The DP entry point a user's function applied to ``model`` (tpdp-verify's name), or None."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, DDP):
        return "ddp_mesh" if getattr(model, "device_mesh", None) is not None else "transform_ddp"
    if isinstance(model, FSDP):
        return "fsdp1"
    if isinstance(model, FSDPModule):
        from torch.distributed._composable.replicate_with_fsdp import ReplicateModule

        return "replicate_fsdp" if isinstance(model, ReplicateModule) else "fully_shard"
    return "replicate" if replicate.state(model) is not None else None


def spmd_form(model: nn.Module) -> str:
    """How a user's own FSDP2 sees the mesh, as TrainCase.dp_mesh_dims names it: "" where no
    unit in ``model`` was given the whole mesh with dp_mesh_dims, else "shard", "replicate"
    or "both"."""
    groups = (g for state in torch_internals.fsdp2_states(model) for g in torch_internals.fsdp2_param_groups(state))
    dims = [d for d in map(torch_internals.spmd_dp_dims, groups) if d is not None]
    if not dims:
        return ""
    named = [k for k in ("shard", "replicate") if getattr(dims[0], k) is not None]
    return "both" if len(named) == 2 else named[0]


def spmd_batch(model: nn.Module) -> SpmdBatch | None:
    """Where a user's own FSDP2 took a whole SPMD mesh: that mesh (the first unit's; its
    parameters live there) and its dp dims, on which the batch is split as a trainer splits it
    (torchtitan's full_dtensor.parallelize_inputs: Shard(0) on each dp dim)."""
    groups = [g for state in torch_internals.fsdp2_states(model) for g in torch_internals.fsdp2_param_groups(state)
              if torch_internals.spmd_dp_dims(g) is not None]
    if not groups:
        return None
    dims = torch_internals.spmd_dp_dims(groups[0])
    return SpmdBatch(torch_internals.spmd_mesh(groups[0]), (*dims.replicate_names, *dims.shard_names))


def hidden_layouts(inner: nn.Module, case: TrainCase, mesh) -> dict:
    """The TP layout of each parameter that a DDP-style wrapper holds as a plain local shard,
    inferred from the unsharded model's shapes rather than read from the transform's own
    record: the one dim whose size differs is sharded over tp as torch.chunk splits it."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from tpdp_verify.ranks.loop import build

    whole = dict(build(case).named_parameters(remove_duplicate=False))
    layouts = {}
    for name, p in inner.named_parameters(remove_duplicate=False):
        g = whole.get(name)
        if isinstance(p, DTensor) or g is None or p.shape == g.shape:
            continue
        dims = [d for d, (a, b) in enumerate(zip(p.shape, g.shape)) if a != b]
        if p.dim() != g.dim() or len(dims) != 1:
            raise RuntimeError(f"cannot tell how {name} is sharded: this rank holds {list(p.shape)} of "
                               f"{list(g.shape)}; TP under dp='own' must shard one dim over mesh['tp']")
        layouts[name] = DTensorSpec(mesh["tp"], (Shard(dims[0]),), TensorMeta(g.shape, g.stride(), p.dtype))
    return layouts


# The keywords of torch's entry points (tpdp_verify.runner.coverage's names) that the
# wrappers above set, fixed or drawn; the gate lists the rest.
def _ddp_keywords() -> set[str]:
    from tpdp_verify.cases.training import DDPOptions

    # mixed_precision: CUDA-only, no case draws it (coverage.REASONS)
    every = DDPOptions(bucket_cap_mb=1.0, bucket_cap_mb_list=(1.0,), init_sync=False,
                       skip_all_reduce_unused_params=True, batched_grad_copy=True)
    return set(every.kwargs())


SETS = {
    "DistributedDataParallel": {"device_mesh", "process_group", *_ddp_keywords()},
    "replicate": {"device_mesh", "ignored_modules", *_ddp_keywords()},  # passed on to DDP through its **kwargs
    "replicate (FSDP2-based)": {"mesh", "mp_policy", "ignored_params", "dp_mesh_dims"},
    "fully_shard": {"mesh", "mp_policy", "ignored_params", "reshard_after_forward", "dp_mesh_dims",
                    "shard_placement_fn"},
    "FullyShardedDataParallel": {"device_mesh", "process_group", "use_orig_params", "device_id", "ignored_modules", "sharding_strategy",
                                 "auto_wrap_policy", "mixed_precision"},
}


def wrap_dtensor(model, case: TrainCase, mesh, impl) -> Wrapped:
    """No wrapper (cases.training.DTENSOR): the SPMD form's DTensor program alone, its
    gradients accumulating over microbatches as any module's do."""
    return Wrapped(model, model, contextlib.nullcontext)


WRAP = {
    "dtensor": wrap_dtensor,
    "ddp_mesh": wrap_ddp_mesh,
    "transform_ddp": wrap_transform_ddp,
    "replicate": wrap_replicate,
    "fully_shard": wrap_fully_shard,
    "fsdp1": wrap_fsdp1,
    "replicate_fsdp": wrap_replicate_fsdp,
    "own": wrap_own,
}


def precision(model: nn.Module) -> list[str]:
    """The mixed-precision policies of the DP wrappers in and around ``model``, as a report
    names them: DDP's and FSDP1's ``mixed_precision``, each FSDP2 module's
    MixedPrecisionPolicy (read from its state; a torch that keeps it under no name known
    leaves it out of the report's line, which is no check)."""
    policies = [getattr(m, "mixed_precision", None) for m in model.modules()]
    for state in torch_internals.fsdp2_states(model):
        with contextlib.suppress(torch_internals.Unobservable):
            policies += [p for g in torch_internals.fsdp2_param_groups(state) for p in torch_internals.fsdp2_policies(g)]
    found = [repr(p) for p in policies
             if any(getattr(p, k, None) is not None for k in ("param_dtype", "reduce_dtype"))]
    return list(dict.fromkeys(found))

