"""Reference implementation of FSDP1's tensor-parallel extension, written from its contract.

FSDP1 (``FullyShardedDataParallel``) sees a TP model's DTensor parameters only through
an ``FSDPExtensions`` object; torch's is ``DTensorExtensions`` in
``torch/distributed/tensor/parallel/fsdp.py``. Its contract (private, undocumented):

* ``pre_flatten_transform(t)`` / ``post_unflatten_transform(local, info)``: as the DP
  transform's ``flatten_tensor`` / ``unflatten_tensor`` (tpdp_verify/impls/transform.py), and
  the rebuilt DTensor is marked FSDP-flattened so that nested FSDP never flattens it again.
* ``chunk_tensor(t, rank, world_size, num_devices_per_node, pg)``: the ShardedTensor a
  sharded state dict holds. A plain tensor is chunked along dim 0 over ``pg``. A DTensor
  on a 1-D (tp) mesh becomes a ShardedTensor over the mesh's group whose metadata is the
  DTensor's own layout (every rank's block, each block once) and whose one local shard is
  this rank's block, itself a ShardedTensor: the block chunked along dim 0 over ``pg``.
* ``chunk_dtensor(t, rank, device_mesh)``: the DTensor a DTensor state dict holds, on the
  root mesh of ``device_mesh`` (the FSDP dims, then the tp dim): sharded ``Shard(0)`` over
  the FSDP dim (``Replicate()`` first over HSDP's replicate dim), keeping ``t``'s tp
  placement (``Replicate()`` for a plain tensor), detached, holding ``t``'s values.
* ``all_gather_dtensor(t, parent_mesh)``: the inverse: gather the FSDP dims and return the
  local tensor of the tp placement, which is ``t``'s tp shard.
* ``pre_load_state_dict_transform(st)``: the inner ShardedTensor ``chunk_tensor`` nested
  and its local shards.

Like tpdp_verify.impls.transform, this twin uses public DTensor API (and ShardedTensor's
constructor from metadata, the only way to build one without communicating), and
computes every block itself rather than through torch's layout helpers, so a divergence
points at one of the two. Functions call one another through ``self``, so a subclass
that changes one (tests/fsdp_mutants.py) changes it wherever a real one would be felt.
"""

from __future__ import annotations

import math
from itertools import product

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import (
    Shard as STShard,
)
from torch.distributed._shard.sharded_tensor import (
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharding_spec import ShardMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from tpdp_verify.impls.transform import ShardingInfo, flatten, unflatten

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


def block(shape, mesh_shape, placements, coord) -> Box:
    """The block of a global tensor that mesh coordinate ``coord`` holds: torch.chunk's
    split (ceil-sized chunks, trailing ones short or empty), one mesh dim after another."""
    start, stop = [0] * len(shape), list(shape)
    for n, p, c in zip(mesh_shape, placements, coord):
        if isinstance(p, Shard):
            d = p.dim
            length = stop[d] - start[d]
            chunk = math.ceil(length / n) if length else 0
            lo, hi = min(c * chunk, length), min((c + 1) * chunk, length)
            start[d], stop[d] = start[d] + lo, start[d] + hi
    return tuple(start), tuple(b - a for a, b in zip(start, stop))


def cut(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    offsets, sizes = box
    return tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]


class FSDPExtension:
    """The reference: one method for each function in tpdp_verify.impls.select.FSDP_FUNCTIONS."""

    # -- flattening for the FlatParameter ------------------------------------------------

    def pre_flatten_transform(self, t: torch.Tensor) -> tuple[torch.Tensor, ShardingInfo | None]:
        return flatten(t)

    def post_unflatten_transform(self, local: torch.Tensor, info: ShardingInfo) -> DTensor:
        from torch.distributed.fsdp._common_utils import _set_fsdp_flattened

        result = unflatten(local, info)
        _set_fsdp_flattened(result)  # FSDP's marker: never flatten this tensor again
        return result

    # -- sharded state dicts (ShardedTensor) -------------------------------------------

    def chunk_sharded(self, tensor: torch.Tensor, pg: dist.ProcessGroup) -> ShardedTensor:
        """``tensor`` chunked along dim 0 over ``pg``: one block (maybe empty) a rank."""
        n, me = pg.size(), dist.get_rank(pg)
        placements = (Shard(0),)
        boxes = [block(tensor.shape, (n,), placements, (r,)) for r in range(n)]
        ranks = [dist.get_global_rank(pg, r) for r in range(n)]
        return self.sharded_tensor(tensor, boxes, ranks, boxes[me], pg)

    def sharded_tensor(self, local_source: torch.Tensor | None, boxes: list[Box], ranks: list[int],
                       mine: Box, pg, size=None, local=None) -> ShardedTensor:
        """A ShardedTensor over ``pg`` with one metadata entry per box, placed on ``ranks``,
        whose local shard is ``mine``: ``local`` if given, else cut from ``local_source``."""
        device = (local if local is not None else local_source).device
        metadata = [ShardMetadata(list(o), list(s), f"rank:{r}/{device}") for (o, s), r in zip(boxes, ranks)]
        me = dist.get_rank()
        mine_md = next(m for m, r, b in zip(metadata, ranks, boxes) if r == me and b == mine)
        if local is None:
            local = cut(local_source, mine).detach().clone().contiguous()
        dtype = local.dtype if not isinstance(local, ShardedTensor) else local.metadata().tensor_properties.dtype
        global_md = ShardedTensorMetadata(
            shards_metadata=metadata,
            size=torch.Size(size if size is not None else local_source.shape),
            tensor_properties=TensorProperties(dtype=dtype, requires_grad=False),
        )
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [STShard(local, mine_md)], sharded_tensor_metadata=global_md, process_group=pg, init_rrefs=False
        )

    def dtensor_boxes(self, t: DTensor) -> tuple[list[Box], list[int]]:
        """Each distinct block of ``t`` once, placed on this rank if it holds it, else on the
        first rank that does (replicas hold one block: the metadata may list it once only)."""
        mesh = t.device_mesh
        me = dist.get_rank()
        placed: dict[Box, int] = {}
        for coord in product(*map(range, mesh.shape)):
            box = block(t.shape, mesh.shape, t.placements, coord)
            rank = int(mesh.mesh[coord])
            if box not in placed or rank == me:
                placed[box] = rank
        return list(placed), list(placed.values())

    def chunk_tensor(self, tensor: torch.Tensor, rank: int, world_size: int, num_devices_per_node: int,
                     pg: dist.ProcessGroup, device: torch.device | None = None) -> ShardedTensor:
        if not isinstance(tensor, DTensor):
            return self.chunk_sharded(tensor, pg)
        mesh = tensor.device_mesh
        if mesh.ndim != 1:
            raise ValueError(f"chunk_tensor takes a DTensor on a 1-D (tp) mesh, not {mesh.ndim}-D")
        inner = self.chunk_sharded(tensor.to_local(), pg)
        boxes, ranks = self.dtensor_boxes(tensor)
        mine = block(tensor.shape, mesh.shape, tensor.placements, mesh.get_coordinate())
        return self.sharded_tensor(None, boxes, ranks, mine, mesh.get_group(), size=tensor.shape, local=inner)

    def pre_load_state_dict_transform(self, tensor: ShardedTensor) -> tuple[torch.Tensor, list[STShard]]:
        shards = tensor.local_shards()
        if len(shards) == 1 and isinstance(shards[0].tensor, ShardedTensor):
            tensor = shards[0].tensor
            shards = tensor.local_shards()
        return tensor, list(shards)

    # -- DTensor state dicts ---------------------------------------------------------

    def fsdp_placements(self, device_mesh: DeviceMesh) -> list[Placement]:
        """FSDP shards over its last mesh dim; HSDP replicates over the one before."""
        return [Replicate()] * (device_mesh.ndim - 1) + [Shard(0)]

    def chunk_dtensor(self, tensor: torch.Tensor, rank: int, device_mesh: DeviceMesh) -> DTensor:
        root = device_mesh._get_root_mesh()
        if root is None or root.ndim <= device_mesh.ndim:
            raise ValueError("chunk_dtensor needs the FSDP mesh to be a sub-mesh of a (FSDP, tp) mesh")
        fsdp = self.fsdp_placements(device_mesh)
        if isinstance(tensor, DTensor):
            tp, local = list(tensor.placements), tensor.to_local()
        else:
            tp, local = [Replicate()] * (root.ndim - device_mesh.ndim), tensor
        source = DTensor.from_local(
            local.detach().clone(), root, [Replicate()] * len(fsdp) + tp, run_check=False,
            shape=tensor.shape, stride=tensor.stride(),
        )
        return source.redistribute(root, fsdp + tp)

    def all_gather_dtensor(self, tensor: DTensor, parent_mesh: DeviceMesh | None) -> torch.Tensor:
        if parent_mesh != tensor.device_mesh:
            raise ValueError(f"all_gather_dtensor: {tensor.device_mesh} is not the FSDP root mesh {parent_mesh}")
        placements = [Replicate()] * (tensor.device_mesh.ndim - 1) + [tensor.placements[-1]]
        return tensor.redistribute(tensor.device_mesh, placements).to_local()
