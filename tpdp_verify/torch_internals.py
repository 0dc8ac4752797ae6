"""What tpdp-verify reads of torch's private state, in one place.

The ranks watch torch where no public API shows what a check needs: FSDP2's units, their
mixed-precision policies and the sites where FSDP2 reduces gradients. Each read here knows
what each release calls the thing it reads. Where a release has none of the names known,
the read raises ``Unobservable``, whose text says what cannot be observed on this torch;
a check that needs it says so in its detail, never as an internal error of the harness.
Reads that only name or count what a run exercised return nothing instead.

Releases measured: 2.11 to 2.15 (docs/performance.md, "Other releases"). Adding one that
renames a thing means a line here, not a hunt through the ranks.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterator


class Unobservable(LookupError):
    """This torch keeps none of the names tpdp-verify knows for a thing a check reads."""

    def __init__(self, what: str, tried: str):
        import torch

        super().__init__(f"cannot observe {what} on torch {torch.__version__}: it has no {tried}")
        self.what = what


def _first(obj: Any, names: tuple[str, ...], what: str) -> Any:
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    raise Unobservable(what, f"{type(obj).__name__}.{' or .'.join(names)}")


# --------------------------------------------------------------------------- FSDP2's units


def fsdp2_states(model) -> Iterator[Any]:
    """The FSDP2 state of each unit in ``model`` (fully_shard's and the FSDP2-based replicate's)."""
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if callable(state):
            yield state()


def fsdp2_param_groups(state) -> tuple:
    """A unit's parameter groups (a list on the releases measured; one group where a torch keeps one)."""
    if hasattr(state, "_fsdp_param_groups"):
        return tuple(state._fsdp_param_groups)
    group = _first(state, ("_fsdp_param_group",), "FSDP2's parameter groups")
    return () if group is None else (group,)


def fsdp2_policies(group) -> list:
    """The MixedPrecisionPolicy of a parameter group: the group's own (to 2.14), each
    parameter's resolved policy (2.15 resolves one a parameter, FSDPParam.mp_policy)."""
    if hasattr(group, "mp_policy"):
        return [group.mp_policy]
    params = _first(group, ("fsdp_params",), "FSDP2's mixed-precision policy")
    return [_first(p, ("mp_policy",), "FSDP2's mixed-precision policy") for p in params]


def spmd_dp_dims(group):
    """The dp dims of a group given the whole SPMD mesh (``dp_mesh_dims``), else None."""
    info = getattr(group, "mesh_info", None)
    return info.dp_mesh_dims if getattr(info, "is_spmd_mesh", False) else None


def spmd_mesh(group):
    """The whole SPMD mesh a group's parameters live on, where it was given one, else None."""
    info = getattr(group, "mesh_info", None)
    return getattr(info, "spmd_mesh", None) if getattr(info, "is_spmd_mesh", False) else None


def param_name(fsdp_param) -> str:
    """A parameter's name from the root module, as FSDP2 keeps it ("" where it keeps none)."""
    return getattr(fsdp_param, "_param_fqn", "") or ""


def sharded_grad(fsdp_param):
    """The local tensor of a parameter's sharded gradient; None where it has none."""
    import torch
    from torch.distributed.tensor import DTensor

    grad = getattr(getattr(fsdp_param, "sharded_param", None), "grad", None)
    grad = grad._local_tensor if isinstance(grad, DTensor) else grad
    return grad if isinstance(grad, torch.Tensor) else None


def split_factor(placement) -> int:
    """How many blocks apart a shard placement lays each rank's rows: a ``_StridedShard``'s
    ``split_factor`` (a weight sharded per part over tp, or FSDP2's dp shard over a tp
    shard), 1 for a contiguous ``Shard`` or a placement that is no shard."""
    return int(getattr(placement, "split_factor", 1) or 1)


def shard_dim(fsdp_param) -> int | None:
    """The dim FSDP2 shards a parameter on over dp (None: not known on this torch)."""
    placement = getattr(fsdp_param, "fsdp_placement", None)
    return getattr(placement, "dim", None)


# --------------------------------------------------------------------------- FSDP2's sites

# (module, attribute): where FSDP2 does a step the ranks watch or the reference replaces,
# by release; the first that exists is the site
SITES = {
    # a parameter's unsharded gradient to the local tensor reduced over dp (TP's partial sums
    # are all-reduced there first)
    "grad step": (("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam._get_grad_inner_tensor"),),
    # DP's reduce-scatter (and HSDP's all-reduce), as the param group calls it
    "dp reduce": (("torch.distributed.fsdp._fully_shard._fsdp_param_group", "foreach_reduce"),),
    # the same function where it is defined, for its signature
    "dp reduce (defined)": (("torch.distributed.fsdp._fully_shard._fsdp_collectives", "foreach_reduce"),),
}


def site(name: str) -> tuple[Any, str]:
    """(owner, attribute) of FSDP2's step ``name`` on this torch (SITES), for a tap or a
    replacement to set and put back; Unobservable where this torch has none."""
    for module, attribute in SITES[name]:
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        *path, last = attribute.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, last):
            return owner, last
    raise Unobservable(f"FSDP2's {name}", " or ".join(f"{m}.{a}" for m, a in SITES[name]))


# --------------------------------------------------------------------------- what a call leaves


def group_collectives() -> tuple:
    """Each process group this rank belongs to, as (name, its ranks, the collectives this
    rank has issued on it): where every member of every group has issued as many, no
    collective waits half-matched in any group. Unobservable where a group keeps no count."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = _first(c10d, ("_world",), "the process groups of this rank")
    groups = []
    for pg, name in list(_first(world, ("pg_names",), "the process groups' names").items()):
        count = _first(pg, ("_get_sequence_number_for_group",), "a process group's count of collectives")
        groups.append((name, tuple(dist.get_process_group_ranks(pg)), int(count())))
    return tuple(sorted(groups))


def custom_op_handlers() -> dict:
    """DTensor's table of ops it hands to a custom handler in place of sharding propagation
    (loss_parallel installs its loss ops there); an empty dict where this torch keeps none."""
    from torch.distributed.tensor import DTensor

    return getattr(DTensor._op_dispatcher, "_custom_op_handlers", {})


def clear_sharding_caches() -> None:
    """Empty DTensor's caches of sharding propagation (its C++ fast path's and Python's), as a
    fresh process has them: their entries hold the mesh objects of the ops that filled them."""
    from torch.distributed.tensor import debug

    _first(debug, ("_clear_sharding_prop_cache",), "DTensor's sharding caches")()


def process_state() -> dict[str, Any]:
    """What one call can leave set in a process for the calls after it: torch's global modes
    and the tables DTensor and nn.Module consult on every op (a context manager that yields
    outside ``try``/``finally``, as ``loss_parallel`` on 2.13, leaves its table changed when
    its body raises)."""
    import torch
    import torch.nn.modules.module as module
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    return {
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "torch function modes": torch._C._len_torch_function_stack(),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "DTensor's custom op handlers": frozenset(map(str, custom_op_handlers())),
        "DTensor's implicit replication": getattr(dispatcher, "_allow_implicit_replication", None),
        "global module hooks": tuple(len(getattr(module, name)) for name in sorted(dir(module))
                                     if name.startswith("_global_") and name.endswith("hooks")),
    }


def changed(before: dict[str, Any], after: dict[str, Any]) -> str:
    """What differs between two ``process_state`` readings, in words ("" where nothing does)."""
    def difference(old, new) -> str:
        if isinstance(old, frozenset) and isinstance(new, frozenset):
            return " ".join([*(f"+{x}" for x in sorted(new - old)), *(f"-{x}" for x in sorted(old - new))])
        return f"{old!r} -> {new!r}"

    return "; ".join(f"{key}: {difference(before.get(key), value)}" for key, value in after.items()
                     if before.get(key) != value)
