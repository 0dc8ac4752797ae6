"""Deliberately broken FSDP extensions: each must be caught by the FSDP extension properties.

Each class is an implementation under test (``load_fsdp("fsdp_mutants.Name")``) that
breaks one clause of the contract in tpdp_verify/impls/fsdp_extension.py and keeps the rest;
``caught_by`` names the check that must fail, ``prop`` the property that makes it.
"""

from torch.distributed.tensor import DTensor, Replicate, Shard

from tpdp_verify.impls.fsdp_extension import FSDPExtension


class CopiesLocal(FSDPExtension):
    """FSDP would flatten (and train) a copy, never the model's shard."""

    prop = "fsdp_flatten_roundtrip"
    caught_by = "pre_flatten local shares storage with t's shard"

    def pre_flatten_transform(self, t):
        local, info = super().pre_flatten_transform(t)
        return (local, info) if info is None else (local.detach().clone().requires_grad_(local.requires_grad), info)


class ForgetsFSDPMark(FSDPExtension):
    """Nested FSDP would flatten the rebuilt DTensor a second time."""

    prop = "fsdp_flatten_roundtrip"
    caught_by = "post_unflatten marks the result FSDP-flattened"

    def post_unflatten_transform(self, local, info):
        return DTensor.from_local(local, info.mesh, info.placements, run_check=False,
                                  shape=info.shape, stride=info.stride)


class ShardsOverHSDPReplicas(FSDPExtension):
    """Shard(0) on the first mesh dim, as torch 2.13 does for a plain tensor: on HSDP's
    (replicate, shard, tp) mesh that shards over the replicas."""

    prop = "chunk_dtensor_layout"
    caught_by = "chunk_dtensor placements"

    def fsdp_placements(self, device_mesh):
        return [Shard(0)] + [Replicate()] * (device_mesh.ndim - 1)


class InfersGlobalShape(FSDPExtension):
    """from_local without the shape: each rank guesses local * mesh size (torch 2.13)."""

    prop = "chunk_dtensor_layout"
    caught_by = "chunk_dtensor agrees on the global shape on every rank before communicating"

    def chunk_dtensor(self, tensor, rank, device_mesh):
        root = device_mesh._get_root_mesh()
        fsdp = self.fsdp_placements(device_mesh)
        tp = list(tensor.placements) if isinstance(tensor, DTensor) else [Replicate()]
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        source = DTensor.from_local(local.detach().clone(), root, [Replicate()] * len(fsdp) + tp, run_check=False)
        return source.redistribute(root, fsdp + tp)


class GathersTPToo(FSDPExtension):
    """Gathers every mesh dim: returns the full tensor, not the tp shard FSDP expects."""

    prop = "all_gather_dtensor_full"
    caught_by = "all_gather_dtensor local shape"

    def all_gather_dtensor(self, tensor, parent_mesh):
        return tensor.full_tensor()


class LeavesTheLastBlockOut(FSDPExtension):
    """The metadata omits the last tp rank's block (unless this rank holds it): a
    checkpoint written from it misses those elements."""

    prop = "chunk_tensor_metadata"
    caught_by = "chunk_tensor runs"  # ShardedTensor itself refuses metadata that leaves elements out

    def dtensor_boxes(self, t):
        import torch.distributed as dist

        boxes, ranks = super().dtensor_boxes(t)
        if len(boxes) > 1 and ranks[-1] != dist.get_rank():
            return boxes[:-1], ranks[:-1]
        return boxes, ranks


class ChunksOverTheTPGroup(FSDPExtension):
    """The inner ShardedTensor chunks the tp shard over the tp group, not FSDP's: the
    blocks tile, but on ranks that do not hold them in FSDP."""

    prop = "chunk_tensor_metadata"
    caught_by = "chunk_tensor inner shards are placed on FSDP's ranks"

    def chunk_tensor(self, tensor, rank, world_size, num_devices_per_node, pg, device=None):
        tp = tensor.device_mesh.get_group() if isinstance(tensor, DTensor) else pg
        return super().chunk_tensor(tensor, rank, world_size, num_devices_per_node, tp, device)


class LoadsTheOuterTensor(FSDPExtension):
    """Loading sees the outer ShardedTensor, whose local shard is a ShardedTensor itself."""

    prop = "chunk_tensor_metadata"
    caught_by = "pre_load_state_dict_transform returns the inner shards"

    def pre_load_state_dict_transform(self, tensor):
        return tensor, list(tensor.local_shards())


MUTANTS = [CopiesLocal, ForgetsFSDPMark, ShardsOverHSDPReplicas, InfersGlobalShape, GathersTPToo,
           LeavesTheLastBlockOut, ChunksOverTheTPGroup, LoadsTheOuterTensor]
