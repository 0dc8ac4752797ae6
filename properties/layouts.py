"""Nested shards read back: a DTensor that shards one dim over several mesh dims gives back
what it holds, by every way a user reads it.

HSDP and fully_shard over the SPMD mesh shard over two dp dims and flatten them into one
submesh; a batch or a parameter dim that does not divide over both is nested and uneven,
``Shard(d), Shard(d)``. What DTensor gathers, redistributes and hands a full state_dict is
then what every rank trains on, logs and checkpoints. The transform is not called: this
judges DTensor itself, on the layouts the DP entry points build around it.
"""

from __future__ import annotations

import torch
from torch import nn

from tpdp_verify.cases.tensors import NestedCase
from tpdp_verify.judging.verdict import Verdict
from tpdp_verify.properties.strategies import nested_cases
from tpdp_verify.ranks.observation import Check, observing
from tpdp_verify.runner.property import tpdp_property


def block(full: torch.Tensor, mesh_shape: tuple[int, ...], placements, coordinate: list[int]) -> torch.Tensor:
    """The rank at ``coordinate``'s block of ``full`` as DTensor's contract lays it out: each
    mesh dim in order chunks what the ones before it left (``torch.chunk``'s sizes; a rank
    past the last chunk holds an empty one)."""
    out = full
    for p, n, c in zip(placements, mesh_shape, coordinate):
        if p.is_shard():
            chunks = torch.chunk(out, n, dim=p.dim)
            out = chunks[c] if c < len(chunks) else out.narrow(p.dim, 0, 0)
    return out


def same(name: str, got: torch.Tensor, want: torch.Tensor) -> Check:
    """``got`` holds exactly ``want``: moving data changes no value."""
    if got.shape != want.shape:
        return Check(name, False, f"shape {tuple(got.shape)}, where {tuple(want.shape)} is right")
    ok = torch.equal(got, want)
    worst = "" if ok or not want.numel() else f"; {(got.double() - want.double()).abs().max().item():.3g} off at worst"
    return Check(name, ok, f"{int((got != want).sum())} of {want.numel()} values differ{worst}")


def read_back_checks(case: NestedCase, mesh) -> list[Check]:
    """On every rank: the case's tensor distributed, then read back by its shard, full_tensor,
    redistribute (to Replicate everywhere, and one sharded mesh dim at a time), a gradient
    through full_tensor, and a full state_dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import Replicate, distribute_tensor

    full, at = case.full(), mesh.get_coordinate()
    t = nn.Parameter(distribute_tensor(full, mesh, case.placements))
    checks = [
        same("the shard is DTensor's own block", t.to_local().detach(), block(full, case.mesh_shape, case.placements, at)),
        same("full_tensor() gives t", t.full_tensor().detach(), full),
        same("redistribute to Replicate() gives t",
             t.redistribute(mesh, [Replicate()] * mesh.ndim).to_local().detach(), full),
    ]
    for i, p in enumerate(case.placements):
        if p.is_shard():
            kept = tuple(Replicate() if j == i else q for j, q in enumerate(case.placements))
            checks.append(same(f"redistribute replicating mesh dim {i} gives its blocks",
                               t.redistribute(mesh, kept).to_local().detach(), block(full, case.mesh_shape, kept, at)))
    checks.append(_gradient_check(case, t, at))
    holder = nn.Module()
    holder.t = t
    state = get_model_state_dict(holder, options=StateDictOptions(full_state_dict=True))
    got = state.get("t")
    checks.append(same("a full state_dict gives t", got.detach(), full) if isinstance(got, torch.Tensor) else
                  Check("a full state_dict gives t", False, f"its entry 't' is {type(got).__name__}"))
    return checks


def _gradient_check(case: NestedCase, t, at: list[int]) -> Check:
    """d(sum(full_tensor(t) * w))/dt, w seeded, is w's block on each rank. Computed only where
    full_tensor() has t's shape on every rank (a product of other shapes raises, and the
    ranks must run the backward together); else the check fails, saying so."""
    from tpdp_verify.properties.roundtrip import all_ranks

    name = "a gradient through full_tensor() reaches the shard"
    weight = torch.randn(case.shape, generator=torch.Generator().manual_seed(case.seed + 1),
                         dtype=torch.float64).to(case.dtype)
    gathered = t.full_tensor()
    if not all_ranks(gathered.shape == weight.shape):
        return Check(name, False, "not computed: full_tensor() has another shape than t on some rank")
    (gathered * weight).sum().backward()
    if t.grad is None:
        return Check(name, False, "no gradient reached t")
    return same(name, t.grad.to_local(), block(weight, case.mesh_shape, case.placements, at))


@observing
def observe_read_back(case: NestedCase, impl_name: str) -> list[Check]:
    """On every rank: the case's tensor read back by each way, under the implementation (its
    transform is not called: what it patches of DTensor is judged)."""
    from tpdp_verify.impls.select import installed, load
    from tpdp_verify.ranks.rank import device_mesh

    mesh = device_mesh(case.mesh_shape, case.mesh_names)
    if case.flattened:
        mesh[tuple(case.mesh_names[i] for i in case.flattened)]._flatten()
    with installed(load(impl_name)):
        return read_back_checks(case, mesh)


@tpdp_property(min_world_size=4, case=nested_cases)
def nested_shards_read_back(pool, impl: str, case: NestedCase) -> None:
    """A DTensor sharding one dim over several mesh dims, flattened or not, reads back as t: its shard, full_tensor, redistribute, a gradient, a full state_dict."""
    Verdict.of_ranks(pool.run(observe_read_back, case, impl)).raise_if_failed()
