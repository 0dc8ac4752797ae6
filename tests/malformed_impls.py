"""Implementations that return what their contract does not allow: the checks must be total.

Unlike tests/mutants.py (a plausible bug in one clause each), each class here returns
something malformed from one function (None, a bare tensor for a pair, a tuple of the
wrong length, a tensor of the wrong shape or dtype, a plain tensor for a DTensor, an
object that raises when touched) and keeps the rest of the reference. ``prop`` names the
structural property that calls that function directly and ``caught_by`` the failed check
it must report (tests/test_totality.py); every other structural property of its family
must not fail by an error of the harness's own.
"""

import torch
from torch.distributed.tensor import DTensor

from tpdp_verify.impls.fsdp_extension import FSDPExtension
from tpdp_verify.impls.transform import ShardingInfo

from mutants import Reference


class Untouchable:
    """A value that raises whatever is asked of it: attributes (``__class__`` too, which
    isinstance reads), its length, iteration, repr, truth."""

    def __getattribute__(self, name):
        raise RuntimeError(f"malformed: touched .{name}")

    def __len__(self):
        raise RuntimeError("malformed: len()")

    def __iter__(self):
        raise RuntimeError("malformed: iter()")

    def __repr__(self):
        raise RuntimeError("malformed: repr()")

    def __bool__(self):
        raise RuntimeError("malformed: bool()")


def _full(t: DTensor) -> torch.Tensor:
    """The whole tensor where the local shard belongs (every rank gathers: no hang)."""
    return t.full_tensor().detach().requires_grad_(t.requires_grad)


# -- the TP->DP transform (flatten_roundtrip; the module transform calls these too) --------


class FlattenReturnsTheFullTensor(Reference):
    """The issue's example: the whole tensor, not the local shard, with the right info."""

    prop, caught_by = "flatten_roundtrip", "local has the shape of t's shard"

    def flatten_tensor(self, t):
        local, info = super().flatten_tensor(t)
        return (local, info) if info is None else (_full(t), info)


class FlattenReturnsNone(Reference):
    prop, caught_by = "flatten_roundtrip", "flatten returns a (local, sharding info) pair"

    def flatten_tensor(self, t):
        return None


class FlattenReturnsABareTensor(Reference):
    """The local shard without its info: a shard of two rows even unpacks into two."""

    prop, caught_by = "flatten_roundtrip", "flatten returns a (local, sharding info) pair"

    def flatten_tensor(self, t):
        return super().flatten_tensor(t)[0]


class FlattenReturnsThree(Reference):
    prop, caught_by = "flatten_roundtrip", "flatten returns a (local, sharding info) pair"

    def flatten_tensor(self, t):
        return (*super().flatten_tensor(t), None)


class FlattenCastsTheLocal(Reference):
    """The local shard in float64: a copy of another dtype."""

    prop, caught_by = "flatten_roundtrip", "local has t's dtype"

    def flatten_tensor(self, t):
        local, info = super().flatten_tensor(t)
        return (local, info) if info is None else (local.detach().double().requires_grad_(t.requires_grad), info)


class FlattenReturnsUntouchable(Reference):
    prop, caught_by = "flatten_roundtrip", "flatten returns a (local, sharding info) pair"

    def flatten_tensor(self, t):
        return Untouchable() if isinstance(t, DTensor) else super().flatten_tensor(t)


class FlattenReturnsAnUntouchableLocal(Reference):
    prop, caught_by = "flatten_roundtrip", "local is a plain tensor"

    def flatten_tensor(self, t):
        local, info = super().flatten_tensor(t)
        return (local, info) if info is None else (Untouchable(), info)


class UnflattenReturnsAPlainTensor(Reference):
    prop, caught_by = "flatten_roundtrip", "unflatten returns a DTensor"

    def unflatten_tensor(self, local, info):
        return local


class UnflattenReturnsUntouchable(Reference):
    prop, caught_by = "flatten_roundtrip", "unflatten returns a DTensor"

    def unflatten_tensor(self, local, info):
        return Untouchable()


class UnflattenKeepsTheFullTensor(Reference):
    """The right global metadata around a local tensor of the wrong shape: gathering it
    could abort gloo, so the rebuilt local shape must stop the checks first."""

    prop, caught_by = "flatten_roundtrip", "local shape"

    def unflatten_tensor(self, local, info):
        whole = DTensor.from_local(local, info.mesh, info.placements, run_check=False, shape=info.shape,
                                   stride=info.stride).full_tensor()
        return DTensor.from_local(whole, info.mesh, info.placements, run_check=False, shape=info.shape,
                                  stride=info.stride)


class ResolvesToNone(Reference):
    prop, caught_by = "paths_resolve", "get_submodule_n_params returns a (module, attribute) pair"

    def get_submodule_n_params(self, module, path):
        return None


class ResolvesToUntouchable(Reference):
    prop, caught_by = "paths_resolve", "get_submodule_n_params returns a (module, attribute) pair"

    def get_submodule_n_params(self, module, path):
        return Untouchable()


class ResolvesBackwards(Reference):
    """(attribute, owner): a pair, of the wrong things."""

    prop, caught_by = "paths_resolve", "get_submodule_n_params returns a (module, attribute) pair"

    def get_submodule_n_params(self, module, path):
        return tuple(reversed(super().get_submodule_n_params(module, path)))


class InfoWithoutShape(Reference):
    """Localized shards carry their info as a bare tuple, which its own unflatten reads:
    the registry can no longer say a shard's global shape."""

    prop, caught_by = "registry_preserved", "global shapes"

    def local_parameter(self, param):
        local = super().local_parameter(param)
        if local is not None and isinstance(getattr(local, "_st_info", None), ShardingInfo):
            local._st_info = tuple(local._st_info)
        return local

    def unflatten_tensor(self, local, info):
        return super().unflatten_tensor(local, ShardingInfo(*info))


class LocalizesToUntouchable(Reference):
    """localize_dtensor puts an object that raises when touched in each DTensor's slot."""

    prop, caught_by = "ignored_params_untouched", "other DTensor parameters are localized"

    def local_parameter(self, param):
        return None if super().local_parameter(param) is None else Untouchable()


TRANSFORM = [FlattenReturnsTheFullTensor, FlattenReturnsNone, FlattenReturnsABareTensor, FlattenReturnsThree,
             FlattenCastsTheLocal, FlattenReturnsUntouchable, FlattenReturnsAnUntouchableLocal,
             UnflattenReturnsAPlainTensor, UnflattenReturnsUntouchable, UnflattenKeepsTheFullTensor,
             ResolvesToNone, ResolvesToUntouchable, ResolvesBackwards, InfoWithoutShape, LocalizesToUntouchable]


# -- FSDP1's extension ---------------------------------------------------------------------


class PreFlattenReturnsTheFullTensor(FSDPExtension):
    prop, caught_by = "fsdp_flatten_roundtrip", "pre_flatten local has the shape of t's shard"

    def pre_flatten_transform(self, t):
        local, info = super().pre_flatten_transform(t)
        return (local, info) if info is None else (_full(t), info)


class PreFlattenReturnsNone(FSDPExtension):
    prop, caught_by = "fsdp_flatten_roundtrip", "pre_flatten returns a (local, extension info) pair"

    def pre_flatten_transform(self, t):
        return None


class PreFlattenReturnsABareTensor(FSDPExtension):
    prop, caught_by = "fsdp_flatten_roundtrip", "pre_flatten returns a (local, extension info) pair"

    def pre_flatten_transform(self, t):
        return super().pre_flatten_transform(t)[0]


class PreFlattenCastsTheLocal(FSDPExtension):
    prop, caught_by = "fsdp_flatten_roundtrip", "pre_flatten local has t's dtype"

    def pre_flatten_transform(self, t):
        local, info = super().pre_flatten_transform(t)
        return (local, info) if info is None else (local.detach().double().requires_grad_(t.requires_grad), info)


class PreFlattenReturnsUntouchable(FSDPExtension):
    prop, caught_by = "fsdp_flatten_roundtrip", "pre_flatten returns a (local, extension info) pair"

    def pre_flatten_transform(self, t):
        return Untouchable() if isinstance(t, DTensor) else super().pre_flatten_transform(t)


class PostUnflattenReturnsAPlainTensor(FSDPExtension):
    prop, caught_by = "fsdp_flatten_roundtrip", "post_unflatten returns a DTensor"

    def post_unflatten_transform(self, local, info):
        return local


class PostUnflattenReturnsUntouchable(FSDPExtension):
    prop, caught_by = "fsdp_flatten_roundtrip", "post_unflatten returns a DTensor"

    def post_unflatten_transform(self, local, info):
        return Untouchable()


class ChunkDTensorReturnsNone(FSDPExtension):
    prop, caught_by = "chunk_dtensor_layout", "chunk_dtensor returns a DTensor"

    def chunk_dtensor(self, tensor, rank, device_mesh):
        return None


class ChunkDTensorReturnsThePlainTensor(FSDPExtension):
    prop, caught_by = "chunk_dtensor_layout", "chunk_dtensor returns a DTensor"

    def chunk_dtensor(self, tensor, rank, device_mesh):
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


class ChunkDTensorHoldsTheFullTensor(FSDPExtension):
    """Every rank's local tensor is the whole tensor, under the right layout."""

    prop, caught_by = "chunk_dtensor_layout", "chunk_dtensor local shape"

    def chunk_dtensor(self, tensor, rank, device_mesh):
        out = super().chunk_dtensor(tensor, rank, device_mesh)
        whole = out.full_tensor()
        return DTensor.from_local(whole, out.device_mesh, out.placements, run_check=False, shape=out.shape,
                                  stride=out.stride())


class ChunkDTensorCasts(FSDPExtension):
    prop, caught_by = "chunk_dtensor_layout", "chunk_dtensor dtype"

    def chunk_dtensor(self, tensor, rank, device_mesh):
        return super().chunk_dtensor(tensor, rank, device_mesh).to(torch.float64)


class ChunkDTensorReturnsUntouchable(FSDPExtension):
    prop, caught_by = "chunk_dtensor_layout", "chunk_dtensor returns a DTensor"

    def chunk_dtensor(self, tensor, rank, device_mesh):
        return Untouchable()


class AllGatherReturnsNone(FSDPExtension):
    prop, caught_by = "all_gather_dtensor_full", "all_gather_dtensor returns a plain tensor"

    def all_gather_dtensor(self, tensor, parent_mesh):
        return None


class AllGatherReturnsTheDTensor(FSDPExtension):
    prop, caught_by = "all_gather_dtensor_full", "all_gather_dtensor returns a plain tensor"

    def all_gather_dtensor(self, tensor, parent_mesh):
        return tensor


class AllGatherCasts(FSDPExtension):
    prop, caught_by = "all_gather_dtensor_full", "all_gather_dtensor dtype"

    def all_gather_dtensor(self, tensor, parent_mesh):
        return super().all_gather_dtensor(tensor, parent_mesh).double()


class AllGatherReturnsUntouchable(FSDPExtension):
    prop, caught_by = "all_gather_dtensor_full", "all_gather_dtensor returns a plain tensor"

    def all_gather_dtensor(self, tensor, parent_mesh):
        return Untouchable()


class ChunkTensorReturnsNone(FSDPExtension):
    prop, caught_by = "chunk_tensor_metadata", "chunk_tensor returns a ShardedTensor"

    def chunk_tensor(self, tensor, rank, world_size, num_devices_per_node, pg, device=None):
        return None


class ChunkTensorReturnsThePlainTensor(FSDPExtension):
    prop, caught_by = "chunk_tensor_metadata", "chunk_tensor returns a ShardedTensor"

    def chunk_tensor(self, tensor, rank, world_size, num_devices_per_node, pg, device=None):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ChunkTensorReturnsUntouchable(FSDPExtension):
    prop, caught_by = "chunk_tensor_metadata", "chunk_tensor returns a ShardedTensor"

    def chunk_tensor(self, tensor, rank, world_size, num_devices_per_node, pg, device=None):
        return Untouchable()


class PreLoadReturnsTheTensorAlone(FSDPExtension):
    prop, caught_by = "chunk_tensor_metadata", "pre_load_state_dict_transform returns a (tensor, shards) pair"

    def pre_load_state_dict_transform(self, tensor):
        return super().pre_load_state_dict_transform(tensor)[0]


class PreLoadReturnsNoShards(FSDPExtension):
    prop, caught_by = "chunk_tensor_metadata", "pre_load_state_dict_transform returns the inner shards"

    def pre_load_state_dict_transform(self, tensor):
        return super().pre_load_state_dict_transform(tensor)[0], None


FSDP = [PreFlattenReturnsTheFullTensor, PreFlattenReturnsNone, PreFlattenReturnsABareTensor, PreFlattenCastsTheLocal,
        PreFlattenReturnsUntouchable, PostUnflattenReturnsAPlainTensor, PostUnflattenReturnsUntouchable,
        ChunkDTensorReturnsNone, ChunkDTensorReturnsThePlainTensor, ChunkDTensorHoldsTheFullTensor,
        ChunkDTensorCasts, ChunkDTensorReturnsUntouchable, AllGatherReturnsNone, AllGatherReturnsTheDTensor,
        AllGatherCasts, AllGatherReturnsUntouchable, ChunkTensorReturnsNone, ChunkTensorReturnsThePlainTensor,
        ChunkTensorReturnsUntouchable, PreLoadReturnsTheTensorAlone, PreLoadReturnsNoShards]
