"""The DP that large models train with: HSDP over a 2-D DP mesh with TP on a third dimension,
and fully_shard over the whole SPMD mesh.

A drawn case is a ``TrainCase`` like every other training property's, on a 3-D
(dp_replicate, dp_shard, tp) mesh as torchtitan builds it, or on any mesh with
``dp_mesh_dims`` set (how DP sees the mesh: one dimension of the case); the same ranks,
oracles and verdicts judge it. These properties draw from a space of their own, so that the
other properties' draws, and the baseline learned from them, stay as they were. Checkpoints
of HSDP and of the SPMD form are drawn too: state_dict, and save, load and resume by every route.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import strategies as st

from tpdp_verify.cases.training import (
    BUILT,
    FSDP1_FLAT,
    FSDP1_HYBRID,
    FSDP2_ENTRIES,
    HALF,
    HSDP_ENTRIES,
    LOSS_REDUCTIONS,
    SPMD_FORMS,
    FSDP1Options,
    FSDP2Options,
    Size,
    TrainCase,
)
from tpdp_verify.fixtures.zoo import TRAINED
from tpdp_verify.oracles.checkpoints import verdict_resume, verdict_state_dict
from tpdp_verify.oracles.verdicts import verdict_one_device, verdict_plain_ddp
from tpdp_verify.properties.exclusions import REFUSED_ON_2D_DP_MESH
from tpdp_verify.properties.strategies import factorizations
from tpdp_verify.properties.training import (
    _fsdp2_options,
    _habits,
    _one_of,
    _sizes,
    every_entry,
    meshes,
    run_fields,
    weighted,
)
from tpdp_verify.ranks.checkpoint import ROUTES
from tpdp_verify.runner.property import tpdp_property, worth_explaining


def hsdp_meshes(world_size: int) -> tuple[tuple[int, int, int], ...]:
    """(dp_replicate, dp_shard, tp) meshes, as often as they matter: every dimension real
    four times, TP with one real dp dimension twice, the rest (HSDP without TP, TP or DP
    alone) once each. Order kept: shrinking goes to the first."""
    def weight(shape):
        return 4 if min(shape) > 1 else 2 if shape[2] > 1 and max(shape[:2]) > 1 else 1

    shapes = sorted(factorizations(world_size, 3), key=lambda s: (-weight(s), s))
    return tuple(s for s in shapes for _ in range(weight(s)))


SHARD_DIMS = (0, 1)  # FSDP2Options.shard_dim: torch's default dim, and another

# How DP sees the mesh: a 2-D DP sub-mesh of a 3-D mesh (HSDP), the whole SPMD mesh (FSDP2's
# dp_mesh_dims, on a 2-D or a 3-D mesh), or the dp sub-mesh of a (dp, tp) mesh as FSDP1's
# ZeRO stages take it (FSDP1_FLAT). Each its own region.
VIEWS = ("hsdp", "spmd", "zero")


def spmd_meshes(world_size: int) -> tuple[tuple[int, ...], ...]:
    """The meshes the SPMD form is drawn on: (dp, tp) ones, then 3-D ones, weighted alike."""
    return weighted(meshes(world_size)) + hsdp_meshes(world_size)


@st.composite
def large_dp_cases(draw, world_size: int, half: bool = False) -> TrainCase:
    """Cases of ``world_size`` ranks: HSDP on a 3-D mesh through each entry point that takes a
    2-D DP mesh (FSDP1 with a hybrid sharding strategy), or FSDP2 over the whole SPMD mesh
    (fully_shard with each form of dp_mesh_dims, its replicate with the replicating one) and
    each reduction of the loss over the global batch; with FSDP2's options (fully_shard
    sharding on another dim than 0 too) and the training habits; or FSDP1's ZeRO stages on a
    (dp, tp) mesh. FSDP1 draws its keywords (FSDP1Options) on either DP mesh.
    ``half``: always a mixed-precision policy for FSDP2 and FSDP1 (trains_like_plain_dp's)."""
    view = draw(_one_of(VIEWS))
    mesh = draw(_one_of({"hsdp": hsdp_meshes, "spmd": spmd_meshes, "zero": weighted_meshes}[view](world_size)))
    model = draw(_one_of(TRAINED))
    if view == "hsdp":
        entry, spmd = draw(_one_of(tuple(e for e in HSDP_ENTRIES if e not in REFUSED_ON_2D_DP_MESH))), ""
    elif view == "zero":
        entry, spmd = "fsdp1", ""
    else:
        entry = draw(_one_of(FSDP2_ENTRIES))
        spmd = "replicate" if entry == "replicate_fsdp" else \
            draw(_one_of(SPMD_FORMS if len(mesh) == 3 else SPMD_FORMS[:2]))
    fsdp = draw(_fsdp2_options(half)) if entry in FSDP2_ENTRIES else FSDP2Options()
    if entry == "fully_shard" and spmd != "replicate":  # a shard_placement_fn where FSDP shards
        fsdp = dataclasses.replace(fsdp, shard_dim=draw(_one_of(SHARD_DIMS)))
    return TrainCase(
        model=model,
        size=draw(_sizes(model, mesh[-1])),
        mesh_shape=mesh,
        entry=entry,
        fsdp=fsdp,
        habits=draw(_habits(model, entry, False)),
        **run_fields(draw, entry, BUILT, fsdp),
        fsdp1_strategy=draw(_one_of(FSDP1_HYBRID if len(mesh) == 3 else FSDP1_FLAT)) if entry == "fsdp1" else "",
        dp_mesh_dims=spmd,
        loss_reduction=draw(_one_of(LOSS_REDUCTIONS)) if spmd else "",
        fsdp1=draw(_fsdp1_options(half)) if entry == "fsdp1" else FSDP1Options(),
    )


def weighted_meshes(world_size: int) -> tuple[tuple[int, int], ...]:
    return weighted(meshes(world_size))


@st.composite
def _fsdp1_options(draw, half: bool) -> FSDP1Options:
    """Each child its own FSDP unit or not; with ``half``, always mixed precision in either
    half dtype (as FSDP2's options: in full precision it is the one-device property's)."""
    return FSDP1Options(auto_wrap=draw(st.booleans()), mixed_precision=draw(_one_of(HALF)) if half else None)


def plain_dp_cases(world_size: int) -> st.SearchStrategy[TrainCase]:
    return large_dp_cases(world_size, half=True)


def most_drawn(world_size: int) -> list[tuple[int, int, int]]:
    """The 3-D meshes drawn most: (1, 2, 2) and (2, 1, 2) on 4 ranks, (2, 2, 2) on 8."""
    drawn = hsdp_meshes(world_size)
    return [m for m in dict.fromkeys(drawn) if drawn.count(m) == drawn.count(drawn[0])]


def every_form(strategies: dict) -> list[dict]:
    """The MLP's simplest case in every form, on the 3-D meshes drawn most (both (1, 2, 2) and
    (2, 1, 2) on 4 ranks, so that each dp dimension is real in one) and the first 2-D mesh:
    FSDP1 with each hybrid strategy and each ZeRO stage (FULL_SHARD, which the other
    properties draw, by units: auto_wrap_policy), fully_shard on the 2-D DP mesh and with each
    form of dp_mesh_dims (the loss reduced each way in turn; sharding on dim 1 too), FSDP2's
    replicate with dp_mesh_dims. The drawn cases meet each form a few times, the MLP's once or never."""
    found = {c.entry: c for c in every_entry(strategies, HSDP_ENTRIES)}
    if not found:
        return []
    world = math.prod(next(iter(found.values())).mesh_shape)
    first, two = most_drawn(world), weighted(meshes(world))[0]

    def on(entry, mesh, **form):
        return dataclasses.replace(found[entry], mesh_shape=mesh,
                                   **{"dp_mesh_dims": "", "fsdp1_strategy": "", "loss_reduction": ""} | form)

    forms = []
    if "fsdp1" in found:  # each hybrid strategy on the 3-D meshes, each ZeRO stage on the 2-D one
        forms += [on("fsdp1", m, fsdp1_strategy=s) for m in first for s in FSDP1_HYBRID]
        units = dataclasses.replace(found["fsdp1"].fsdp1, auto_wrap=True)  # FULL_SHARD, its default, by units
        forms += [on("fsdp1", two, fsdp1_strategy=s, **({"fsdp1": units} if s == "FULL_SHARD" else {}))
                  for s in FSDP1_FLAT]
    if "fully_shard" in found:
        forms += [on("fully_shard", m) for m in first]  # HSDP on the 2-D DP mesh
        # each form of dp_mesh_dims on each mesh, the loss reduced each way in turn
        spmd = [(m, f) for m in (*first, two) for f in SPMD_FORMS if f != "both" or len(m) == 3]
        forms += [on("fully_shard", m, dp_mesh_dims=f, loss_reduction=LOSS_REDUCTIONS[i % len(LOSS_REDUCTIONS)])
                  for i, (m, f) in enumerate(spmd)]
        # a dim 1 that splits evenly over the shard ranks, where FSDP shards
        wide = dataclasses.replace(found["fully_shard"].fsdp, shard_dim=1)
        forms += [dataclasses.replace(on("fully_shard", first[0], dp_mesh_dims=f), size=Size(dim=8, hidden=8),
                                      fsdp=wide) for f in ("", "shard", "both")]
    if "replicate_fsdp" in found:
        forms += [on("replicate_fsdp", m, dp_mesh_dims="replicate") for m in (*first, two)]
    return [{"case": c} for c in forms]


# ci draws 10 cases a training property and 4 a checkpoint one beside their cover cases: its
# 5 minutes hold no more (docs/performance.md, "The DP that large models train with")
@tpdp_property(min_world_size=4, cover=every_form, examples={"ci": 10}, case=large_dp_cases)
def large_dp_trains_like_one_device(pool, impl: str, case: TrainCase, explain=worth_explaining) -> None:
    """HSDP x TP on a 3-D mesh, and fully_shard over the whole SPMD mesh, train like the unsharded model on one device."""
    verdict_one_device(pool, impl, case, explain).raise_if_failed()


@tpdp_property(min_world_size=4, cover=every_form, examples={"ci": 10}, case=plain_dp_cases)
def large_dp_trains_like_plain_dp(pool, impl: str, case: TrainCase) -> None:
    """The same like HSDP without TP, and like the SPMD program without fully_shard, mixed precision included."""
    verdict_plain_ddp(pool, impl, case).raise_if_failed()


@st.composite
def checkpoint_cases(draw, world_size: int) -> TrainCase:
    """Cases to checkpoint: HSDP (fully_shard and FSDP1's hybrid strategies on a 3-D mesh), or
    fully_shard over the whole SPMD mesh in each form; the optimizer built after wrapping, the
    entry points' first options and no habits (the exclusion checkpoint_options_and_habits)."""
    view = draw(_one_of(VIEWS[:2]))
    mesh = draw(_one_of(hsdp_meshes(world_size) if view == "hsdp" else spmd_meshes(world_size)))
    model = draw(_one_of(TRAINED))
    entry = draw(_one_of(CHECKPOINTED)) if view == "hsdp" else "fully_shard"
    return TrainCase(model=model, size=draw(_sizes(model, mesh[-1])), mesh_shape=mesh, entry=entry,
                     fsdp1_strategy=draw(_one_of(FSDP1_HYBRID)) if entry == "fsdp1" else "",
                     dp_mesh_dims=draw(_one_of(SPMD_FORMS if len(mesh) == 3 else SPMD_FORMS[:2])) if view == "spmd" else "",
                     **run_fields(draw, entry, ("after_wrap",), FSDP2Options()))


CHECKPOINTED = ("fully_shard", "fsdp1")  # the entry points that take a 2-D DP mesh (REFUSED_ON_2D_DP_MESH aside)


def every_checkpoint(strategies: dict) -> list[dict]:
    """The MLP's simplest case through each entry point on the 3-D meshes drawn most, and
    fully_shard in each SPMD form on the first of them, by every route where one is drawn."""
    routes = ROUTES if "route" in strategies else (None,)
    found = every_entry(strategies, CHECKPOINTED)
    meshes_ = most_drawn(math.prod(found[0].mesh_shape)) if found else []
    cases = [dataclasses.replace(c, mesh_shape=m) for c in found for m in meshes_]
    cases += [dataclasses.replace(c, mesh_shape=meshes_[0], dp_mesh_dims=f)
              for c in found if c.entry == "fully_shard" for f in SPMD_FORMS]
    return [{"case": c} | ({"route": r} if r else {}) for c in cases for r in routes]


@tpdp_property(min_world_size=4, cover=every_checkpoint, examples={"ci": 4}, case=checkpoint_cases)
def large_dp_state_dict_like_unsharded(pool, impl: str, case: TrainCase, explain=worth_explaining) -> None:
    """HSDP x TP on a 3-D mesh, and fully_shard over the SPMD mesh: state_dict() before and after training has the unsharded model's keys, shapes and values."""
    verdict_state_dict(pool, impl, case, explain).raise_if_failed()


@tpdp_property(min_world_size=4, cover=every_checkpoint, examples={"ci": 4}, case=checkpoint_cases,
               route=st.sampled_from(ROUTES))
def large_dp_checkpoint_resumes(pool, impl: str, case: TrainCase, route: str, explain=worth_explaining) -> None:
    """HSDP x TP on a 3-D mesh, and fully_shard over the SPMD mesh: saved by each route and loaded into a fresh model, it steps exactly as the uninterrupted one."""
    verdict_resume(pool, impl, case, route, explain).raise_if_failed()
