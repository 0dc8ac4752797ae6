"""Hypothesis strategies for DTensor cases: plain, printable, picklable data.

A drawn case prints as a constructor call, so a falsifying example replays by pasting it
(``from torch.distributed.tensor import Shard, Replicate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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


def mesh_shapes(world_size: int, max_dims: int = 2) -> st.SearchStrategy[tuple[int, ...]]:
    """Every factorization of ``world_size`` into 1..max_dims mesh dimensions."""
    shapes = [(world_size,)]
    if max_dims >= 2:
        shapes += [(a, world_size // a) for a in range(2, world_size) if world_size % a == 0]
    return st.sampled_from(shapes)


@st.composite
def tensor_cases(draw, world_size: int, max_mesh_dims: int = 1) -> TensorCase:
    """DTensor cases on a mesh of ``world_size`` ranks.

    Shapes are drawn so that dims divide the mesh evenly, unevenly, and are smaller than
    the mesh dimension that shards them (some ranks then hold empty shards).
    """
    mesh_shape = draw(mesh_shapes(world_size, max_mesh_dims))
    ndim = draw(st.integers(1, 3))
    largest = 2 * max(mesh_shape) + 1
    shape = tuple(draw(st.lists(st.integers(1, largest), min_size=ndim, max_size=ndim)))
    placement = st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard))
    placements = tuple(draw(st.lists(placement, min_size=len(mesh_shape), max_size=len(mesh_shape))))
    return TensorCase(
        mesh_shape=mesh_shape,
        placements=placements,
        shape=shape,
        dtype=draw(st.sampled_from(DTYPES)),
        requires_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def shards_unevenly(case: TensorCase) -> bool:
    """Whether some sharded dim does not divide by its mesh dimension."""
    return any(
        isinstance(p, Shard) and case.shape[p.dim] % n
        for p, n in zip(case.placements, case.mesh_shape)
    )


# -- FSDP1's tensor-parallel extension ---------------------------------------------------


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


def factorizations(world_size: int, ndim: int) -> list[tuple[int, ...]]:
    """Every ordered way to write ``world_size`` as ``ndim`` factors, 1s included."""
    if ndim == 1:
        return [(world_size,)]
    return [(a, *rest) for a in range(1, world_size + 1) if world_size % a == 0
            for rest in factorizations(world_size // a, ndim - 1)]


@st.composite
def fsdp_cases(draw, world_size: int, mesh_dims: tuple[int, ...] = (2, 3)) -> FSDPCase:
    """FSDPCases on 2-D and/or 3-D meshes of ``world_size`` ranks, with dims that shard
    evenly, unevenly and smaller than the mesh dim, and plain (non-TP) tensors too."""
    ndim_mesh = draw(st.sampled_from(mesh_dims))
    mesh_shape = draw(st.sampled_from(factorizations(world_size, ndim_mesh)))
    ndim = draw(st.integers(1, 3))
    largest = 2 * max(mesh_shape) + 1
    shape = tuple(draw(st.lists(st.integers(1, largest), min_size=ndim, max_size=ndim)))
    tp = st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard), st.none())
    return FSDPCase(
        mesh_shape=mesh_shape,
        tp_placement=draw(tp),
        shape=shape,
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )
