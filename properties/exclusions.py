"""Regions of the case space that no property searches, each declared once, with its reason.

A property's strategy leaves a region out when a case there would only test a rule of the
entry point's own contract that holds with or without TP, when its training fails so that
there is nothing to checkpoint (the training properties search it), or when it would check
nothing. A hang or a rank that aborts is a finding, never a reason. Each ``Exclusion`` says
which properties leave it out, why, where the docs say so, and ``test``: a predicate over
the drawn case that is true exactly for the cases left out. The strategies build their
filters and choices from the data here (``properties/training.py``,
``properties/checkpoint.py``, ``properties/registry.py``, ``properties/fsdp_extension.py``);
``tests/test_exclusions.py`` checks that each region exists in the unfiltered space and
that the property's strategy never draws into it, and runs a case of each to show its
reason; the gate lists them (tpdp_verify.runner.suite).

Not listed: a split of one space between two properties that run the same checks
(``SOUND_TRAINING``, ``SOUND_CHECKPOINTS`` and the ``entry_points_*`` properties): the other property searches those cases.
"""

from __future__ import annotations

import functools

from tpdp_verify.cases.training import DDP_ENTRIES, FSDP2_ENTRIES, DDPOptions, FSDP2Options, Habits, TrainCase
from tpdp_verify.runner.suite import Exclusion

# --------------------------------------------------------------------------- the data


# (entry, when the optimizer is built) pairs an entry point's own contract rules out.
FSDP_BEFORE_WRAP = frozenset({("fully_shard", "before_wrap"), ("replicate_fsdp", "before_wrap")})
OUTSIDE_CONTRACT = FSDP_BEFORE_WRAP


def unsharded_after_forward(entry: str, fsdp) -> bool:
    """FSDP2 roots that keep their parameters unsharded after a forward: its replicate, and
    fully_shard told not to reshard after it."""
    return entry == "replicate_fsdp" or (entry == "fully_shard" and not fsdp.reshard_after_forward)


def needs_find_unused(model: str, static_graph: bool) -> bool:
    """DDP's contract: a parameter that gets no gradient (the ``unused`` model's spare
    branch) needs find_unused_parameters or a static graph."""
    return model == "unused" and not static_graph


# DDP's built-in comm hooks that run on gloo: bf16_compress_hook raises on the CPU ("requires
# CUDA 11+ and NCCL 2.10+"), and DDP's own _MixedPrecision needs CUDA events, with or without
# TP; neither is drawn (tpdp_verify.runner.coverage lists mixed_precision with that reason).
CPU_COMM_HOOKS = ("allreduce", "fp16_compress")


@functools.cache
def can_ignore(model: str) -> bool:
    """Whether the zoo model has a module a DP entry point can be told to ignore
    (tpdp_verify.ranks.loop.ignorable)."""
    from tpdp_verify.cases.training import Size
    from tpdp_verify.fixtures.zoo import ZOO
    from tpdp_verify.ranks.loop import ignorable

    return ignorable(ZOO[model].build(Size())) is not None


@functools.cache
def can_freeze(model: str) -> bool:
    """Whether the zoo model's loss keeps a gradient with that module frozen (the unused
    model's spare branch would be all that is left, and it gets none)."""
    import torch

    from tpdp_verify.cases.training import Size
    from tpdp_verify.fixtures.zoo import ZOO
    from tpdp_verify.ranks.loop import forward, ignorable

    fx = ZOO[model]
    net = fx.build(Size())
    part = ignorable(net)
    if part is None:
        return False
    part.requires_grad_(False)
    batch = fx.batch(torch.Generator().manual_seed(0), 2, Size())
    return fx.per_sample_loss(forward(net, net, batch), batch).requires_grad


# Where the DP entry points carry TP as documented, so that a correct transform trains
# exactly: the space of trains_like_one_device and trains_like_plain_ddp. The rest, where
# TP+DP departs with the reference transform as with torch's (docs/properties.md), is
# entry_points_train_like_one_device's: replicate with a mesh never trains; an optimizer
# built before wrapping holds the DTensors the transform swapped out; DDP's static graph
# with no_sync crashes without TP too; FSDP1 departs in several ways of its own making.
SOUND_TRAINING = dict(entries=("ddp_mesh", "transform_ddp", "fully_shard", "replicate_fsdp"),
                      built=("after_wrap", "after_forward"), static_graph=(False,), sound_only=True)


def sound(case: TrainCase) -> bool:
    return (case.entry in SOUND_TRAINING["entries"] and case.built in SOUND_TRAINING["built"]
            and case.ddp.static_graph in SOUND_TRAINING["static_graph"] and sound_habits(case.entry, case.habits))


# Habits that depart with the reference transform as with torch's, so they are the
# entry_points_ property's to search (docs/properties.md, "Training habits"):
# clip_grad_norm_ over the model's parameters sees the local shards DDP holds, or, under
# FSDP2, DTensors on two meshes (a plan that leaves some parameter unsharded by TP);
# activation checkpointing under DDP recomputes a block after the transform made its
# parameters local shards; a block called directly between steps meets those shards too
# (the transform's hooks are the root's: torch 2.13 passes only by its fault 1, which
# leaves the DTensors behind). Under FSDP the same call departs without TP: the exclusion
# direct_call_under_fsdp.
def sound_habits(entry: str, habits: Habits) -> bool:
    return habits.clip is None and not (entry in DDP_ENTRIES and (habits.checkpoint or habits.between == DIRECT))


def rounds_to_half(case) -> bool:
    """An option that rounds gradients or parameters to half precision by design."""
    return ((case.entry in DDP_ENTRIES and case.ddp.wire_dtype is not None)
            or (case.entry in FSDP2_ENTRIES and case.fsdp.wire_dtype is not None)
            or (case.entry == "fsdp1" and case.fsdp1.wire_dtype is not None))


def extended(case) -> bool:
    """The case sets a newer option of its entry point (beyond the first five DDP
    keywords) or a training habit."""
    first = DDPOptions(**{k: getattr(case.ddp, k) for k in ("bucket_cap_mb", "gradient_as_bucket_view",
                                                            "static_graph", "find_unused_parameters",
                                                            "sync_buffers")})
    return case.ddp != first or case.fsdp != FSDP2Options() or case.habits != Habits()


# Habits.between: the last block the step's forward ran, called directly (ranks/loop.py).
DIRECT = "submodule"


def direct_under_fsdp(case) -> bool:
    return case.entry not in DDP_ENTRIES and case.habits.between == DIRECT


def _no_parameters(case) -> bool:
    from tpdp_verify.cases.trees import count_params

    return count_params(case) == 0


# --------------------------------------------------------------------------- the declarations


TRAINING = ("trains_like_one_device", "trains_like_plain_ddp", "entry_points_train_like_one_device")
CHECKPOINTS = ("state_dict_like_unsharded", "entry_points_state_dict_like_unsharded",
               "checkpoint_resumes", "entry_points_checkpoint_resume")
# The properties of the DP that large models train with (properties/large_dp.py)
LARGE_DP = ("large_dp_trains_like_one_device", "large_dp_trains_like_plain_dp")
LARGE_DP_CHECKPOINTS = ("large_dp_state_dict_like_unsharded", "large_dp_checkpoint_resumes")
# The checkpoint properties that draw FSDP (entry_points_state_dict_like_unsharded draws replicate only).
FSDP_CHECKPOINTS = ("state_dict_like_unsharded", "checkpoint_resumes", "entry_points_checkpoint_resume")

FSDP_OPTIMIZER_BEFORE_WRAP = Exclusion(
    "fsdp_optimizer_before_wrap", TRAINING + CHECKPOINTS + LARGE_DP,
    "an optimizer built before FSDP2 (fully_shard or its replicate) wraps: FSDP2 replaces the "
    "parameters with sharded DTensors when it wraps, so the optimizer holds the old ones and "
    "moves nothing the model uses, with or without TP; its docs say to build the optimizer "
    "after wrapping (FSDP1 keeps the original parameters, and is drawn)",
    "docs/properties.md#trains_like_one_device",
    lambda case: (case.entry, case.built) in FSDP_BEFORE_WRAP)

FSDP2_OPTIMIZER_AFTER_FORWARD = Exclusion(
    "fsdp2_optimizer_after_forward", TRAINING + CHECKPOINTS + LARGE_DP,
    "an optimizer built after a first forward through FSDP2's replicate, or through fully_shard "
    "with reshard_after_forward=False: the root keeps its parameters unsharded after a forward, "
    "so the optimizer holds those and never moves the sharded ones; plain FSDP2 does the same "
    "(fully_shard resharding after the forward trains exactly, and is drawn)",
    "docs/properties.md#trains_like_one_device",
    lambda case: case.built == "after_forward" and unsharded_after_forward(case.entry, case.fsdp))

DDP_UNUSED_WITHOUT_FIND_UNUSED = Exclusion(
    "ddp_unused_without_find_unused", TRAINING + CHECKPOINTS + ("miswiring_refused_or_exact",),
    "DDP on the `unused` model without find_unused_parameters or a static graph: DDP requires "
    "one of them for a parameter that gets no gradient, with or without TP; a case there "
    "only tests DDP's error",
    "docs/properties.md#trains_like_one_device",
    lambda case: (case.entry in DDP_ENTRIES and needs_find_unused(case.model, case.ddp.static_graph)
                  and not case.ddp.find_unused_parameters))

CHECKPOINT_WITH_STATIC_GRAPH = Exclusion(
    "checkpoint_static_graph", CHECKPOINTS,
    "checkpoints of DDP with static_graph and more than one microbatch a step: DDP's static "
    "graph under no_sync fails an internal assert in its reducer, without TP too (DDP's own, "
    "the training properties' finding); nothing to checkpoint",
    "docs/properties.md#checkpoints",
    lambda case: case.ddp.static_graph and case.accumulate > 1)

FSDP1_CHECKPOINT_ONE_DP_RANK = Exclusion(
    "fsdp1_checkpoint_one_dp_rank", FSDP_CHECKPOINTS,
    "FSDP1 checkpoints on a mesh with dp 1: FSDP1 with TP fails in training there (DTensor's "
    "sharding propagation in summon_full_params), where FSDP1 alone trains; training's "
    "finding (entry_points_train_like_one_device), nothing to checkpoint",
    "docs/properties.md#fsdp1-findings-behind-the-property",
    lambda case: case.entry == "fsdp1" and case.dp < 2)

FSDP1_CHECKPOINT_ACCUMULATE = Exclusion(
    "fsdp1_checkpoint_accumulate", FSDP_CHECKPOINTS,
    "FSDP1 checkpoints with more than one microbatch a step: TP + FSDP1 fails in training "
    "under no_sync (an invalid storage in FSDP1's flat parameter), where FSDP1 alone trains; "
    "training's finding (entry_points_train_like_one_device), nothing to checkpoint",
    "docs/properties.md#fsdp1-findings-behind-the-property",
    lambda case: case.entry == "fsdp1" and case.accumulate != 1)

HALF_AGAINST_ONE_DEVICE = Exclusion(
    "half_precision_against_one_device", ("trains_like_one_device", "entry_points_train_like_one_device",
                                          "large_dp_trains_like_one_device"),
    "options that round to half precision by design (DDP's fp16 compression hook, FSDP2's "
    "MixedPrecisionPolicy, FSDP1's MixedPrecision) against one device in full precision: no bound derives from a run "
    "without them; trains_like_plain_ddp judges them against the same option without TP",
    "docs/tolerance.md#options-that-round-to-half-precision",
    rounds_to_half)

def _half_outside_the_sound_space(case) -> bool:
    return rounds_to_half(case) and not sound(case)


HALF_OUTSIDE_SOUND = Exclusion(
    "half_precision_outside_the_sound_space", TRAINING,
    "options that round to half precision (DDP's fp16 compression hook, FSDP2's "
    "MixedPrecisionPolicy) together with what the sound space leaves out (replicate, FSDP1, an "
    "optimizer built before wrapping, a static graph, clipping, activation checkpointing, a "
    "direct call): the one-device properties cannot judge the rounding "
    "(half_precision_against_one_device) and trains_like_plain_ddp draws the sound space only; "
    "not searched yet",
    "docs/tolerance.md#options-that-round-to-half-precision",
    _half_outside_the_sound_space)

DIRECT_CALL_UNDER_FSDP = Exclusion(
    "direct_call_under_fsdp", TRAINING + LARGE_DP,
    "a block called directly between steps under FSDP1, fully_shard or its replicate, which wrap "
    "the root only: between forwards the block's parameters are flat shards or dp-sharded "
    "DTensors, which only a wrapped module's forward gathers; it raises without TP too",
    "docs/properties.md#training-habits",
    direct_under_fsdp)

CHECKPOINT_OPTIONS = Exclusion(
    "checkpoint_options_and_habits", CHECKPOINTS + LARGE_DP_CHECKPOINTS,
    "checkpoints with the entry points' newer options or training habits set (comm hooks, "
    "bucket lists, init_sync, FSDP2's mixed precision and resharding, clipping, activation "
    "checkpointing, ignored modules): what they change is training's, which the training "
    "properties search; a checkpoint holds the state they produce either way",
    "docs/properties.md#checkpoints",
    extended)

TREES_WITHOUT_PARAMETERS = Exclusion(
    "trees_without_parameters", ("paths_resolve", "ignored_params_untouched"),
    "module trees with no parameter: no name to resolve, no slot to replace and nothing to "
    "ignore (registry_preserved draws them)",
    "docs/properties.md#paths_resolve",
    _no_parameters)

def smooths_under_loss_parallel(loss) -> bool:
    """A loss with cross entropy's label smoothing, under loss_parallel()."""
    return loss is not None and loss.parallel and loss.label_smoothing > 0


LABEL_SMOOTHING_UNDER_LOSS_PARALLEL = Exclusion(
    "label_smoothing_under_loss_parallel", ("losses_train_like_one_device",),
    "cross entropy's label_smoothing under loss_parallel(): torch's docs say it is not supported "
    "(loss_parallel's docstring: \"Currently not supported\"), and it raises mixing a plain tensor "
    "with the sharded logits; drawn without loss_parallel",
    "docs/properties.md#losses_train_like_one_device",
    lambda case: smooths_under_loss_parallel(case.loss))

def mean_refused_under_loss_parallel(loss) -> bool:
    """A mean of cross entropy or nll_loss under loss_parallel() over the SPMD form's mesh
    (its batch loss, ``Loss.over``): a mesh of two or more dims."""
    return (loss is not None and loss.parallel and loss.over == "batch" and loss.reduction == "mean"
            and loss.kind in ("cross_entropy", "z_loss", "expected_cost", "nll"))


MEAN_UNDER_LOSS_PARALLEL_ON_A_2D_MESH = Exclusion(
    "mean_under_loss_parallel_on_a_2d_mesh", ("losses_train_like_one_device",),
    "a mean of cross entropy or nll_loss under loss_parallel() on the SPMD form's mesh (two or more "
    "dims): torch's docs say it is not supported (loss_parallel's docstring: \"only supported on a "
    "one-dimensional DeviceMesh\", use a sum and divide by the global count) and it raises "
    "NotImplementedError; drawn as a sum",
    "docs/properties.md#losses_train_like_one_device",
    lambda case: mean_refused_under_loss_parallel(case.loss))

LOSS_OPTIONS = Exclusion(
    "losses_with_options_and_habits", ("losses_train_like_one_device",),
    "a drawn loss with the entry points' newer options or training habits set (comm hooks, "
    "bucket lists, init_sync, FSDP2's resharding, ignored modules, eval forwards between steps): "
    "what they change is training's, which the training properties search with each model's "
    "own loss; the loss's path through torch is the same with them, and with them its regions "
    "would hold every entry point's faults",
    "docs/properties.md#losses_train_like_one_device",
    extended)

LOSS_THROUGH_DEPARTING = Exclusion(
    "losses_through_replicate_and_fsdp1", ("losses_train_like_one_device",),
    "a drawn loss through replicate or FSDP1: with TP both depart on the models with a "
    "vocabulary head whatever the loss (replicate loses the TP parameters' gradients, FSDP1 "
    "raises in its forward or its summon_full_params), so a loss's own fault there would be "
    "filed under theirs; entry_points_train_like_one_device searches them with each model's own loss",
    "docs/properties.md#losses_train_like_one_device",
    lambda case: case.loss is not None and case.entry in ("replicate", "fsdp1"))

def fused_part_of_one_row(case) -> bool:
    """A fused projection whose parts are one row each, of more than one column."""
    return case.rows == 1 and case.cols > 1


FUSED_PARTS_OF_ONE_ROW = Exclusion(
    "fused_parts_of_one_row", ("fused_projections_read_back",),
    "a fused projection whose parts are one row each, of more than one column: DTensor refuses to "
    "flatten the weight viewed (parts, 1, cols) and sharded on its rows (RuntimeError 'This "
    "operation would remove or reshape sharded dimension ..., which requires redistribution'), so "
    "the public route builds no per-part layout to read back; parts of one row and one column are "
    "drawn (fault 37), and every other number of rows",
    "docs/properties.md#fused_projections_read_back",
    fused_part_of_one_row)

# Entry points that refuse a 2-D DP mesh (mesh["dp_replicate", "dp_shard"]) in one line.
REFUSED_ON_2D_DP_MESH = ("replicate_fsdp",)

REPLICATE_FSDP_ON_A_2D_DP_MESH = Exclusion(
    "replicate_fsdp_on_a_2d_dp_mesh", LARGE_DP,
    "FSDP2's replicate given the 2-D DP mesh of a 3-D (dp_replicate, dp_shard, tp) mesh: torch "
    "refuses it before wrapping, with or without TP ('replicate expects a 1D DeviceMesh'); a "
    "case there only tests that line",
    "docs/properties.md#the-dp-that-large-models-train-with",
    lambda case: case.entry in REFUSED_ON_2D_DP_MESH and len(case.dp_dims) == 2 and not case.dp_mesh_dims)

EXCLUSIONS = (
    FSDP_OPTIMIZER_BEFORE_WRAP, FSDP2_OPTIMIZER_AFTER_FORWARD, DDP_UNUSED_WITHOUT_FIND_UNUSED,
    CHECKPOINT_WITH_STATIC_GRAPH,
    FSDP1_CHECKPOINT_ONE_DP_RANK, FSDP1_CHECKPOINT_ACCUMULATE,
    TREES_WITHOUT_PARAMETERS, HALF_AGAINST_ONE_DEVICE,
    HALF_OUTSIDE_SOUND, CHECKPOINT_OPTIONS, DIRECT_CALL_UNDER_FSDP, LABEL_SMOOTHING_UNDER_LOSS_PARALLEL,
    MEAN_UNDER_LOSS_PARALLEL_ON_A_2D_MESH, LOSS_OPTIONS, LOSS_THROUGH_DEPARTING, REPLICATE_FSDP_ON_A_2D_DP_MESH,
    FUSED_PARTS_OF_ONE_ROW,
)

# What checkpoint_cases keeps: training works, so there is something to checkpoint.
UNTRAINABLE = (CHECKPOINT_WITH_STATIC_GRAPH, FSDP1_CHECKPOINT_ONE_DP_RANK, FSDP1_CHECKPOINT_ACCUMULATE)
