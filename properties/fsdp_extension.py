"""FSDP1's tensor-parallel extension (``DTensorExtensions``): what FSDP1 + TP relies on.

FSDP1 flattens a TP model's DTensor parameters through ``pre_flatten_transform`` and
rebuilds them through ``post_unflatten_transform``; its sharded state dicts hold what
``chunk_tensor`` (ShardedTensor) or ``chunk_dtensor`` (DTensor) make of a parameter, and
loading gathers them back through ``pre_load_state_dict_transform`` and
``all_gather_dtensor``. The contract is in tpdp_verify/impls/fsdp_extension.py.

Every rank returns named checks; none gathers a DTensor whose layout some rank found
wrong (a collective over a wrong layout can abort gloo): those layout checks are the
verdict then.
"""

from __future__ import annotations

import contextlib

import torch

from tpdp_verify import signature
from tpdp_verify.cases.tensors import FSDPCase, TensorCase
from tpdp_verify.judging.verdict import Verdict
from tpdp_verify.properties.returned import is_a, items, kind, unpacked
from tpdp_verify.properties.roundtrip import (
    RoundTrip,
    all_ranks,
    round_trip_checks,
)
from tpdp_verify.properties.strategies import fsdp_cases, tensor_cases
from tpdp_verify.ranks.observation import Check, observing
from tpdp_verify.ranks.rank import device_type
from tpdp_verify.runner.property import tpdp_property


def _raised(name: str, call) -> tuple[object, list[Check]]:
    """``call()``'s result and no check, or None and a failed check naming the exception.
    Only for calls that do not communicate: a rank that raised must not leave the others
    waiting in a collective."""
    try:
        return call(), []
    except Exception as exc:  # noqa: BLE001 - the exception is the verdict
        where = signature.innermost(exc)
        return None, [Check(f"{name} runs", False, f"{type(exc).__name__}: {exc}{where}", signature.raised(exc),
                            where=where)]


# -- pre_flatten_transform / post_unflatten_transform ------------------------------------


# FSDP1's names for the round trip's checks.
FSDP_ROUND_TRIP = RoundTrip(flatten="pre_flatten", unflatten="post_unflatten", info="extension info",
                            local="pre_flatten local", rebuilt="post_unflatten ",
                            copy_means="FSDP would flatten a copy, not the model")


def _fsdp_checks(shard: torch.Tensor, local: torch.Tensor, back) -> list[Check]:
    """What FSDP1 needs beyond the transform's round trip: the local tensor is the shard
    itself, and the rebuilt DTensor is marked flattened (nested FSDP skips it)."""
    from torch.distributed.fsdp._common_utils import _is_fsdp_flattened
    from torch.distributed.tensor import DTensor

    checks = [Check("pre_flatten local is t's shard", local.shape == shard.shape and torch.equal(local, shard),
                    f"local {tuple(local.shape)} differs from t's shard {tuple(shard.shape)}")]
    if is_a(back, DTensor):
        checks.append(Check("post_unflatten marks the result FSDP-flattened", _is_fsdp_flattened(back),
                            "nested FSDP would flatten the rebuilt DTensor again"))
    return checks


@observing
def observe_flatten(case: TensorCase, impl_name: str) -> list[Check]:
    """On every rank: a DTensor parameter through pre_flatten and post_unflatten."""
    from tpdp_verify.impls.select import load_fsdp
    from tpdp_verify.ranks.rank import device_mesh

    ext = load_fsdp(impl_name, device_type())
    return round_trip_checks(case, device_mesh(case.mesh_shape), ext.pre_flatten_transform,
                             ext.post_unflatten_transform, FSDP_ROUND_TRIP, _fsdp_checks)


@tpdp_property(case=lambda world_size: tensor_cases(world_size, max_mesh_dims=2))
def fsdp_flatten_roundtrip(pool, impl: str, case: TensorCase) -> None:
    """post_unflatten(pre_flatten(t)) is t: shard shared, layout, dtype, requires_grad, data, FSDP mark, gradient flow."""
    Verdict.of_ranks(pool.run(observe_flatten, case, impl)).raise_if_failed()


# -- chunk_dtensor / all_gather_dtensor --------------------------------------------------


def _meshes(case: FSDPCase):
    """The root mesh, its FSDP sub-mesh (all dims but tp) and its tp sub-mesh."""
    from tpdp_verify.ranks.rank import device_mesh

    root = device_mesh(case.mesh_shape, case.mesh_names)
    return root, root[case.mesh_names[:-1]], root["tp"]


def expected_placements(case: FSDPCase) -> tuple:
    """FSDP's Shard(0) on the shard dim, Replicate() on HSDP's replicate dim, and the
    tensor's own tp placement (Replicate() for a plain tensor) on the tp dim."""
    from torch.distributed.tensor import Replicate, Shard

    fsdp = (Replicate(),) * (len(case.mesh_shape) - 2) + (Shard(0),)
    return fsdp + (case.tp_placement or Replicate(),)


def _parameter(case: FSDPCase, tp_mesh):
    """The state dict's value for the parameter: detached, a DTensor on tp or plain."""
    from torch.distributed.tensor import distribute_tensor

    full = case.full()
    return full if case.tp_placement is None else distribute_tensor(full, tp_mesh, [case.tp_placement])


def _block_checks(what: str, local: torch.Tensor, full: torch.Tensor, mesh, placements) -> list[Check]:
    """``local`` is the block of ``full`` that DTensor's own layout puts on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    ok_shape = tuple(local.shape) == tuple(shape)
    expected = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
    return [
        Check(f"{what} local shape", ok_shape, f"{tuple(local.shape)} != DTensor's {tuple(shape)}"),
        Check(f"{what} local values", ok_shape and torch.equal(local, expected),
              f"the local block is not full[offset {tuple(offset)}, shape {tuple(shape)}]"),
    ]


def _dtype_checks(what: str, local: torch.Tensor, full: torch.Tensor) -> list[Check]:
    """``local`` has ``full``'s dtype, which torch.equal does not compare: only a failed
    check, so that a well-formed tensor adds none."""
    if local.dtype == full.dtype:
        return []
    return [Check(f"{what} dtype", False, f"{local.dtype} != {full.dtype}")]


class _Preflight(Exception):
    """Raised at an implementation's first redistribute, carrying the DTensor's shape."""


@contextlib.contextmanager
def _stopped_at_redistribute():
    from torch.distributed.tensor import DTensor

    def stop(self, *_args, **_kwargs):
        raise _Preflight(tuple(self.shape))

    saved, DTensor.redistribute = DTensor.redistribute, stop
    try:
        yield
    finally:
        DTensor.redistribute = saved


def _preflight(name: str, call) -> Check:
    """Run ``call`` up to its first redistribute and check every rank built the same global
    shape to redistribute: ranks that disagree exchange mismatched sizes, which aborts gloo
    (SIGABRT) and leaves no verdict to shrink."""
    import torch.distributed as dist

    try:
        with _stopped_at_redistribute():
            call()
        shape = "no redistribute"
    except _Preflight as stopped:
        shape = stopped.args[0]
    except Exception as exc:  # noqa: BLE001 - the real call raises it again, as the verdict
        shape = f"raised {type(exc).__name__}"
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, shape)
    return Check(f"{name} agrees on the global shape on every rank before communicating",
                 len(set(shapes)) == 1, f"global shapes by rank: {shapes}")


@observing
def observe_chunk_dtensor(case: FSDPCase, impl_name: str) -> list[Check]:
    """On every rank: the DTensor a DTensor state dict holds for the parameter."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tpdp_verify.impls.select import load_fsdp

    ext = load_fsdp(impl_name, device_type())
    root, fsdp_mesh, tp_mesh = _meshes(case)
    full, param = case.full(), _parameter(case, tp_mesh)
    source = param.to_local() if isinstance(param, DTensor) else param
    agree = _preflight("chunk_dtensor", lambda: ext.chunk_dtensor(param, dist.get_rank(), fsdp_mesh))
    if not agree.ok:
        return [agree]
    out = ext.chunk_dtensor(param, dist.get_rank(), fsdp_mesh)
    checks = [agree, Check("chunk_dtensor returns a DTensor", is_a(out, DTensor), f"got {kind(out)}")]
    layout, blocks = [], []
    if is_a(out, DTensor):
        want = expected_placements(case)
        layout = [
            Check("chunk_dtensor mesh is the root mesh", out.device_mesh == root, f"{out.device_mesh} != {root}"),
            Check("chunk_dtensor placements", tuple(out.placements) == want, f"{tuple(out.placements)} != {want}"),
            Check("chunk_dtensor global shape", tuple(out.shape) == case.shape, f"{tuple(out.shape)} != {case.shape}"),
            Check("chunk_dtensor dtype", out.dtype == case.dtype, f"{out.dtype} != {case.dtype}"),
        ]
        local = out.to_local()
        blocks = _block_checks("chunk_dtensor", local, full, root, want)
        checks += layout + [
            Check("chunk_dtensor detaches", not out.requires_grad and local.grad_fn is None,
                  "the state dict's value is attached to the parameter's graph"),
            Check("chunk_dtensor copies", local.numel() == 0 or
                  local.untyped_storage().data_ptr() != source.untyped_storage().data_ptr(),
                  "the state dict's value shares storage with the parameter"),
            *blocks,
        ]
    # gathered only when every rank holds the block its layout gives it (blocks[0], the
    # local shape): blocks of other shapes can abort gloo
    if all_ranks(bool(layout) and all(c.ok for c in layout + blocks[:1])):
        checks.append(Check("chunk_dtensor full tensor", torch.equal(out.full_tensor(), full),
                            "gathered tensor differs from the parameter"))
    return checks


@tpdp_property(case=fsdp_cases)
def chunk_dtensor_layout(pool, impl: str, case: FSDPCase) -> None:
    """chunk_dtensor(t) on the root mesh: FSDP's placements plus t's tp placement, t's shape, DTensor's own blocks, t's full tensor."""
    Verdict.of_ranks(pool.run(observe_chunk_dtensor, case, impl)).raise_if_failed()


@observing
def observe_all_gather(case: FSDPCase, impl_name: str) -> list[Check]:
    """On every rank: gather FSDP's dims of a state dict's DTensor back to the tp shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from tpdp_verify.impls.select import load_fsdp

    ext = load_fsdp(impl_name, device_type())
    root, _, tp_mesh = _meshes(case)
    full = case.full()
    # built independently of chunk_dtensor, so this property judges all_gather alone
    stored = distribute_tensor(full, root, expected_placements(case))
    out = ext.all_gather_dtensor(stored, root)
    tp = case.tp_placement
    checks = [Check("all_gather_dtensor returns a plain tensor",
                    is_a(out, torch.Tensor) and not is_a(out, DTensor), f"got {kind(out)}")]
    if checks[0].ok:  # else nothing to compare; the ranks still agree below, as every rank must
        checks += _dtype_checks("all_gather_dtensor", out, full)
        checks += _block_checks("all_gather_dtensor", out, full, tp_mesh, [tp] if tp else [])
    if all_ranks(all(c.ok for c in checks)):
        gathered = full if tp is None else DTensor.from_local(
            out, tp_mesh, [tp], run_check=False, shape=full.shape, stride=full.stride()).full_tensor()
        checks.append(Check("all_gather_dtensor gives the full tensor", torch.equal(gathered, full),
                            "the tp shards gathered differ from the parameter"))
    return checks


@tpdp_property(case=fsdp_cases)
def all_gather_dtensor_full(pool, impl: str, case: FSDPCase) -> None:
    """all_gather_dtensor of a state dict's DTensor is the tp shard: with the others, the full tensor."""
    Verdict.of_ranks(pool.run(observe_all_gather, case, impl)).raise_if_failed()


# -- chunk_tensor: ShardedTensor metadata ---------------------------------------------------


def _box(md) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(md.shard_offsets), tuple(md.shard_sizes)


def _tiling_check(what: str, mds, shape) -> Check:
    """The metadata's blocks cover every element of ``shape`` exactly once, in bounds."""
    count = torch.zeros(shape, dtype=torch.int32)
    for md in mds:
        offsets, sizes = _box(md)
        if len(offsets) != len(shape) or any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            return Check(f"{what} shards tile the tensor exactly once", False,
                         f"block {offsets}+{sizes} leaves the tensor {tuple(shape)}")
        count[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    return Check(f"{what} shards tile the tensor exactly once", bool((count == 1).all()),
                 f"{int((count == 0).sum())} elements uncovered, {int((count > 1).sum())} covered twice or more "
                 f"by {[_box(md) for md in mds]}")


def _local_shard_checks(what: str, st, source: torch.Tensor, pg) -> list[Check]:
    """``st`` (a chunk of ``source`` along dim 0 over FSDP's group ``pg``) tiles ``source``
    on ``pg``'s ranks, and its local shards hold ``source``'s values at their offsets."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    mds = st.metadata().shards_metadata
    placed = sorted({md.placement.rank() for md in mds})
    mine = [_box(md) for md in mds if md.placement.rank() == dist.get_rank()]
    checks = [Check(f"{what} global size", tuple(st.size()) == tuple(source.shape),
                    f"{tuple(st.size())} != {tuple(source.shape)}"),
              Check(f"{what} shards are placed on FSDP's ranks",
                    set(placed) <= set(dist.get_process_group_ranks(pg))
                    and sorted(mine) == sorted(_box(s.metadata) for s in st.local_shards()),
                    f"placed on ranks {placed}, FSDP's are {dist.get_process_group_ranks(pg)}"),
              _tiling_check(what, mds, source.shape)]
    if checks[-1].ok:
        for shard in st.local_shards():
            offsets, sizes = _box(shard.metadata)
            want = source[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            plain = not is_a(shard.tensor, ShardedTensor)  # nested once more: no values to compare
            checks.append(Check(f"{what} local shard values", plain and torch.equal(shard.tensor, want),
                                f"the shard at {offsets} is not the tensor's block there" if plain else
                                f"the shard at {offsets} is a ShardedTensor, not the tensor's block there"))
    return checks


@observing
def observe_chunk_tensor(case: FSDPCase, impl_name: str) -> list[Check]:
    """On every rank: the ShardedTensor a sharded state dict holds for the parameter,
    with FSDP1 sharding over the dp dim and the parameter a DTensor on the tp dim."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from tpdp_verify.impls.select import load_fsdp

    ext = load_fsdp(impl_name, device_type())
    root, _, tp_mesh = _meshes(case)
    dp = root.get_group(case.mesh_names[-2])  # FSDP's own group: HSDP hands it the shard dim's
    full, param = case.full(), _parameter(case, tp_mesh)
    param = param.detach()  # state_dict() values are detached
    st, checks = _raised("chunk_tensor", lambda: ext.chunk_tensor(param, dp.rank(), dp.size(), 1, dp))
    if checks:  # it raised
        return checks
    checks.append(Check("chunk_tensor returns a ShardedTensor", is_a(st, ShardedTensor), f"got {kind(st)}"))
    if not checks[-1].ok:
        return checks
    if not isinstance(param, DTensor):  # a plain parameter: FSDP's own chunks over dp
        return checks + _local_shard_checks("chunk_tensor", st, full, dp)

    shape, offset = compute_local_shape_and_global_offset(full.shape, tp_mesh, [case.tp_placement])
    locals_ = st.local_shards()
    checks += [
        Check("chunk_tensor global size", tuple(st.size()) == case.shape, f"{tuple(st.size())} != {case.shape}"),
        Check("chunk_tensor dtype", st.metadata().tensor_properties.dtype == case.dtype,
              f"{st.metadata().tensor_properties.dtype} != {case.dtype}"),
        Check("chunk_tensor holds one local shard", len(locals_) == 1, f"{len(locals_)} local shards"),
        _tiling_check("chunk_tensor", st.metadata().shards_metadata, full.shape),
    ]
    if len(locals_) != 1:
        return checks
    md, inner = locals_[0].metadata, locals_[0].tensor
    # an empty block's offset is arbitrary: only its size says anything
    same_offset = _box(md)[0] == tuple(offset) or 0 in shape
    checks += [
        Check("chunk_tensor local shard is DTensor's local shape and offset",
              _box(md)[1] == tuple(shape) and same_offset,
              f"metadata {_box(md)} != DTensor's (offset {tuple(offset)}, shape {tuple(shape)})"),
        Check("chunk_tensor local shard is placed on this rank", md.placement.rank() == dist.get_rank(),
              f"placed on rank {md.placement.rank()}"),
        Check("chunk_tensor local shard is listed in the metadata",
              any(_box(m) == _box(md) and m.placement == md.placement for m in st.metadata().shards_metadata),
              f"{_box(md)} on {md.placement} is not in the global metadata"),
        Check("chunk_tensor local shard chunks over FSDP's group", is_a(inner, ShardedTensor),
              f"got {kind(inner)}"),
    ]
    if is_a(inner, ShardedTensor):
        checks += _local_shard_checks("chunk_tensor inner", inner, param.to_local(), dp)
        checks.append(_loaded_check(ext.pre_load_state_dict_transform(st), inner))
    return checks


def _loaded_check(returned, inner) -> Check:
    """pre_load_state_dict_transform returned (``inner``, its local shards)."""
    from torch.distributed._shard.sharded_tensor import Shard as STShard

    name = "pre_load_state_dict_transform returns the inner shards"
    pair = unpacked(returned, 2)
    if pair is None:
        return Check("pre_load_state_dict_transform returns a (tensor, shards) pair", False, f"got {kind(returned)}")
    loaded, shards = pair
    listed, mine = items(shards), inner.local_shards()
    if listed is None:
        return Check(name, False, f"got {type(loaded).__name__} and {kind(shards)}, not a list of shards")
    return Check(name, loaded is inner and len(listed) == len(mine)
                 and all(is_a(a, STShard) and a.tensor is b.tensor for a, b in zip(listed, mine)),
                 f"got {type(loaded).__name__} and {len(listed)} shards")


@tpdp_property(case=fsdp_cases)
def chunk_tensor_metadata(pool, impl: str, case: FSDPCase) -> None:
    """chunk_tensor(t)'s ShardedTensor: its local shard is DTensor's local shape and offset, its shards tile t once, its inner chunks hold t's shard."""
    Verdict.of_ranks(pool.run(observe_chunk_tensor, case, impl)).raise_if_failed()
