"""The ci profile reaches every dimension of the training case space: each entry point,
each option and each habit is drawn, counted per value, by the draw the gate itself makes.

The draw is the gate's own: the properties run under the ci profile with a recorder in
place of the ranks (hypothesis seeds a derandomized search from the property's function,
which the recorder wraps), so the counts are what ``tpdp-verify gate --profile ci`` trains
on torch 2.13.0 with the shipped baseline, where every failure is known and the search
goes on as after a pass.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from types import SimpleNamespace

import pytest

from tpdp_verify.cases.training import BETWEEN, ENTRIES, HALF, IGNORED, MISWIRINGS, NORM_TYPES, ddp_keywords
from tpdp_verify.properties.exclusions import CPU_COMM_HOOKS
from tpdp_verify.properties.checkpoint import (
    checkpoint_resumes,
    entry_points_checkpoint_resume,
    entry_points_state_dict_like_unsharded,
    state_dict_like_unsharded,
)
from tpdp_verify.properties.training import (
    BUCKET_CAP_LISTS,
    CLIPS,
    clip_ways,
    entry_points_train_like_one_device,
    trains_like_one_device,
    trains_like_plain_ddp,
)
from tpdp_verify.properties.wiring import miswiring_refused_or_exact
from tpdp_verify.runner import memo
from tpdp_verify.runner.profiles import PROFILES

CI = PROFILES["ci"]
TRAINING = (trains_like_one_device, trains_like_plain_ddp, entry_points_train_like_one_device)


def drawn(prop, world_size: int) -> list:
    """The cases ``prop`` trains under the ci profile on ``world_size`` ranks, cover cases first."""
    return [args["case"] for args in drawn_args(prop, world_size)]


def drawn_args(prop, world_size: int) -> list[dict]:
    """Every argument ``prop`` draws under the ci profile on ``world_size`` ranks, a dict a case."""
    if (prop.name, world_size) not in _DRAWN:
        seen = _DRAWN[prop.name, world_size] = []

        @functools.wraps(prop.fn)
        def record(pool, impl, case, **route):
            seen.append({k: v for k, v in {"case": case, **route}.items() if k in prop.strategies})

        dataclasses.replace(prop, fn=record).run(SimpleNamespace(world_size=world_size), "torch", CI)
    return _DRAWN[prop.name, world_size]


_DRAWN: dict = {}


@functools.cache
def counts() -> Counter:
    """Drawn cases per value of each dimension, over the training properties and the ci world sizes."""
    return Counter(value for prop in TRAINING for ws in CI.world_sizes for args in drawn_args(prop, ws)
                   for value in values(args["case"]))


@functools.cache
def unmasked() -> Counter:
    """The same, of the cases torch 2.13.0 trains through (the shipped memo's answer: it passes):
    a value reached only where the release fails already is reached in name only, for a
    regression there hides behind the known failure."""
    answers = memo.Memo.load("2.13.0", [memo.shipped("2.13.0")]).answers
    return Counter(value for prop in TRAINING for ws in CI.world_sizes for args in drawn_args(prop, ws)
                   if answers.get(memo.key(prop.name, ws, args), FAILS).signature == ()
                   for value in values(args["case"]))


FAILS = SimpleNamespace(signature=("not answered",))


def values(c) -> list[str]:
    """The dimension values a training case reaches."""
    out: list[str] = []
    ddp, fsdp, habits = c.ddp, c.fsdp, c.habits
    out.extend([f"entry={c.entry}", f"habits.clip={habits.clip}", f"habits.between={habits.between}",
                f"habits.set_to_none={habits.set_to_none}", f"habits.ignored={habits.ignored}",
                f"habits.checkpoint={habits.checkpoint} under {'ddp' if c.entry in DDP else c.entry}"])
    if habits.clip is not None and c.entry != "fsdp1":  # FSDP1 clips by its own method
        under = 'ddp' if c.entry in DDP else c.entry
        out.extend([f"habits.clip_by={habits.clip_by} under {under}",
                    f"habits.norm_type={habits.norm_type} by {habits.clip_by} under {under}"])
        if c.entry == "fully_shard" and c.dp > 1:  # each norm's shards reduced across dp ranks
            out.extend([f"habits.norm_type={habits.norm_type} by {habits.clip_by} over dp shards"])
    if c.entry in DDP:
        out.extend([f"ddp.init_sync={ddp.init_sync}", f"ddp.comm_hook={ddp.comm_hook}",
                    f"ddp.skip_all_reduce_unused_params={ddp.skip_all_reduce_unused_params}",
                    f"ddp.bucket_cap_mb_list={ddp.bucket_cap_mb_list}",
                    f"ddp.batched_grad_copy={ddp.batched_grad_copy}"])
    if c.entry in FSDP2:
        out.extend([f"fsdp.mixed_precision={fsdp.mixed_precision}"])
    if c.entry in FSDP2 and fsdp.mixed_precision and c.model == "llama_sp" and c.tp > 1:
        # TP sums the norms' partial gradients: reduce_dtype governs it (judging.reductions)
        out.extend([f"tp sums under {c.entry}'s policy, accumulate={min(c.accumulate, 2)}"])
    if c.entry in FSDP2 and fsdp.mixed_precision and c.dp > 1:
        # FSDP2 reduces over dp in the policy's reduce_dtype (judging.reductions)
        out.extend([f"dp sums under {c.entry}'s policy, accumulate={min(c.accumulate, 2)}"])
    if c.entry == "fully_shard":
        out.extend([f"fsdp.reshard_after_forward={fsdp.reshard_after_forward}"])
    return out


DDP = ("ddp_mesh", "transform_ddp", "replicate")
FSDP2 = ("fully_shard", "replicate_fsdp")
EXPECTED = (
    [f"entry={e}" for e in ENTRIES]
    + [f"ddp.init_sync={v}" for v in (True, False)]
    + [f"ddp.comm_hook={v}" for v in (None, *CPU_COMM_HOOKS)]
    + [f"ddp.skip_all_reduce_unused_params={v}" for v in (True, False)]
    + [f"ddp.bucket_cap_mb_list={v}" for v in BUCKET_CAP_LISTS]
    # a keyword this torch's DDP lacks is not drawn (torch 2.11 has no batched_grad_copy)
    + [f"ddp.batched_grad_copy={v}" for v in ((True, False) if "batched_grad_copy" in ddp_keywords() else (False,))]
    + [f"fsdp.mixed_precision={v}" for v in (None, *HALF)]
    + [f"fsdp.reshard_after_forward={v}" for v in (True, False)]
    + [f"tp sums under {e}'s policy, accumulate={a}" for e in FSDP2 for a in (1, 2)]
    + [f"dp sums under {e}'s policy, accumulate={a}" for e in FSDP2 for a in (1, 2)]
    + [f"habits.clip={v}" for v in CLIPS]
    + [f"habits.clip_by={v} under {e}" for v in clip_ways() for e in ("ddp", *FSDP2)]
    # each norm each way, through DDP and FSDP2 (the cover cases: a drawn case clips by the 2-norm)
    + [f"habits.norm_type={p} by {v} under {e}" for p in NORM_TYPES for v in clip_ways() for e in ("ddp", *FSDP2)]
    + [f"habits.norm_type={p} by {v} over dp shards" for p in NORM_TYPES for v in clip_ways()]
    + [f"habits.between={v}" for v in BETWEEN]
    + [f"habits.set_to_none={v}" for v in (True, False)]
    + [f"habits.ignored={v}" for v in ("", *IGNORED)]
    + [f"habits.checkpoint=True under {e}" for e in ("ddp", *FSDP2, "fsdp1")]
)


@pytest.mark.parametrize("value", EXPECTED)
def test_the_ci_profile_draws_it(value):
    found = counts()
    assert found[value] > 0, f"the ci profile never draws {value}; it drew {dict(sorted(found.items()))}"


def test_the_counts_are_of_real_draws():
    """Every property drew its 40 cases a world size, or the counts above mean little."""
    for prop in TRAINING:
        for ws in CI.world_sizes:
            assert len(drawn(prop, ws)) >= CI.max_examples, (prop.name, ws)


def test_the_ci_profile_draws_every_miswiring_and_every_entry_point_miswired():
    drawn_cases = [c for ws in CI.world_sizes if ws >= miswiring_refused_or_exact.min_world_size
                   for c in drawn(miswiring_refused_or_exact, ws)]
    wirings, entries = Counter(c.wiring for c in drawn_cases), Counter(c.entry for c in drawn_cases)
    assert len(drawn_cases) >= CI.max_examples
    assert all(wirings[w] for w in MISWIRINGS), wirings
    assert all(entries[e] for e in ENTRIES), entries
    by_group = {c.entry for c in drawn_cases if c.wiring == "dp_by_group"}
    assert by_group == {"ddp_mesh", "fsdp1"}, by_group  # each entry point that takes a process group


CHECKPOINTS = (state_dict_like_unsharded, entry_points_state_dict_like_unsharded, checkpoint_resumes,
               entry_points_checkpoint_resume)


@pytest.mark.parametrize("world_size", CI.world_sizes)
@pytest.mark.parametrize("prop", TRAINING + CHECKPOINTS, ids=lambda p: p.name)
def test_the_ci_draw_composes_tp_and_dp(prop, world_size):
    """On the gate's own draw: with 4 ranks or more most cases have dp > 1 and tp > 1, and
    float32 (the tight bounds) is a fair share of those; with 2, at least half put the ranks
    on tp. A search that seldom composes TP with DP would pass a transform it never ran."""
    cases = drawn(prop, world_size)
    composed = [c for c in cases if min(c.mesh_shape) > 1]
    if world_size >= 4:
        assert len(composed) > len(cases) / 2, Counter(c.mesh_shape for c in cases)
        assert sum(c.dtype == "float32" for c in composed) >= len(cases) / 5, Counter(c.dtype for c in composed)
    else:
        assert sum(c.mesh_shape[1] > 1 for c in cases) >= len(cases) / 2, Counter(c.mesh_shape for c in cases)


def test_the_ci_profile_draws_every_loss_on_both_sides_of_loss_parallel():
    """losses_train_like_one_device, by the gate's own draw: every kind under loss_parallel
    and over replicated logits, every reduction, every cross-entropy option (logits of
    rank 3 and 4 among them), both models with a head, every sound entry point, TP and DP
    composed."""
    from tpdp_verify.cases.training import EDGE_LOSS_KINDS, LOSS_KINDS, LOSS_MODELS, REDUCTIONS
    from tpdp_verify.properties.exclusions import SOUND_TRAINING
    from tpdp_verify.properties.losses import losses_train_like_one_device as prop

    from tpdp_verify.properties.losses import EDGES

    cases = [c for ws in CI.world_sizes for c in drawn(prop, ws)]
    found = Counter()
    for c in cases:
        loss = c.loss
        found.update([f"edge {name} through {c.entry} of {c.model}" for name, edge in EDGES.items()
                      if dataclasses.replace(loss, parallel=True) == edge and loss.parallel])
        found.update([f"kind={loss.kind} parallel={loss.parallel}", f"reduction={loss.reduction}",
                      f"model={c.model}", f"entry={c.entry}", f"composed={min(c.mesh_shape) > 1}",
                      f"ignore_index={loss.ignore_index}", f"class_weights={loss.class_weights}",
                      f"label_smoothing={loss.label_smoothing}", f"logits={loss.logits} parallel={loss.parallel}"])
    expected = ([f"kind={k} parallel={p}" for k in LOSS_KINDS for p in (True, False)]
                + [f"kind={k} parallel=True" for k in EDGE_LOSS_KINDS]  # the edges' own, under loss_parallel
                + [f"reduction={r}" for r in REDUCTIONS] + [f"model={m}" for m in LOSS_MODELS]
                + [f"entry={e}" for e in SOUND_TRAINING["entries"]] + ["composed=True"]
                + [f"{o}={v}" for o in ("ignore_index", "class_weights") for v in (True, False)]
                + ["label_smoothing=0.1"]
                # logits of rank 3 and 4 (the class dim vocab-sharded) through loss_parallel's nll_loss2d
                + [f"logits={layout} parallel=True" for layout in ("ncd", "nchw")]
                # under loss_parallel, through an entry point torch 2.13 trains exactly (issue 42)
                + [f"edge {name} through fully_shard of {m}" for name in EDGES for m in LOSS_MODELS])
    assert all(found[v] for v in expected), [v for v in expected if not found[v]]
    assert len(cases) >= 2 * CI.max_examples
