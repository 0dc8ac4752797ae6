"""Hypothesis strategies for DTensor cases (tpdp_verify.cases.tensors).

A drawn case prints as a constructor call, so a falsifying example replays by pasting it
(``from torch.distributed.tensor import Shard, Replicate``).
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from tpdp_verify.cases.tensors import FSDPCase, FusedCase, NestedCase, TensorCase

TENSOR_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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
        dtype=draw(st.sampled_from(TENSOR_DTYPES)),
        requires_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


# -- FSDP1's tensor-parallel extension ---------------------------------------------------


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
        dtype=draw(st.sampled_from(TENSOR_DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )


# -- nested shards over flattened meshes -------------------------------------------------


@st.composite
def nested_cases(draw, world_size: int) -> NestedCase:
    """NestedCases on meshes of two and three dims, three draws in four a mesh where two dims
    or more are real; three mesh dims in four shard one drawn tensor dim (nested), the rest
    another dim or none; dims that divide, do not, and are smaller than the mesh dims that
    share them; three draws in four a run of two or more consecutive mesh dims flattened
    before. Shrinking goes to the nested and the flattened."""
    ndim_mesh = draw(st.sampled_from((2, 3)))
    shapes = factorizations(world_size, ndim_mesh)
    real = [s for s in shapes if sum(n > 1 for n in s) >= 2]
    mesh_shape = draw(st.sampled_from(real if real and draw(st.integers(0, 3)) < 3 else shapes))
    ndim = draw(st.integers(1, 3))
    shared = draw(st.integers(0, ndim - 1))
    other = st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard))
    placements = tuple(Shard(shared) if draw(st.integers(0, 3)) < 3 else draw(other) for _ in mesh_shape)
    largest = 2 * math.prod(mesh_shape) + 1
    shape = tuple(draw(st.lists(st.integers(1, largest), min_size=ndim, max_size=ndim)))
    runs = [tuple(range(a, b)) for a in range(ndim_mesh) for b in range(a + 2, ndim_mesh + 1)]
    return NestedCase(
        mesh_shape=mesh_shape,
        placements=placements,
        shape=shape,
        dtype=draw(st.sampled_from(TENSOR_DTYPES)),
        flattened=draw(st.sampled_from(runs)) if draw(st.integers(0, 3)) < 3 else (),
        seed=draw(st.integers(0, 2**16)),
    )


# -- fused projections --------------------------------------------------------------------


@st.composite
def fused_cases(draw, world_size: int) -> FusedCase:
    """FusedCases on each (dp, tp) mesh of ``world_size`` ranks with tp real: 2 or 3 parts
    three draws in four (1, an unfused weight, else); rows per part that divide over tp,
    do not, and are fewer than its ranks, but for parts of one row and more than one column,
    which DTensor's view refuses (the exclusion fused_parts_of_one_row); FSDP2 over dp or not."""
    meshes = [(world_size // t, t) for t in range(2, world_size + 1) if world_size % t == 0]
    mesh = draw(st.sampled_from(meshes))
    rows = draw(st.integers(1, 2 * mesh[1] + 1))
    return FusedCase(
        mesh_shape=mesh,
        parts=draw(st.sampled_from((2, 3))) if draw(st.integers(0, 3)) < 3 else 1,
        rows=rows,
        cols=1 if rows == 1 else draw(st.integers(1, 4)),
        fsdp=draw(st.booleans()),
        dtype=draw(st.sampled_from(TENSOR_DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )
