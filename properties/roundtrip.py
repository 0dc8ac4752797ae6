"""Round trip: unflatten(flatten(t)) is t again.

DDP and FSDP1 see a TP model's DTensor parameters only through ``flatten`` (the local
shard they bucket and all-reduce) and give them back through ``unflatten``. If the pair
loses anything (placements, an uneven global shape, whether the parameter trains), the
model that DP trains is not the model the user built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tpdp_verify.cases.tensors import TensorCase
from tpdp_verify.judging.verdict import Verdict
from tpdp_verify.properties.returned import is_a, kind, shown, unpacked
from tpdp_verify.properties.strategies import tensor_cases
from tpdp_verify.ranks.observation import Check, observing
from tpdp_verify.runner.property import tpdp_property


def distributed_param(case: TensorCase, mesh) -> tuple[torch.Tensor, nn.Parameter, torch.Tensor]:
    """(the full tensor, t: it as a DTensor parameter laid out as the case says, t's shard)."""
    from torch.distributed.tensor import distribute_tensor

    full = case.full()
    param = nn.Parameter(distribute_tensor(full, mesh, case.placements), requires_grad=case.requires_grad)
    with torch.no_grad():
        shard = param.to_local()
    return full, param, shard


def layout_checks(case: TensorCase, mesh, param, back, prefix: str = "") -> list[Check]:
    """The rebuilt DTensor ``back`` has t's layout; ``prefix`` names the function checked."""
    return [
        Check(f"{prefix}mesh", back.device_mesh == mesh, f"{back.device_mesh} != {mesh}"),
        Check(f"{prefix}placements", tuple(back.placements) == case.placements,
              f"{tuple(back.placements)} != {case.placements}"),
        Check(f"{prefix}global shape", tuple(back.shape) == case.shape, f"{tuple(back.shape)} != {case.shape}"),
        Check(f"{prefix}stride", back.stride() == param.stride(), f"{back.stride()} != {param.stride()}"),
        Check(f"{prefix}dtype", back.dtype == case.dtype, f"{back.dtype} != {case.dtype}"),
    ]


def gathered_checks(case: TensorCase, full, back, local, layout: list[Check], prefix: str = "") -> list[Check]:
    """``back`` gathers to t, and a gradient of it reaches ``local``. Gathering a DTensor
    whose layout is wrong can abort gloo: only when every rank agrees the layout is right
    (otherwise the failed layout checks are the verdict)."""
    if not all_ranks(bool(layout) and all(c.ok for c in layout)):
        return []
    return [Check(f"{prefix}full tensor", torch.equal(back.full_tensor().detach(), full),
                  "gathered tensor differs from t"), *_gradient_checks(case, back, local)]


@dataclass(frozen=True)
class RoundTrip:
    """How a family of flatten/unflatten functions names the checks of its round trip
    (the names are the checks' identifiers in baselines)."""

    flatten: str = "flatten"
    unflatten: str = "unflatten"
    info: str = "sharding info"
    local: str = "local"
    rebuilt: str = ""  # before the names of the rebuilt DTensor's checks
    copy_means: str = "DP would update a copy, not the model"


def round_trip_checks(case: TensorCase, mesh, flatten, unflatten, names: RoundTrip = RoundTrip(),
                      more=lambda shard, local, back: []) -> list[Check]:
    """On every rank: a DTensor parameter through ``flatten`` and back through ``unflatten``;
    ``more`` adds a family's own checks. Whatever the pair returns fails checks that say
    what it was, never the checks' own code (tpdp_verify.properties.returned)."""
    from torch.distributed.tensor import DTensor

    full, param, shard = distributed_param(case, mesh)
    shard_requires_grad = shard.requires_grad

    returned = flatten(param)
    pair = unpacked(returned, 2)
    local, info = pair or (None, None)
    malformed = _local_checks(local, shard, names) if pair is not None else [
        Check(f"{names.flatten} returns a (local, {names.info}) pair", False, f"got {kind(returned)}")]
    usable = pair is not None and _plain(local)
    # DP unflattens only a plain tensor that came with its info (torch's _reconstruct_dtensor
    # only parameters with _st_info); on every rank or none: unflatten may communicate
    unflattened = all_ranks(usable and info is not None)
    back = unflatten(local, info) if unflattened else None
    checks = [] if pair is None else [
        Check(f"{names.flatten} returns {names.info}", info is not None, f"got {shown(info)}")]
    checks += [
        Check(f"{names.flatten} leaves t requiring grad as before", param.requires_grad == case.requires_grad,
              f"t.requires_grad became {param.requires_grad}"),
        Check(f"{names.flatten} leaves t's shard requiring grad as before", shard.requires_grad == shard_requires_grad,
              f"t's shard requires_grad went {shard_requires_grad} -> {shard.requires_grad}"),
        *malformed,
    ]
    if usable:
        checks += [
            Check(f"{names.local} shares storage with t's shard",
                  local.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr(),
                  f"{names.flatten} copied the shard: {names.copy_means}"),
            Check(f"{names.local} requires_grad", local.requires_grad == case.requires_grad,
                  f"local.requires_grad={local.requires_grad}, t.requires_grad={case.requires_grad}"),
        ]
    if unflattened:
        checks.append(Check(f"{names.unflatten} returns a DTensor", is_a(back, DTensor), f"got {kind(back)}"))
    layout = []
    if is_a(back, DTensor):
        # a local tensor of another shape than the layout gives can abort gloo when gathered
        layout = layout_checks(case, mesh, param, back, names.rebuilt) + _local_shape_checks(back, shard, names.rebuilt)
        checks += layout + [
            Check(f"{names.rebuilt}requires_grad", back.requires_grad == case.requires_grad,
                  f"{names.unflatten}({names.flatten}(t)).requires_grad={back.requires_grad}, "
                  f"t.requires_grad={case.requires_grad}"),
            Check(f"{names.rebuilt}local data", torch.equal(back.to_local(), shard), "the shard's values changed"),
        ]
    if usable:
        checks += more(shard, local, back)
    checks += gathered_checks(case, full, back, local, layout, names.rebuilt)
    plain = full.clone()
    checks.append(_identity_check(flatten(plain), plain, names))
    return checks


def _plain(value) -> bool:
    """A plain tensor, as DP buckets and all-reduces it."""
    from torch.distributed.tensor import DTensor

    return is_a(value, torch.Tensor) and not is_a(value, DTensor)


def _local_checks(local, shard: torch.Tensor, names: RoundTrip) -> list[Check]:
    """What is wrong with the local tensor of a (local, info) pair: the failed checks only,
    so that a well-formed one adds none."""
    if not _plain(local):
        return [Check(f"{names.local} is a plain tensor", False, f"got {kind(local)}")]
    return [c for c in (
        Check(f"{names.local} has the shape of t's shard", local.shape == shard.shape,
              f"{tuple(local.shape)} != {tuple(shard.shape)}"),
        Check(f"{names.local} has t's dtype", local.dtype == shard.dtype, f"{local.dtype} != {shard.dtype}"),
    ) if not c.ok]


def _local_shape_checks(back, shard: torch.Tensor, prefix: str) -> list[Check]:
    """The rebuilt DTensor's local tensor has the shape its layout gives this rank (t's
    shard's): only a failed check, so that a well-formed one adds none."""
    got = tuple(back.to_local().shape)
    if got == tuple(shard.shape):
        return []
    return [Check(f"{prefix}local shape", False, f"{got} != {tuple(shard.shape)}, what the layout gives this rank")]


def _identity_check(returned, plain: torch.Tensor, names: RoundTrip) -> Check:
    """``flatten`` returned (``plain``, None) for a plain tensor: DP leaves it as it is."""
    name = f"{names.flatten} of a plain tensor is the identity"
    pair = unpacked(returned, 2)
    if pair is None:
        return Check(name, False, f"got {kind(returned)}, not the pair (t, None)")
    out, info = pair
    return Check(name, out is plain and info is None, f"got {type(out).__name__} and {shown(info)}")


@observing
def observe_roundtrip(case: TensorCase, impl_name: str) -> list[Check]:
    """On every rank: round-trip a DTensor parameter through the implementation."""
    from tpdp_verify.impls.select import load
    from tpdp_verify.ranks.rank import device_mesh

    impl = load(impl_name)
    return round_trip_checks(case, device_mesh(case.mesh_shape), impl.flatten_tensor, impl.unflatten_tensor)


def all_ranks(flag: bool) -> bool:
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _gradient_checks(case: TensorCase, back, local) -> list[Check]:
    """A gradient of the rebuilt DTensor must land, unchanged, on the local shard."""
    from torch.distributed.tensor import distribute_tensor

    # every rank or none: distributing the weight communicates
    if not all_ranks(back.requires_grad and local.requires_grad):
        return []
    gen = torch.Generator().manual_seed(case.seed + 1)
    weight = torch.randn(case.shape, generator=gen, dtype=torch.float64).to(case.dtype)
    weight = distribute_tensor(weight, back.device_mesh, case.placements)
    (back * weight).to_local().sum().backward()
    expected = weight.to_local()
    return [Check("gradient reaches the local shard",
                  local.grad is not None and torch.equal(local.grad, expected),
                  "no gradient" if local.grad is None else "gradient differs from d(sum(t*w))/dt = w")]


@tpdp_property(case=lambda world_size: tensor_cases(world_size, max_mesh_dims=2))
def flatten_roundtrip(pool, impl: str, case: TensorCase) -> None:
    """unflatten(flatten(t)) equals t: mesh, placements, shape, stride, dtype, requires_grad, data, gradient flow."""
    Verdict.of_ranks(pool.run(observe_roundtrip, case, impl)).raise_if_failed()
