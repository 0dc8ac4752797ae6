"""DTensor layouts read back: a DTensor gives back what it holds, by every way a user reads it
(its shard, full_tensor, redistribute, a full state_dict, a DCP checkpoint), on the layouts
the DP entry points build around TP.

Nested shards: a DTensor that shards one dim over several mesh dims.

HSDP and fully_shard over the SPMD mesh shard over two dp dims and flatten them into one
submesh; a batch or a parameter dim that does not divide over both is nested and uneven,
``Shard(d), Shard(d)``. What DTensor gathers, redistributes and hands a full state_dict is
then what every rank trains on, logs and checkpoints. The transform is not called: this
judges DTensor itself, on the layouts the DP entry points build around it.

Fused projections: a weight whose rows concatenate parts (gate_up, qkv), sharded per part
over tp so that each rank holds a block of every part (``_StridedShard``), then FSDP2 over
dp, checkpointed with DCP and loaded back onto its own layout, a plain tensor and another
mesh; and a checkpoint saved from a contiguous layout loaded onto the per-part ones.
"""

from __future__ import annotations

import math
import shutil
import tempfile

import torch
from torch import nn
from torch.distributed.tensor import Shard

from tpdp_verify import signature
from tpdp_verify.cases.tensors import FusedCase, NestedCase
from tpdp_verify.judging.verdict import Verdict
from tpdp_verify.properties.roundtrip import all_ranks
from tpdp_verify.properties.strategies import fused_cases, nested_cases
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


# -- fused projections ---------------------------------------------------------------------


def fused_weight(full: torch.Tensor, case: FusedCase, mesh):
    """``full`` sharded per part over ``mesh`` (1-D), as a user shards a fused projection with
    public DTensor calls: viewed (parts, rows, cols), Shard(1), flattened back."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.unflatten(0, (case.parts, case.rows)), mesh, [Shard(1)]).flatten(0, 1)


def part_blocks(full: torch.Tensor, case: FusedCase, rank: int, ranks: int) -> torch.Tensor:
    """The rank's block of each part (``torch.chunk``'s sizes), concatenated in part order."""
    return torch.cat([block(part, (ranks,), [Shard(0)], [rank]) for part in full.unflatten(0, (case.parts, case.rows))])


def _ran(name: str, call) -> tuple[bool, list[Check]]:
    """(whether ``call()`` returned, no check) or (False, a failed check naming what it raised).
    DCP raises alike on every rank (its coordinator gathers the errors), as a
    CheckpointException, which is not an Exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        call()
        return True, []
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the exception is the verdict
        said = str(exc).strip().splitlines()
        where = signature.innermost(exc)
        return False, [Check(name, False, f"{type(exc).__name__}: {said[-1] if said else ''}{where}",
                             signature.raised(exc), where=where)]


def _tiles(chunks, shape: tuple[int, ...]) -> Check:
    """A checkpoint's chunks of a tensor cover it once: no two overlap, and their volumes add
    up to its own (so no gap)."""
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
    overlapping = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]
                   if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(*a, *b))
                   and all(s for s in a[1] + b[1])]
    volume = sum(math.prod(s) for _, s in boxes)
    return Check("its checkpoint's chunks tile w", not overlapping and volume == math.prod(shape),
                 f"chunks (offsets, sizes) {boxes} of {shape}: "
                 + (f"{overlapping[0][0]} and {overlapping[0][1]} overlap" if overlapping
                    else f"they hold {volume} elements of {math.prod(shape)}"))


def _holding(weight) -> nn.Module:
    holder = nn.Module()
    holder.weight = nn.Parameter(weight)
    return holder


def _laid_out(full: torch.Tensor, case: FusedCase, mesh) -> nn.Module:
    """A module holding ``full`` as the case lays it out: per part over tp, FSDP2 over dp."""
    holder = _holding(fused_weight(full, case, mesh["tp"]))
    if case.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(holder, mesh=mesh["dp"])
    return holder


def fused_checks(case: FusedCase, mesh, directory: str) -> list[Check]:
    """On every rank: the case's weight laid out, read back, saved with DCP and loaded onto
    its own layout, into a plain tensor, and onto a mesh of every rank on tp; and a
    checkpoint of it saved from a contiguous layout (``Shard(0)`` over every rank, as a
    checkpoint written by another job's layout is) loaded onto the same two. Only where
    every rank's shard holds its blocks (as the round trip gathers only a layout every rank
    agrees is right): the collectives of a shard of another shape than its layout says
    hang under FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full, tp = case.full(), mesh["tp"]
    shard = fused_weight(full, case, tp).to_local()
    checks = [same("the shard holds a block of each part", shard,
                   part_blocks(full, case, tp.get_local_rank(), tp.size()))]
    if not all_ranks(checks[0].ok):  # a shard of another shape than its layout's: gathering it hangs
        return checks
    holder = _laid_out(full, case, mesh)
    checks += [same("full_tensor() gives w", holder.weight.full_tensor().detach(), full),
               same("a full state_dict gives w", get_model_state_dict(
                   holder, options=StateDictOptions(full_state_dict=True))["weight"].detach(), full)]
    return checks + _own_checkpoint(case, mesh, holder, f"{directory}/own") + _contiguous_checkpoint(
        case, mesh, f"{directory}/contiguous")


def _own_checkpoint(case: FusedCase, mesh, holder: nn.Module, directory: str) -> list[Check]:
    """The laid-out weight saved with DCP: its chunks tile it, and it loads into a plain
    tensor and onto the two layouts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = case.full()
    saved, checks = _ran("DCP saves it", lambda: dcp.save(get_model_state_dict(holder), checkpoint_id=directory))
    if not all_ranks(saved):
        return checks
    checks.append(_tiles(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata["weight"].chunks,
                         case.shape))
    plain = {"weight": torch.zeros(case.shape, dtype=case.dtype)}
    _, failed = _ran("DCP loads it into a plain tensor", lambda: dcp.load(plain, checkpoint_id=directory))
    checks += failed or [same("DCP loads it into a plain tensor", plain["weight"], full)]
    return checks + _loads("it", case, mesh, directory)


def _contiguous_checkpoint(case: FusedCase, mesh, directory: str) -> list[Check]:
    """w saved by DCP from a contiguous layout over every rank (DCP saves that one on every
    release), loaded onto the case's per-part layouts: a load reshards by the chunks the
    target's DTensors describe, whatever the save could."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    from tpdp_verify.ranks.rank import device_mesh

    every = device_mesh((math.prod(case.mesh_shape),), ("every",))
    state = {"weight": distribute_tensor(case.full(), every, [Shard(0)])}
    saved, checks = _ran("DCP saves w sharded contiguously", lambda: dcp.save(state, checkpoint_id=directory))
    return checks + (_loads("w saved contiguously", case, mesh, directory) if all_ranks(saved) else [])


def _loads(what: str, case: FusedCase, mesh, directory: str) -> list[Check]:
    """The checkpoint in ``directory`` loaded onto the case's own layout and onto the weight
    sharded per part over a mesh of every rank (another mesh shape: resharding on load),
    each read back whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from tpdp_verify.ranks.rank import device_mesh

    full, checks = case.full(), []
    zeros = torch.zeros(case.shape, dtype=case.dtype)
    for name, fresh in (("its own layout", _laid_out(zeros, case, mesh)),
                        ("a mesh of every rank on tp", _holding(fused_weight(
                            zeros, case, device_mesh((math.prod(case.mesh_shape),), ("every",)))))):
        state = get_model_state_dict(fresh)
        _, failed = _ran(f"DCP loads {what} onto {name}", lambda: (dcp.load(state, checkpoint_id=directory),
                                                                       set_model_state_dict(fresh, state)))
        checks += failed or [same(f"DCP loads {what} onto {name}", fresh.weight.full_tensor().detach(), full)]
    return checks


@observing
def observe_fused(case: FusedCase, impl_name: str, directory: str) -> list[Check]:
    """On every rank: the fused weight read back and checkpointed, under the implementation."""
    from tpdp_verify.impls.select import installed, load
    from tpdp_verify.ranks.rank import device_mesh

    mesh = device_mesh(case.mesh_shape, ("dp", "tp"))
    with installed(load(impl_name)):
        return fused_checks(case, mesh, directory)


@tpdp_property(min_world_size=2, case=fused_cases)
def fused_projections_read_back(pool, impl: str, case: FusedCase) -> None:
    """A fused projection sharded per part over tp, with FSDP2 over dp or not, reads back as w and checkpoints with DCP: its shard, full_tensor, a full state_dict, DCP's chunks, loads onto its own layout, a plain tensor and another mesh, and loads of a contiguous checkpoint onto both."""
    directory = tempfile.mkdtemp(prefix="tpdp-checkpoint-")  # one the ranks share, empty
    try:
        Verdict.of_ranks(pool.run(observe_fused, case, impl, directory)).raise_if_failed()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
