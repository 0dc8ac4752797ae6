"""Reference implementation of the TP->DP transform, written from its contract.

The contract (torch keeps it private and undocumented; see docs/properties.md):

* ``flatten_tensor(t)`` hands data parallelism a plain tensor it can bucket and
  all-reduce: for a DTensor, its local shard as a leaf that shares the shard's storage
  and requires grad exactly when ``t`` does, plus the sharding info needed to rebuild
  ``t``; for anything else, ``t`` itself and ``None``.
* ``unflatten_tensor(local, info)`` rebuilds the DTensor ``t`` was: same mesh,
  placements, global shape, stride and dtype, with ``local`` as its shard, so that
  gradients of the DTensor land on ``local``.

This module is torch's independent twin: it uses only public DTensor API, so a
divergence between the two points at one of them, never at shared code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement


class ShardingInfo(NamedTuple):
    """What a local shard needs to become its DTensor again."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def flatten_tensor(t: torch.Tensor) -> tuple[torch.Tensor, ShardingInfo | None]:
    if not isinstance(t, DTensor):
        return t, None
    with torch.no_grad():
        shard = t.to_local()
    local = shard.detach().requires_grad_(t.requires_grad)
    return local, ShardingInfo(t.device_mesh, tuple(t.placements), t.shape, t.stride())


def unflatten_tensor(local: torch.Tensor, info: ShardingInfo) -> DTensor:
    return DTensor.from_local(
        local, info.mesh, info.placements, run_check=False, shape=info.shape, stride=info.stride
    )
