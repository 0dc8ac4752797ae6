"""DTensor cases: one parameter on a mesh, as the round trip and FSDP1's extension see it.

Plain, printable, picklable data: a case prints as a constructor call, so a falsifying
example replays by pasting it (``from torch.distributed.tensor import Shard, Replicate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tpdp_verify.cases import mesh_kind

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class TensorCase:
    """One DTensor parameter: where it lives, how it is laid out, what it holds."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    seed: int

    def full(self) -> torch.Tensor:
        """The global tensor, identical on every rank (seeded, float64 then cast)."""
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randn(self.shape, generator=gen, dtype=torch.float64).to(self.dtype)

    @property
    def region(self) -> str:
        """Where the case lies, as a baseline tells faults apart (runner.property.region): a
        layout fault of uneven shards says nothing of even ones."""
        if not any(p.is_shard() for p in self.placements):
            return "replicated"
        return "sharded unevenly" if shards_unevenly(self) else "sharded evenly"


def shards_unevenly(case: TensorCase) -> bool:
    """Whether some sharded dim does not divide by its mesh dimension."""
    return any(
        p.is_shard() and case.shape[p.dim] % n
        for p, n in zip(case.placements, case.mesh_shape)
    )


@dataclass(frozen=True)
class NestedCase:
    """A DTensor whose placements may shard one tensor dim over several mesh dims (nested
    ``Shard(d), Shard(d)``, unevenly where the dim does not divide), on a mesh where the
    submesh of the mesh dims ``flattened`` was flattened before (as HSDP, fully_shard over
    the SPMD mesh and a flattened dp group do), or none was."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    flattened: tuple[int, ...]  # consecutive mesh dims, or ()
    seed: int

    full = TensorCase.full  # the same seeded global tensor as a TensorCase's

    @property
    def mesh_names(self) -> tuple[str, ...]:
        """A root mesh of its own for each flattening: the ranks keep their meshes, and a
        flattened submesh, once made, changes how DTensor gathers on its root for good."""
        tag = "f" + "".join(map(str, self.flattened)) if self.flattened else "m"
        return tuple(f"{tag}_{i}" for i in range(len(self.mesh_shape)))


@dataclass(frozen=True)
class FusedCase:
    """A fused projection's weight (``parts`` blocks of ``rows`` rows concatenated: gate_up's
    2, qkv's 3; 1 is an unfused one) sharded per part over tp on a (dp, tp) mesh, each
    rank a block of every part (``_StridedShard``), as ``distribute_tensor`` of the weight
    viewed (parts, rows, cols) on Shard(1) then flattened makes it; ``fsdp``: then
    ``fully_shard`` over dp."""

    mesh_shape: tuple[int, int]
    parts: int
    rows: int
    cols: int
    fsdp: bool
    dtype: torch.dtype
    seed: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.parts * self.rows, self.cols)

    full = TensorCase.full  # the same seeded global tensor as a TensorCase's


@dataclass(frozen=True)
class FSDPCase:
    """A parameter as FSDP1 on a device mesh sees it: the root mesh is (dp, tp) or HSDP's
    (replicate, shard, tp); the parameter is a DTensor on the tp dim with ``tp_placement``,
    or a plain tensor (a layer the TP plan left alone) when that is None."""

    mesh_shape: tuple[int, ...]
    tp_placement: Placement | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    seed: int

    full = TensorCase.full  # the same seeded global tensor as a TensorCase's

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return ("dp", "tp") if len(self.mesh_shape) == 2 else ("replicate", "shard", "tp")

    @property
    def region(self) -> str:
        """Where the case lies, as a baseline tells faults apart: the parameter's TP layout
        ("plain", "tp replicate", "tp shard even" or "tp shard uneven") on the mesh's kind
        (tpdp_verify.cases.mesh_kind, FSDP's ranks as dp): chunk_tensor fails differently
        where FSDP's group is one rank."""
        p, tp = self.tp_placement, self.mesh_shape[-1]
        layout = ("plain" if p is None else "tp replicate" if not p.is_shard()
                  else "tp shard uneven" if self.shape[p.dim] % tp else "tp shard even")
        return f"{layout} on {mesh_kind((math.prod(self.mesh_shape[:-1]), tp))}"
