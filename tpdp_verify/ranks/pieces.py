"""A rank's part of a global tensor, and the parent putting the ranks' parts together.

Ranks return their shards as they hold them, and the parent rebuilds every global tensor.
That costs no collective (gathering every value on the ranks was most of an example's
time, and a gather that some ranks skip, holding no gradient for an empty shard, hangs
the others), and it checks more than a gather would: every element must be held by some
rank, and every rank holding a copy of an element (replicas across dp, Replicate across
tp) must hold the same value.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch


class Piece(NamedTuple):
    """The elements of a global tensor one rank holds."""

    local: torch.Tensor
    index: torch.Tensor  # the global flat index of each element ``local`` should hold
    shape: tuple[int, ...]  # the global tensor's shape


def cut(local: torch.Tensor, mesh, placements: Sequence, shape: Sequence[int]) -> Piece | None:
    """In a rank: ``local`` as this rank's Piece of a tensor laid out by ``placements``.

    The index comes from splitting an index tensor exactly as the layout splits the
    tensor (mesh dimension by mesh dimension, ``Shard`` and FSDP2's ``_StridedShard``
    alike), here, with no communication. None for a Partial layout, which the caller
    must gather. ``local`` is kept, not copied: pass a tensor of your own.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    index = torch.arange(math.prod(shape)).view(tuple(shape))
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            return None
        chunks, _ = placement._split_tensor(index, mesh.size(mesh_dim), with_padding=False)
        mine = coordinate[mesh_dim]
        index = chunks[mine] if mine < len(chunks) else index.narrow(placement.dim, 0, 0)
    return Piece(local.detach(), index, tuple(shape))


def _as_piece(value) -> Piece:
    if isinstance(value, Piece):
        return value
    shape = tuple(value.shape)
    return Piece(value, torch.arange(value.numel()).view(shape), shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN equal to NaN (a NaN both replicas hold is no disagreement)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)


def merge(values: list) -> tuple[torch.Tensor | None, str]:
    """The global tensor the ranks' values make up, and what is wrong with them ('' if nothing).

    ``values`` holds one entry a rank: a whole tensor, a Piece, or None (no tensor, e.g.
    no gradient). What is wrong is said in one line naming the ranks; the tensor is then
    the best that can be put together (elements no rank holds are NaN), so the values can
    still be judged.
    """
    held = [(rank, _as_piece(v)) for rank, v in enumerate(values) if v is not None]
    if not held:
        return None, ""
    first_rank, first = held[0]
    dtype, numel = first.local.dtype, math.prod(first.shape)
    out = torch.full((numel,), float("nan"), dtype=dtype) if dtype.is_floating_point \
        else torch.zeros(numel, dtype=dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    problems = []
    if len(held) < len(values):
        none = [r for r, v in enumerate(values) if v is None]
        problems.append(f"ranks {none} hold none where ranks {[r for r, _ in held]} hold one")
    for rank, p in held:
        if p.shape != first.shape or p.local.dtype != dtype:
            problems.append(f"rank {rank} holds a {p.local.dtype} of global shape {list(p.shape)}, "
                            f"rank {first_rank} a {dtype} of {list(first.shape)}")
            continue
        if p.local.shape != p.index.shape:
            problems.append(f"rank {rank}'s shard has shape {list(p.local.shape)}, its layout "
                            f"says {list(p.index.shape)}")
            continue
        index, local = p.index.flatten(), p.local.flatten()
        seen = covered[index]
        if seen.any() and not same(out[index][seen], local[seen]):
            problems.append(f"rank {rank} disagrees with another rank on elements both hold")
        out[index], covered[index] = local, True
    if not covered.all():
        problems.append(f"{int((~covered).sum())} of {numel} elements are held by no rank")
    return out.view(first.shape), "; ".join(problems)


def merge_named(values: list[dict]) -> tuple[dict, list[tuple[str, str]]]:
    """Each name's global tensor from the ranks' ``name -> value`` dicts, and (name, what is
    wrong) for every name whose pieces do not make one up."""
    names = list(dict.fromkeys(n for v in values for n in v))
    merged, problems = {}, []
    for name in names:
        merged[name], problem = merge([v.get(name) for v in values])
        if problem:
            problems.append((name, problem))
    return merged, problems
