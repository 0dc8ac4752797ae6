"""Gradient equality: TP+DP trains exactly like one device, and like plain DDP.

A drawn ``TrainCase`` picks a zoo model and size, a (dp, tp) factorization of the world,
a data-parallel entry point with its options, an optimizer and when it is built, the
steps and the dtype (float32, bfloat16, float16); the ranks train it and the oracles say
what training should have produced.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import hypothesis
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from tpdp_verify.cases.training import (
    BETWEEN,
    BUILT,
    CLIP_BY,
    DDP_ENTRIES,
    DTENSOR,
    ENTRIES,
    FSDP2_ENTRIES,
    HALF,
    IGNORED,
    NORM_TYPES,
    OPTIMIZERS,
    TRAIN_DTYPES,
    DDPOptions,
    FSDP1Options,
    FSDP2Options,
    Habits,
    Loss,
    Size,
    TrainCase,
    ddp_keywords,
)
from tpdp_verify.fixtures.zoo import DRAWN, TRAINED, ZOO
from tpdp_verify.oracles.verdicts import verdict_one_device, verdict_plain_ddp
from tpdp_verify.properties.exclusions import (
    CPU_COMM_HOOKS,
    DIRECT,
    OUTSIDE_CONTRACT,
    SOUND_TRAINING,
    can_freeze,
    can_ignore,
    needs_find_unused,
    sound,
    unsharded_after_forward,
)
from tpdp_verify.hypothesis_internals import without_local_constants
from tpdp_verify.runner.property import tpdp_property, worth_explaining

# 1e-6 MB is a few bytes: every gradient gets a bucket of its own, the most buckets DDP makes.
BUCKET_CAPS = (None, 1e-6, 1e-4)
# bucket_cap_mb_list: a cap per bucket, the last repeated; a first bucket of a few bytes
# then larger ones, and the reverse.
BUCKET_CAP_LISTS = (None, (1e-6, 1e-4), (1e-4, 1e-6))
# clip_grad_norm_'s max_norm: below every drawn model's gradient norm (always clips) and
# above it (computes the norm, leaves the gradients)
CLIPS = (None, 1e-2, 1e3)
# MLP's size where fully_shard fills every rank's shard of every parameter, up to 8 dp ranks
CLIP_SIZE = Size(dim=8, hidden=16)


def meshes(world_size: int) -> list[tuple[int, int]]:
    """Every (dp, tp) factorization, both dimensions real first: shrinking keeps a 2-D mesh."""
    shapes = [(d, world_size // d) for d in range(1, world_size + 1) if world_size % d == 0]
    return sorted(shapes, key=lambda s: (min(s) == 1, s[0]))


def weighted(shapes: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The meshes a training case draws from, as often as they matter: where the world size
    has meshes with both dimensions real (TP and DP composed: what the suite is for), four
    draws in five take one; else (2 ranks) three in four put the ranks on tp. The plain DP
    and the plain TP meshes stay in, each a region of its own. Order kept: shrinking still
    goes to the first."""
    both = [s for s in shapes if min(s) > 1]
    edge = [s for s in shapes if min(s) == 1]
    if both:
        return tuple(s for s in both for _ in range(4 * len(edge))) + tuple(edge)
    return tuple(s for s in edge for _ in range(3 if s[1] > 1 else 1))


# Optimizer timings a DP entry point's own contract rules out, with or without TP
# (OUTSIDE_CONTRACT and unsharded_after_forward: the exclusions fsdp_optimizer_before_wrap
# and fsdp2_optimizer_after_forward, properties/exclusions.py). DDP makes no such demand
# of its users: for DDP these timings are drawn.



def _timings(entry: str, built: tuple[str, ...], fsdp: FSDP2Options = FSDP2Options()) -> list[str]:
    return [b for b in built if (entry, b) not in OUTSIDE_CONTRACT
            and not (b == "after_forward" and unsharded_after_forward(entry, fsdp))]


@st.composite
def ddp_options(draw, model: str, static_graph: tuple[bool, ...] = (False, True), options: bool = True,
                half: bool = False) -> DDPOptions:
    """DDP's keywords; with ``options``, those this torch's DDP takes beyond the first five
    and a built-in comm hook; with ``half``, the hook that compresses to float16 too (the
    exclusion half_precision_against_one_device)."""
    static = draw(st.sampled_from(static_graph))
    # The exclusion ddp_unused_without_find_unused (DDP's own contract).
    unused = draw(st.booleans()) or needs_find_unused(model, static)
    base = DDPOptions(
        bucket_cap_mb=draw(st.sampled_from(BUCKET_CAPS)),
        gradient_as_bucket_view=draw(st.booleans()),
        static_graph=static,
        find_unused_parameters=unused,
        sync_buffers=draw(st.booleans()),
    )
    if not options:
        return base
    takes = ddp_keywords()
    newer = {"init_sync": st.booleans(), "skip_all_reduce_unused_params": st.booleans(),
             "bucket_cap_mb_list": st.sampled_from(BUCKET_CAP_LISTS), "batched_grad_copy": st.booleans()}
    hooks = tuple(h for h in CPU_COMM_HOOKS if half or h != "fp16_compress")
    hook = draw(st.sampled_from(hooks)) if draw(st.booleans()) else None  # two draws: no value in a list's middle
    return dataclasses.replace(base, comm_hook=hook,
                               **{k: draw(v) for k, v in newer.items() if k in takes})


@st.composite
def fsdp2_options(draw, half: bool = False) -> FSDP2Options:
    """With ``half`` (trains_like_plain_ddp), always mixed precision, in either half dtype:
    FSDP2 in full precision is trains_like_one_device's, and 40 draws must meet both dtypes."""
    return FSDP2Options(reshard_after_forward=draw(st.booleans()),
                        mixed_precision=draw(st.sampled_from(HALF)) if half else None)


@st.composite
def habits(draw, model: str, entry: str, sound: bool = False) -> Habits:
    """What users do around the wrapper; a module to ignore only where the model has one
    to spare (tpdp_verify.ranks.loop.ignorable). ``sound``: only habits ``sound_habits``
    keeps, drawn directly (a filter would reject most draws)."""
    between = tuple(b for b in BETWEEN if b != DIRECT or (entry in DDP_ENTRIES and not sound))
    clip = None if sound else draw(st.sampled_from(CLIPS))
    return Habits(clip=clip, checkpoint=draw(st.booleans()) and not (sound and entry in DDP_ENTRIES),
                  between=draw(_one_of(between)), set_to_none=draw(st.booleans()),
                  ignored=draw(_ignored(model)),
                  clip_by=CLIP_BY[0] if clip is None else draw(_one_of(clip_ways())))


@functools.cache
def clip_ways() -> tuple[str, ...]:
    """The ways to clip this torch has (get_total_norm since 2.6)."""
    import torch

    return tuple(w for w in CLIP_BY if w == CLIP_BY[0] or hasattr(torch.nn.utils, w))


# A case draws from strategies built once per argument: hypothesis validates each new
# strategy object on its first draw, which made up a third of drawing a case.
@functools.cache
def _one_of(values: tuple) -> st.SearchStrategy:
    return st.sampled_from(values)


@functools.cache
def _sizes(model: str, tp: int) -> st.SearchStrategy:
    return ZOO[model].sizes(tp)


_ddp_options = functools.cache(ddp_options)
_fsdp2_options = functools.cache(fsdp2_options)
_habits = functools.cache(habits)


@functools.cache
def _ignored(model: str) -> st.SearchStrategy[str]:
    """How the model's first child is left out of DP: not at all, frozen (where the rest
    still trains: can_freeze), or trained with the user averaging it; two draws, since
    hypothesis favours the ends of a list."""
    kinds = tuple(k for k in IGNORED if k != "frozen" or can_freeze(model)) if can_ignore(model) else ()
    return st.booleans().flatmap(lambda on: st.sampled_from(kinds) if on and kinds else st.just(""))


@st.composite
def train_cases(draw, world_size: int, entries: tuple[str, ...] = ENTRIES,
                built: tuple[str, ...] = BUILT, static_graph: tuple[bool, ...] = (False, True),
                models: tuple[str, ...] = TRAINED, mesh_shapes: tuple[tuple[int, int], ...] | None = None,
                options: bool = True, half: bool = False, sound_only: bool = False) -> TrainCase:
    """Training cases on ``world_size`` ranks; the keywords narrow the space (tests, bench).
    ``options``: draw the entry points' newer options and the training habits (else each at
    its default); ``half``: options that round to half precision by design too;
    ``sound_only``: habits ``sound_habits`` keeps only."""
    mesh = draw(_one_of(tuple(mesh_shapes or weighted(meshes(world_size)))))
    model = draw(_one_of(tuple(models)))
    entry = draw(_one_of(tuple(e for e in entries if _timings(e, built))))
    size = draw(_sizes(model, mesh[1]))
    ddp = draw(_ddp_options(model, tuple(static_graph), options, half)) if entry in DDP_ENTRIES else DDPOptions()
    fsdp = draw(_fsdp2_options(half)) if entry in FSDP2_ENTRIES and options else FSDP2Options()
    return TrainCase(
        model=model,
        size=size,
        mesh_shape=mesh,
        entry=entry,
        ddp=ddp,
        fsdp=fsdp,
        habits=draw(_habits(model, entry, sound_only)) if options else Habits(),
        **run_fields(draw, entry, built, fsdp),
    )


def run_fields(draw, entry: str, built: tuple[str, ...], fsdp: FSDP2Options) -> dict:
    """A training case's run, drawn in this order (a draw is a sequence of choices): the
    optimizer and when it is built, an eval forward first, steps, microbatches, rows, seed, dtype."""
    return dict(
        optimizer=draw(_one_of(OPTIMIZERS)),
        built=draw(_one_of(tuple(_timings(entry, built, fsdp)))),
        eval_first=draw(st.booleans()),
        steps=draw(st.integers(1, 3)),
        accumulate=draw(st.integers(1, 2)),
        local_batch=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
        dtype=draw(st.sampled_from(TRAIN_DTYPES)),
    )


_FIND = settings(database=None, derandomize=True, max_examples=500, phases=[Phase.generate, Phase.shrink],
                 suppress_health_check=list(HealthCheck))
# A model through one entry point is rarer: 500 examples miss FSDP1's MLP among the checkpoint cases
_FIND_THROUGH = settings(_FIND, max_examples=2000)


_simplest_cases: dict[tuple[str, str], TrainCase | None] = {}

# The suite's own cover cases, found once and shipped: finding them takes a second a model
# and a case space, half a minute of every ci gate, while the ranks wait. Valid for the
# hypothesis that found them (a test checks the version and that each rebuilds); regenerate
# with ``python -m tpdp_verify.properties``.
FOUND = Path(__file__).with_name("cover_cases.json")


@functools.cache
def _shipped() -> dict[str, dict[str, str | None]]:
    try:
        doc = json.loads(FOUND.read_text())
    except (OSError, ValueError):
        return {}
    return doc["cases"] if doc.get("hypothesis") == hypothesis.__version__ else {}


def _label(model: str, entry: str | None) -> str:
    """How FOUND names a cover case: its model, and the entry point it was found through."""
    return model if entry is None else f"{model} through {entry}"


def _simplest(strategy: st.SearchStrategy[TrainCase], model: str, shipped: bool = True,
              entry: str | None = None) -> TrainCase | None:
    """Cached by the strategy's repr, which writes out the composite's arguments and its
    filters: properties that draw from one space share the search (a second a model).
    With ``entry``, the simplest case of the model through that DP entry point."""
    label = _label(model, entry)
    key = (repr(strategy), label)
    if key not in _simplest_cases:
        found = _shipped().get(key[0], {}) if shipped else {}
        if label in found:
            _simplest_cases[key] = None if found[label] is None else eval(  # noqa: S307: the file's own reprs
                found[label], {"TrainCase": TrainCase, "Size": Size, "DDPOptions": DDPOptions,
                               "FSDP1Options": FSDP1Options, "FSDP2Options": FSDP2Options, "Habits": Habits,
                               "Loss": Loss})
        else:
            try:
                with without_local_constants():  # the same cases whatever the process imported
                    _simplest_cases[key] = find(strategy, lambda c: c.model == model and entry in (None, c.entry),
                                                settings=_FIND if entry is None else _FIND_THROUGH)
            except NoSuchExample:
                _simplest_cases[key] = None
    return _simplest_cases[key]


def cover_spaces(properties) -> list[st.SearchStrategy[TrainCase]]:
    """The case spaces of the properties with cover cases, at the profiles' world sizes."""
    from tpdp_verify.runner.profiles import PROFILES

    sizes = sorted({w for p in PROFILES.values() for w in p.world_sizes})
    spaces = {repr(s): s for p in properties if p.cover for w in sizes if w >= p.min_world_size
              for s in [p.strategies["case"](w)]}
    return list(spaces.values())


def find_cover_cases(properties, shipped: bool = False) -> dict[str, dict[str, str | None]]:
    """Every cover case of the properties, as FOUND holds them (``shipped``: read them from it)."""
    labels = [(m, None) for m in DRAWN] + [("mlp", e) for e in ENTRIES]
    return {repr(s): {_label(m, e): None if (c := _simplest(s, m, shipped, e)) is None else repr(c) for m, e in labels}
            for s in cover_spaces(properties)}


def every_entry(strategies: dict, entries: tuple[str, ...] = ENTRIES, model: str = "mlp") -> list[TrainCase]:
    """The simplest case of ``model`` through each of ``entries`` the case strategy reaches."""
    found = (_simplest(strategies["case"], model, entry=e) for e in entries)
    return [c for c in found if c is not None]


def every_model(strategies: dict) -> list[dict]:
    """The simplest case of every zoo model the case strategy reaches, run before any drawn
    one: 40 drawn cases can miss a model (the frozen layer, the unused branch) entirely."""
    found = (_simplest(strategies["case"], m) for m in DRAWN)
    return [{"case": c} for c in found if c is not None]


def every_clip(strategies: dict) -> list[dict]:
    """Every model's simplest case, then MLP's through DDP and each FSDP2 entry point
    clipping each way this torch has, by each norm (NORM_TYPES): the drawn cases clip
    through FSDP2 a few times, and always by the 2-norm (a drawn norm would move the fixed
    draws the shipped memo answers). Through fully_shard on a mesh of dp alone too, with
    every rank's shard of every parameter filled (CLIP_SIZE; an empty one raises, fault
    29): on the (1, tp) mesh DTensor gathers a TP-sharded gradient whole to take its norm,
    so only FSDP2's shards over dp ranks make it reduce the shards' norms across ranks."""
    through = every_entry(strategies, ("ddp_mesh", *FSDP2_ENTRIES))
    through += [dataclasses.replace(c, mesh_shape=(c.mesh_shape[0] * c.mesh_shape[1], 1), size=CLIP_SIZE)
                for c in through if c.entry == "fully_shard"]
    return every_model(strategies) + [
        {"case": dataclasses.replace(c, habits=Habits(clip=CLIPS[1], clip_by=way, norm_type=p))}
        for c in through for way in clip_ways() for p in NORM_TYPES]


def every_habit(strategies: dict) -> list[dict]:
    """every_clip's cases; activation checkpointing under FSDP1, which the draw meets only
    where torch 2.13 fails already (issue 52); and the buffers model (whose sizes are the
    MLP's) with its buffers held as DTensors (Habits.buffers) through DDP (which refuses
    them, fault 33), FSDP1 and both FSDP2 entry points. Not drawn: a habit drawn for one
    model would move the fixed draws of every training property, whose answers the shipped
    memo holds. The entry points are every_clip's and FSDP1: each other one is a search of
    its own wherever a narrowed space lacks it (a test's). And the buffers model in the SPMD
    form with its buffers sharded over tp (Habits.buffers "sharded"), run by DTensor's own
    program with no wrapper, 2 dp ranks: FSDP2 over the SPMD mesh departs in every gradient
    on torch 2.13 (fault 17), which would hide it; a model holding local activations beside
    its buffers (every other entry point) cannot read a shard of them. Last, the MLP's SPMD
    batches that do not divide over the dp ranks (uneven_batches)."""
    through = every_entry(strategies, ("ddp_mesh", "fsdp1", *FSDP2_ENTRIES))
    covers = [dataclasses.replace(c, habits=Habits(checkpoint=True)) for c in through if c.entry == "fsdp1"]
    covers += [dataclasses.replace(c, model="buffers", habits=Habits(buffers="dtensor")) for c in through]
    covers += [dataclasses.replace(c, model="buffers", entry=DTENSOR, dp_mesh_dims="replicate",
                                   mesh_shape=(2, math.prod(c.mesh_shape) // 2), habits=Habits(buffers="sharded"))
               for c in through if c.entry == "fully_shard" and math.prod(c.mesh_shape) >= 4]
    covers += uneven_batches([c for c in through if c.entry == "fully_shard"])
    covers += fused_through_every_entry(every_entry(strategies))
    return every_clip(strategies) + [{"case": c} for c in covers]


def fused_through_every_entry(found: list[TrainCase]) -> list[TrainCase]:
    """The zoo's fused model (gate and up one Linear, sharded per part over tp: each rank a
    block of each part, ``_StridedShard``) through the entry point of each of ``found``, at
    its world size: on a mesh of 2 dp ranks where there are 4 ranks or more (FSDP2's dp
    shard over a per-part tp shard, fault 36), else on (1, 2). hidden is two rows a tp rank
    a part, for RowwiseParallel's local hand-off. A cover model (zoo.COVER_ONLY): drawn, it
    would move every fixed draw of the training properties."""
    out = []
    for c in found:
        world = math.prod(c.mesh_shape)
        mesh = (2, world // 2) if world >= 4 else (1, world)
        case = TrainCase(model="fused", size=Size(dim=2, hidden=2 * mesh[-1]), mesh_shape=mesh, entry=c.entry)
        out += [case] if case not in out else []
    return out


# Rows short of an even SPMD batch (TrainCase.batch_short) of 2 a dp rank over 2 x 2 dp ranks:
# none (the even batch, beside them); 5 rows as (2, 1, 1, 1), chunks of chunks; 3 as (1, 1, 1, 0),
# a dp rank with none
SHORT = (0, 3, 5)


def uneven_batches(found: list[TrainCase]) -> list[TrainCase]:
    """The MLP's SPMD form through DTensor's own program (no wrapper: FSDP2 over the SPMD mesh
    departs in every gradient on torch 2.13, fault 17, which would hide it) with a global batch
    that does not divide over the dp ranks, the loss each rank's mean and the sum: over one dp
    dim (2, the rest tp), and over two on a (2, 2, tp) mesh whose flattened dp submesh the
    ranks build as a trainer does (a rank's rows a chunk of a chunk; the even batch beside).
    Models whose layers see a sequence dim are not run so: DTensor refuses to flatten a batch
    dim that does not divide over its mesh dim (docs/properties.md, "Uneven batches")."""
    out = []
    for c in found:
        world = math.prod(c.mesh_shape)
        shorts = {(2, world // 2): (1,)} | ({(2, 2, world // 4): SHORT} if world >= 4 else {})
        out += [dataclasses.replace(c, model="mlp", entry=DTENSOR, dp_mesh_dims="replicate", mesh_shape=mesh,
                                    local_batch=2, batch_short=short, loss_reduction=reduction, fsdp=FSDP2Options(),
                                    habits=Habits())
                for mesh, rows in shorts.items() for short in rows for reduction in ("", "sum")]
    return out


def every_reduction(strategies: dict) -> list[dict]:
    """Every model's simplest case, then each sequence-parallel model's through each FSDP2
    entry point under a mixed-precision policy, with a step's gradients and with gradients
    accumulated over two microbatches: TP sums its norms' partial gradients, in the
    policy's reduce_dtype by FSDP2's contract (tpdp_verify.judging.reductions), on two paths
    through FSDP2. The same on a mesh of dp alone: FSDP2's own reduction over dp, in
    reduce_dtype too, where a dp of 1 sums nothing. Last, MLP's through DDP with each hook
    that compresses the wire: the drawn cases with one build their optimizer after the
    first forward, where torch's transform departs on every value (fault 1), so a
    regression of the hook would hide there; built after wrapping, only the registry check
    departs on torch 2.13.0 and every value is judged (issue 52)."""
    found = [c for c in (_simplest(strategies["case"], m) for m in ("llama_sp", "llama_lm")) if c is not None]
    policy = FSDP2Options(mixed_precision=HALF[0])
    over_dp = [dataclasses.replace(c, mesh_shape=(c.mesh_shape[0] * c.mesh_shape[1], 1)) for c in found]
    hooks = [h for h in CPU_COMM_HOOKS if h.endswith("_compress")]
    return every_model(strategies) + [
        {"case": dataclasses.replace(c, entry=e, ddp=DDPOptions(), fsdp=policy, habits=Habits(), built="after_wrap",
                                     accumulate=a)}
        for c in found + over_dp for e in FSDP2_ENTRIES for a in (1, 2)] + [
        {"case": dataclasses.replace(c, ddp=dataclasses.replace(c.ddp, comm_hook=h))}
        for c in every_entry(strategies, ("ddp_mesh",)) for h in hooks]


def sound_cases(world_size: int, half: bool = False) -> st.SearchStrategy[TrainCase]:
    return train_cases(world_size, half=half, **SOUND_TRAINING)


def sound_cases_with_half(world_size: int) -> st.SearchStrategy[TrainCase]:
    return sound_cases(world_size, half=True)


def unsound_cases(world_size: int) -> st.SearchStrategy[TrainCase]:
    return train_cases(world_size).filter(lambda c: not sound(c))


@tpdp_property(min_world_size=2, cover=every_model, case=sound_cases)
def trains_like_one_device(pool, impl: str, case: TrainCase, explain=worth_explaining) -> None:
    """TP+DP over K steps matches the unsharded model on one device: outputs, gradients, parameters, optimizer state."""
    verdict_one_device(pool, impl, case, explain).raise_if_failed()


@tpdp_property(min_world_size=2, cover=every_habit, case=unsound_cases)
def entry_points_train_like_one_device(pool, impl: str, case: TrainCase, explain=worth_explaining) -> None:
    """The same, where torch's entry points depart whatever the transform: replicate, FSDP1, early optimizers, static graphs, the habits DDP breaks."""
    verdict_one_device(pool, impl, case, explain).raise_if_failed()


@tpdp_property(min_world_size=2, cover=every_reduction, case=sound_cases_with_half)
def trains_like_plain_ddp(pool, impl: str, case: TrainCase) -> None:
    """TP+DP matches plain DDP (no TP) over the same dp groups, within the bound plain DDP earns."""
    verdict_plain_ddp(pool, impl, case).raise_if_failed()
