"""Regions of the case space that no property searches, each declared once, with its reason.

A property's strategy leaves a region out when a case there would give no verdict (a hang,
a crash that aborts a rank), would only test a rule of the entry point's own contract that
holds with or without TP, or would check nothing. Each ``Exclusion`` says which properties
leave it out, why, where the docs say so, and ``test``: a predicate over the drawn case
that is true exactly for the cases left out. The strategies build their filters and
choices from the data here (``properties/training.py``, ``properties/checkpoint.py``,
``properties/registry.py``, ``properties/fsdp_extension.py``), and
``tests/test_exclusions.py`` checks that each region exists in the unfiltered space and
that the property's strategy never draws into it; the gate lists them (tpdp_verify.runner.suite).

Not listed: a split of one space between two properties that run the same checks
(``SOUND_TRAINING``, ``SOUND_CHECKPOINTS`` and the ``entry_points_*`` properties): the other property searches those cases.
"""

from __future__ import annotations

import functools

from tpdp_verify.cases.training import DDP_ENTRIES, FSDP2_ENTRIES, DDPOptions, FSDP2Options, Habits, empty_shard
from tpdp_verify.runner.suite import Exclusion

# --------------------------------------------------------------------------- the data


def empty_width(size, tp: int) -> bool:
    """Whether a width TP shards in every zoo model (dim, hidden) leaves a tp rank no row."""
    return any(empty_shard(n, tp) for n in (size.dim, size.hidden))


# (entry, when the optimizer is built) pairs an entry point's own contract rules out.
FSDP_BEFORE_WRAP = frozenset({("fsdp1", "before_wrap"), ("fully_shard", "before_wrap"),
                              ("replicate_fsdp", "before_wrap")})
FSDP2_AFTER_FORWARD = frozenset({("fully_shard", "after_forward"), ("replicate_fsdp", "after_forward")})
OUTSIDE_CONTRACT = FSDP_BEFORE_WRAP | FSDP2_AFTER_FORWARD


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


def rounds_to_half(case) -> bool:
    """An option that rounds gradients or parameters to half precision by design."""
    return ((case.entry in DDP_ENTRIES and case.ddp.wire_dtype is not None)
            or (case.entry in FSDP2_ENTRIES and case.fsdp.wire_dtype is not None))


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


# The zoo models whose vocab TP shards (an embedding, a vocab-sharded head).
VOCAB_MODELS = ("llama_lm", "tied")

# Checkpoints draw the optimizer built after wrapping and no static graph only.
CHECKPOINT_BUILT = ("after_wrap",)
CHECKPOINT_STATIC_GRAPH = (False,)

# The zoo models FSDP1 trains with TP at all (tests/test_training.py).
FSDP1_MODELS = ("mlp", "nested", "llama", "llama_lm", "uneven", "buffers")


def uneven(case) -> bool:
    """Some width TP may shard (dim, hidden, vocab) does not divide by tp."""
    return any(n % case.tp for n in (case.size.dim, case.size.hidden, case.size.vocab))


# chunk_tensor is drawn on (dp, tp) root meshes only.
CHUNK_TENSOR_MESH_DIMS = (2,)


def _no_parameters(case) -> bool:
    from tpdp_verify.cases.trees import count_params

    return count_params(case) == 0


# --------------------------------------------------------------------------- the declarations


TRAINING = ("trains_like_one_device", "trains_like_plain_ddp", "entry_points_train_like_one_device")
CHECKPOINTS = ("state_dict_like_unsharded", "entry_points_state_dict_like_unsharded",
               "checkpoint_resumes", "entry_points_checkpoint_resume")
# The checkpoint properties that draw FSDP (entry_points_state_dict_like_unsharded draws replicate only).
FSDP_CHECKPOINTS = ("state_dict_like_unsharded", "checkpoint_resumes", "entry_points_checkpoint_resume")

FSDP_OPTIMIZER_BEFORE_WRAP = Exclusion(
    "fsdp_optimizer_before_wrap", TRAINING,
    "an optimizer built before FSDP1 or FSDP2 (fully_shard or its replicate) wraps: both replace "
    "the parameters when they wrap, and both versions' docs say to build the optimizer after "
    "wrapping (with or without TP)",
    "docs/properties.md#trains_like_one_device",
    lambda case: (case.entry, case.built) in FSDP_BEFORE_WRAP)

FSDP2_OPTIMIZER_AFTER_FORWARD = Exclusion(
    "fsdp2_optimizer_after_forward", TRAINING,
    "an optimizer built after a first forward through FSDP2 (fully_shard or its replicate): the "
    "root keeps its parameters unsharded after a forward, so the optimizer would hold those and "
    "never move the sharded ones; plain FSDP2 does the same",
    "docs/properties.md#trains_like_one_device",
    lambda case: (case.entry, case.built) in FSDP2_AFTER_FORWARD)

DDP_UNUSED_WITHOUT_FIND_UNUSED = Exclusion(
    "ddp_unused_without_find_unused", TRAINING + CHECKPOINTS,
    "DDP on the `unused` model without find_unused_parameters or a static graph: DDP requires "
    "one of them for a parameter that gets no gradient, with or without TP; a case there "
    "only tests DDP's error",
    "docs/properties.md#trains_like_one_device",
    lambda case: (case.entry in DDP_ENTRIES and needs_find_unused(case.model, case.ddp.static_graph)
                  and not case.ddp.find_unused_parameters))

FSDP_EMPTY_SHARD = Exclusion(
    "fsdp_empty_shard", TRAINING + FSDP_CHECKPOINTS,
    "FSDP1 or FSDP2 with a dim or hidden width that leaves a tp rank an empty shard: FSDP2 "
    "hangs (ranks holding rows wait in a collective the others never enter) and FSDP1 cannot "
    "write back; a hang gives no verdict and cannot be shrunk",
    "docs/properties.md#fsdp1-findings-behind-the-property",
    lambda case: case.entry not in DDP_ENTRIES and empty_width(case.size, case.tp))

VOCAB_EMPTY_SHARD = Exclusion(
    "vocab_empty_shard", TRAINING + CHECKPOINTS,
    "a vocab that leaves a tp rank no rows (llama_lm, tied; fixtures/zoo.py): an embedding or a "
    "loss_parallel cross entropy on that rank raises alone while the others wait in a "
    "collective: a hang, not a divergence",
    "docs/properties.md#trains_like_one_device",
    lambda case: case.model in VOCAB_MODELS and empty_shard(case.size.vocab, case.tp))

CHECKPOINT_OPTIMIZER_TIMING = Exclusion(
    "checkpoint_optimizer_timing", CHECKPOINTS,
    "checkpoints of an optimizer built before wrapping or after a first forward: its timing is "
    "the training properties' matter, and the resumed model builds its own after wrapping",
    "docs/properties.md#checkpoints",
    lambda case: case.built not in CHECKPOINT_BUILT)

CHECKPOINT_WITH_STATIC_GRAPH = Exclusion(
    "checkpoint_static_graph", CHECKPOINTS,
    "checkpoints of DDP with static_graph: DDP's static graph with no_sync crashes, "
    "without TP too (DDP's own)",
    "docs/properties.md#checkpoints",
    lambda case: case.ddp.static_graph not in CHECKPOINT_STATIC_GRAPH)

FSDP1_CHECKPOINT_ONE_DP_RANK = Exclusion(
    "fsdp1_checkpoint_one_dp_rank", FSDP_CHECKPOINTS,
    "FSDP1 checkpoints on a mesh with dp 1: FSDP1 with TP trains only with dp > 1 "
    "(it cannot write back, e.g. a sequence-parallel block on (1, 2)); training's finding, "
    "nothing to checkpoint",
    "docs/properties.md#fsdp1-findings-behind-the-property",
    lambda case: case.entry == "fsdp1" and case.dp < 2)

FSDP1_CHECKPOINT_ACCUMULATE = Exclusion(
    "fsdp1_checkpoint_accumulate", FSDP_CHECKPOINTS,
    "FSDP1 checkpoints with more than one microbatch a step: TP + FSDP1 cannot accumulate "
    "under no_sync (it raises, or hangs on some layouts); training's finding, nothing to checkpoint",
    "docs/properties.md#fsdp1-findings-behind-the-property",
    lambda case: case.entry == "fsdp1" and case.accumulate != 1)

FSDP1_CHECKPOINT_MODELS = Exclusion(
    "fsdp1_checkpoint_models", FSDP_CHECKPOINTS,
    "FSDP1 checkpoints of the tied, frozen, unused and llama_sp models: FSDP1 with TP does not "
    "train them (tied weights get wrong gradients, a frozen layer or an unused branch hangs or "
    "trains, a sequence-parallel block cannot write back); training's findings",
    "docs/properties.md#fsdp1-findings-behind-the-property",
    lambda case: case.entry == "fsdp1" and case.model not in FSDP1_MODELS)

FSDP1_CHECKPOINT_UNEVEN = Exclusion(
    "fsdp1_checkpoint_uneven", FSDP_CHECKPOINTS,
    "FSDP1 checkpoints with a TP-shardable width (dim, hidden, vocab) not divisible by tp: "
    "FSDP1's state dict of an unevenly sharded TP model aborts a rank (SIGABRT in gloo), which "
    "gives no verdict to shrink; chunk_tensor_metadata finds the cause (uneven pieces overlap)",
    "docs/properties.md#checkpoints",
    lambda case: case.entry == "fsdp1" and uneven(case))

HALF_AGAINST_ONE_DEVICE = Exclusion(
    "half_precision_against_one_device", ("trains_like_one_device", "entry_points_train_like_one_device"),
    "options that round to half precision by design (DDP's fp16 compression hook, FSDP2's "
    "MixedPrecisionPolicy) against one device in full precision: no bound derives from a run "
    "without them; trains_like_plain_ddp judges them against the same option without TP",
    "docs/tolerance.md#options-that-round-to-half-precision",
    rounds_to_half)

DIRECT_CALL_UNDER_FSDP = Exclusion(
    "direct_call_under_fsdp", TRAINING,
    "a block called directly between steps under FSDP1, fully_shard or its replicate, which wrap "
    "the root only: between forwards the block's parameters are flat shards or dp-sharded "
    "DTensors, which only a wrapped module's forward gathers; it raises without TP too",
    "docs/properties.md#training-habits",
    direct_under_fsdp)

CHECKPOINT_OPTIONS = Exclusion(
    "checkpoint_options_and_habits", CHECKPOINTS,
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

CHUNK_TENSOR_HSDP = Exclusion(
    "chunk_tensor_hsdp", ("chunk_tensor_metadata",),
    "chunk_tensor on a 3-D (HSDP) root mesh: FSDP1's sharded state dict passes a DTensor on "
    "the 1-D tp mesh with the dp group, and torch's chunk_tensor states it handles 1-D meshes only",
    "docs/properties.md#fsdp-extension-dtensorextensions",
    lambda case: len(case.mesh_shape) not in CHUNK_TENSOR_MESH_DIMS)

EXCLUSIONS = (
    FSDP_OPTIMIZER_BEFORE_WRAP, FSDP2_OPTIMIZER_AFTER_FORWARD, DDP_UNUSED_WITHOUT_FIND_UNUSED,
    FSDP_EMPTY_SHARD, VOCAB_EMPTY_SHARD, CHECKPOINT_OPTIMIZER_TIMING, CHECKPOINT_WITH_STATIC_GRAPH,
    FSDP1_CHECKPOINT_ONE_DP_RANK, FSDP1_CHECKPOINT_ACCUMULATE, FSDP1_CHECKPOINT_MODELS,
    FSDP1_CHECKPOINT_UNEVEN, TREES_WITHOUT_PARAMETERS, CHUNK_TENSOR_HSDP, HALF_AGAINST_ONE_DEVICE,
    CHECKPOINT_OPTIONS, DIRECT_CALL_UNDER_FSDP,
)

# What checkpoint_cases keeps of FSDP1: training works, so there is something to checkpoint.
FSDP1_UNTRAINABLE = (FSDP1_CHECKPOINT_ONE_DP_RANK, FSDP1_CHECKPOINT_ACCUMULATE, FSDP1_CHECKPOINT_MODELS,
                     FSDP1_CHECKPOINT_UNEVEN)
