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
from collections import Counter, defaultdict
from types import SimpleNamespace
from typing import NamedTuple

import pytest

from tpdp_verify.cases.training import (
    BETWEEN,
    BUFFERED,
    BUFFERS,
    ENTRIES,
    HALF,
    IGNORED,
    MISWIRINGS,
    NORM_TYPES,
    ddp_keywords,
)
from tpdp_verify.fixtures.zoo import COVER_ONLY
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
from tpdp_verify.ranks.checkpoint import ROUTES
from tpdp_verify import faults
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
    if c.model in BUFFERED:
        out.extend([f"habits.buffers={habits.buffers}"])
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
    if c.model in COVER_ONLY:  # a weight sharded per part over tp (the fused model), through each entry point
        out.extend([f"{c.model} model through {c.entry}"])
    if c.dp_mesh_dims:  # the batch a DTensor sharded over the dp dims: its rows a dp rank (TrainCase.rows)
        rows = [len(range(c.global_batch)[c.rows(d)]) for d in range(c.dp)]
        out.extend([f"spmd batch {'even' if len(set(rows)) == 1 else 'uneven'} over {len(c.dp_dims)} dp dims"]
                   + (["spmd batch with a dp rank of no rows"] if 0 in rows else []))
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
    + [f"habits.buffers={v}" for v in BUFFERS]
    + [f"spmd batch {v} over {n} dp dims" for v in ("even", "uneven") for n in (1, 2)]
    + ["spmd batch with a dp rank of no rows"]
    + [f"fused model through {e}" for e in ENTRIES]
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


def loss_values(c) -> list[str]:
    """The loss dimension values a case of losses_train_like_one_device reaches."""
    from tpdp_verify.properties.losses import EDGES, SPMD_EDGES

    loss = c.loss
    return ([f"edge {name} through {c.entry} of {c.model}" for name, edge in EDGES.items()
             if dataclasses.replace(loss, parallel=True) == edge and loss.parallel]
            + [f"spmd edge {name} through {c.entry}" for name, edge in SPMD_EDGES.items() if loss == edge]
            + [f"kind={loss.kind} parallel={loss.parallel}", f"reduction={loss.reduction}",
               f"model={c.model}", f"entry={c.entry}", f"composed={min(c.mesh_shape) > 1}",
               f"ignore_index={loss.ignore_index}", f"class_weights={loss.class_weights}",
               f"label_smoothing={loss.label_smoothing}", f"logits={loss.logits} parallel={loss.parallel}",
               f"dp_mesh_dims={c.dp_mesh_dims}", f"over={loss.over}"]
            + ([f"cross entropy reduction={loss.reduction} parallel={loss.parallel}"]
               if loss.kind == "cross_entropy" else [])
            + ([f"over=batch reduction={loss.reduction} parallel={loss.parallel}"] if loss.over else [])
            + (["a dp rank's targets all ignored"] if loss.over and loss.ignore_index and _a_rank_all_ignored(c) else []))


def _a_rank_all_ignored(c) -> bool:
    """Whether some dp rank's rows of some microbatch are all padding (the loss's IGNORE)."""
    from tpdp_verify.fixtures.losses import IGNORE
    from tpdp_verify.ranks.loop import batches

    return any((b["target"][c.rows(r)] == IGNORE).all() for micro in batches(c) for b in micro for r in range(c.dp))


def loss_expected() -> list[str]:
    from tpdp_verify.cases.training import DTENSOR, EDGE_LOSS_KINDS, LOSS_KINDS, LOSS_MODELS, OVER, REDUCTIONS
    from tpdp_verify.fixtures.zoo import TRAINED
    from tpdp_verify.properties.exclusions import SOUND_TRAINING
    from tpdp_verify.properties.losses import EDGES, SPMD_EDGES

    TRAINED_LOSS_MODELS = [m for m in LOSS_MODELS if m in TRAINED]  # the head alone takes the SPMD edges

    return ([f"kind={k} parallel={p}" for k in LOSS_KINDS for p in (True, False)]
            + [f"kind={k} parallel=True" for k in EDGE_LOSS_KINDS]  # the edges' own, under loss_parallel
            + [f"reduction={r}" for r in REDUCTIONS] + [f"model={m}" for m in LOSS_MODELS]
            + [f"entry={e}" for e in SOUND_TRAINING["entries"]] + ["composed=True"]
            + [f"{o}={v}" for o in ("ignore_index", "class_weights") for v in (True, False)]
            + ["label_smoothing=0.1"]
            # logits of rank 3 and 4 (the class dim vocab-sharded) through loss_parallel's nll_loss2d
            + [f"logits={layout} parallel=True" for layout in ("ncd", "nchw")]
            # loss_parallel's fused backward under each reduction (issue 52)
            + [f"cross entropy reduction={r} parallel=True" for r in REDUCTIONS]
            # under loss_parallel, through an entry point torch 2.13 trains exactly (issue 42)
            + [f"edge {name} through fully_shard of {m}" for name in EDGES for m in TRAINED_LOSS_MODELS]
            # the SPMD form's batch losses (issue 49): its forms, through FSDP2 and alone, each
            # reduction on each side of loss_parallel (its mean refused on the 2-D mesh), and
            # ignored targets leaving a dp rank none valid
            + [f"dp_mesh_dims={f}" for f in ("", "shard", "replicate")] + [f"entry={DTENSOR}"]
            + [f"over={o}" for o in OVER]
            + [f"over=batch reduction={r} parallel={p}" for r in REDUCTIONS for p in (True, False)
               if not (p and r == "mean")]
            + ["a dp rank's targets all ignored"] + [f"spmd edge {name} through {DTENSOR}" for name in SPMD_EDGES])


def test_the_ci_profile_draws_every_loss_on_both_sides_of_loss_parallel():
    """losses_train_like_one_device, by the gate's own draw: every kind under loss_parallel
    and over replicated logits, every reduction, every cross-entropy option (logits of
    rank 3 and 4 among them), both models with a head, every sound entry point, TP and DP
    composed."""
    from tpdp_verify.properties.losses import losses_train_like_one_device as prop

    cases = [c for ws in CI.world_sizes for c in drawn(prop, ws)]
    found = Counter(v for c in cases for v in loss_values(c))
    assert all(found[v] for v in loss_expected()), [v for v in loss_expected() if not found[v]]
    assert len(cases) >= 2 * CI.max_examples


# What hides a regression of a value on a case: the release raised, died or hung there (nothing
# after it is compared), or a value departs already (a regression there adds nothing new).
MASKING = ("raised:", "crash:", "hang", "value:")

# The values no ci case reaches where torch 2.13.0 can still show a regression of theirs: the
# catalogued faults that mask every case with the value, and why no cover case unmasks it.
# The test below checks the faults (the catalog explains each case's masking parts by one of
# them) and fails where a value here gains unmasked reach (drop it). Each fails with the
# reference transform too, or fails by fault 1 on every case (tp of 1 included): after the
# first forward the DDP transform leaves TP's parameters out of parameters(), so what clips
# them or loads them departs whatever the value.
class Masked(NamedTuple):
    faults: tuple[int, ...]
    why: str


_LOCAL_NORM = Masked((1, 5, 8, 9), "DDP with TP clips the parameters it still registers, by each rank's local "
                   "norm (9: where the case checkpoints its blocks too)")
MASKED_ON_THE_RELEASE = {
    "entry=replicate": Masked((1, 3, 5, 8, 9), "replicate() with TP departs on every case, with the reference "
                              "transform too"),
    "fused model through replicate": Masked((1, 3, 5, 8, 9), "as entry=replicate"),
    **{f"habits.clip_by={w} under ddp": _LOCAL_NORM for w in ("clip_grad_norm_", "get_total_norm")},
    **{f"habits.norm_type={p} by {w} under ddp": _LOCAL_NORM
       for p in ("2", "inf", "1") for w in ("clip_grad_norm_", "get_total_norm")},
    "habits.norm_type=inf by clip_grad_norm_ over dp shards": Masked((29, 30), "the max norm over FSDP2's dp "
                                                                      "shards raises on an empty shard, or departs"),
    "habits.between=submodule": Masked((1, 3, 5, 8, 9), "a block of the DDP-wrapped model called directly meets "
                                       "local shards, with the reference transform too (exclusions.sound_habits)"),
}


def _masked(signature: tuple) -> bool:
    return any(p.startswith(MASKING) for p in signature)


def _masking_faults(prop: str, args: dict, signature: tuple) -> frozenset[int]:
    """The catalogued faults that explain a failure's masking parts."""
    parts = tuple(p for p in signature if p.startswith(MASKING))
    return frozenset(f.number for f in faults.explain(prop, args, parts).faults)


@functools.cache
def release_answers() -> dict:
    return memo.Memo.load("2.13.0", [memo.shipped("2.13.0")]).answers


def _tally(unmasked_: Counter, masked_: dict, prop: str, ws: int, args: dict, reached: list[str]) -> None:
    answer = release_answers()[memo.key(prop, ws, args)]  # every one: test_memo_answers
    if _masked(answer.signature):
        by = _masking_faults(prop, args, answer.signature)
        for value in reached:
            masked_[value].append(by)
    else:
        unmasked_.update(reached)


@functools.cache
def reach() -> tuple[Counter, dict]:
    """Per value: the ci cases with it where torch 2.13.0 can still show a regression of it
    (it passes, or fails without a masking part), and for those where it cannot, the faults
    that mask each."""
    unmasked_, masked_ = Counter(), defaultdict(list)
    for prop in TRAINING:
        for ws in CI.world_sizes:
            for args in drawn_args(prop, ws):
                _tally(unmasked_, masked_, prop.name, ws, args, values(args["case"]))
    return unmasked_, masked_


@pytest.mark.parametrize("value", EXPECTED)
def test_the_ci_profile_reaches_it_where_the_release_can_still_fail(value):
    """A value reached only on cases torch 2.13.0 fails already, in a way that hides a
    regression of it, is reached in name only (a planted loss_parallel regression once passed
    the ci gate so): each value has a ci case where the release passes, or fails on parts it
    cannot hide, unless MASKED_ON_THE_RELEASE says which faults mask it."""
    _judge_reach(value, *reach(), MASKED_ON_THE_RELEASE, "add a cover case that puts it on an entry point where "
                 "2.13.0 trains exactly")


def _judge_reach(value: str, unmasked_: Counter, masked_: dict, declared: dict, fix: str) -> None:
    """A value is reached unmasked, or declared masked and reached masked only, each case by
    one of the faults declared."""
    if value in declared:
        assert unmasked_[value] == 0 and masked_[value], \
            f"{value} is reached unmasked now ({unmasked_[value]} cases): drop it from the declared ones"
        others = [by for by in masked_[value] if not by & set(declared[value].faults)]
        assert not others, (f"{len(others)} of the {len(masked_[value])} ci cases with {value} are masked by "
                            f"faults {sorted(frozenset().union(*others))}, none of the declared "
                            f"{declared[value].faults}")
    else:
        assert unmasked_[value] > 0, (f"every one of the {len(masked_[value])} ci cases with {value} fails on "
                                      f"torch 2.13.0 in a way that hides a regression of it: {fix}")


# The loss values no ci case reaches where torch 2.13.0 can still show a regression of theirs.
LOSSES_MASKED_ON_THE_RELEASE = {
    "kind=teacher_kl parallel=True": Masked((15,), "a KL loss under loss_parallel departs in gradients on every case"),
    # FSDP2 over the SPMD mesh scales every gradient: the form reached unmasked through DTensor alone
    "dp_mesh_dims=shard": Masked((17, 24), "FSDP2 over the SPMD mesh departs in every gradient (24: where the "
                                 "weighted loss raises first)"),
    "edge per-pixel logits through fully_shard of llama_lm": Masked((28,), "its logits, laid out (1, vocab, 2, 4) "
                                                                    "by a view, raise in loss_parallel's backward "
                                                                    "(tied's reach the per-pixel branch unmasked)"),
    # the SPMD edges that show fault 31 (their loss departs; their gradients are right)
    **{f"spmd edge {name} through dtensor": Masked((31,), "the mean over the batch averages the dp ranks' means")
       for name in ("mean over the batch, ignored targets", "mean over the batch, class weights",
                    "nll's mean over the batch, ignored targets")},
}


@functools.cache
def loss_reach() -> tuple[Counter, dict]:
    from tpdp_verify.properties.losses import losses_train_like_one_device as prop

    unmasked_, masked_ = Counter(), defaultdict(list)
    for ws in CI.world_sizes:
        for args in drawn_args(prop, ws):
            _tally(unmasked_, masked_, prop.name, ws, args, loss_values(args["case"]))
    return unmasked_, masked_


@pytest.mark.parametrize("value", loss_expected())
def test_the_ci_profile_reaches_each_loss_where_the_release_can_still_fail(value):
    """As above, for the losses: loss_parallel's fused backward under each reduction, each
    logits layout, each kind, reached where torch 2.13.0 trains exactly (the cover cases'
    edges through FSDP2), unless LOSSES_MASKED_ON_THE_RELEASE says why not."""
    _judge_reach(value, *loss_reach(), LOSSES_MASKED_ON_THE_RELEASE, "add an edge (properties/losses.py EDGES) "
                 "through an entry point where 2.13.0 trains exactly")


def nested_values(case) -> list[str]:
    """A NestedCase's region: whether a tensor dim is sharded over two real mesh dims or more
    (nested), dividing or not, on a mesh whose submesh was flattened or not."""
    from tpdp_verify.faults.record import facts

    found = facts({"case": case})
    over = Counter(p.dim for p, n in zip(case.placements, case.mesh_shape) if p.is_shard() and n > 1)
    if max(over.values(), default=0) < 2:
        return ["not nested"]
    return [f"nested {'unevenly' if found['nested_unevenly'] else 'evenly'}"
            f"{', flattened' if case.flattened else ''}"]


NESTED = [f"nested {how}{flat}" for how in ("evenly", "unevenly") for flat in ("", ", flattened")]


@pytest.mark.parametrize("value", NESTED)
def test_the_ci_profile_reaches_each_nested_layout_where_the_release_reads_it_back(value):
    """nested_shards_read_back at ci meets each nested region (issue 49) on a case torch
    2.13.0 reads back exactly, so that a regression there is NEW; fault 34 fails some of the
    uneven ones over a flattened mesh, not all."""
    from tpdp_verify.properties.layouts import nested_shards_read_back as prop

    passing, failing = Counter(), Counter()
    for ws in CI.world_sizes:
        if ws >= prop.min_world_size:
            for args in drawn_args(prop, ws):
                answer = release_answers()[memo.key(prop.name, ws, args)]
                (failing if answer.signature else passing).update(nested_values(args["case"]))
    assert passing[value] > 0, f"no ci case {value} that torch 2.13.0 reads back exactly ({failing[value]} it fails)"


FUSED = [f"parts={p} fsdp={f}" for p in (1, 2, 3) for f in (False, True)]


@pytest.mark.parametrize("value", FUSED)
def test_the_ci_profile_reaches_each_fused_layout(value):
    """fused_projections_read_back at ci meets each number of parts, with FSDP2 over dp and
    without (issue 49); the unfused weight (1 part), which torch 2.13.0 reads back and
    checkpoints exactly, on a case it passes, so that a regression of DCP or FSDP2 there is
    NEW (faults 35 and 36 fail the fused ones)."""
    from tpdp_verify.properties.layouts import fused_projections_read_back as prop

    passing, failing = Counter(), Counter()
    for ws in CI.world_sizes:
        for args in drawn_args(prop, ws):
            case = args["case"]
            answer = release_answers()[memo.key(prop.name, ws, args)]
            (failing if answer.signature else passing)[f"parts={case.parts} fsdp={case.fsdp}"] += 1
    assert passing[value] + failing[value] > 0, f"no ci case {value}"
    if value.startswith("parts=1"):
        assert passing[value] > 0, f"no ci case {value} that torch 2.13.0 passes ({failing[value]} it fails)"


def test_the_ci_profile_checkpoints_the_fused_model_through_fully_shard_by_every_route():
    """The zoo's fused model's checkpoints (issue 49): its state_dict through DDP, FSDP1 and
    fully_shard, and a resume through fully_shard by each route, the cover cases at ci's
    world size of 4, each answered by the shipped memo (its faults 35 and 36)."""
    met = {(prop.name, args["case"].entry, args.get("route"))
           for prop in (state_dict_like_unsharded, checkpoint_resumes) for ws in CI.world_sizes
           for args in drawn_args(prop, ws)
           if args["case"].model in COVER_ONLY and memo.key(prop.name, ws, args) in release_answers()}
    assert met == {("state_dict_like_unsharded", e, None) for e in ("ddp_mesh", "fsdp1", "fully_shard")} | {
        ("checkpoint_resumes", "fully_shard", r) for r in ROUTES}, met


def main() -> None:
    """``python tests/test_case_coverage.py``: each value the training and loss tests count,
    with its ci cases where torch 2.13.0 can still show a regression of it (unmasked) and
    those where it cannot, by the faults that mask them; the values with no unmasked case
    first, each with the reason it is declared (issue 52)."""
    rows = []
    for values_, (unmasked_, masked_), declared in ((EXPECTED, reach(), MASKED_ON_THE_RELEASE),
                                                    (loss_expected(), loss_reach(), LOSSES_MASKED_ON_THE_RELEASE)):
        for value in values_:
            by = sorted(frozenset().union(*masked_[value])) if masked_[value] else []
            rows.append((unmasked_[value] > 0, value, unmasked_[value], len(masked_[value]), by,
                         declared[value].why if value in declared else ""))
    print(f"{'value':<66} {'unmasked':>8} {'masked':>6}  masked by faults")
    for reached, value, n, m, by, why in sorted(rows, key=lambda r: r[0]):
        print(f"{value:<66} {n:>8} {m:>6}  {', '.join(map(str, by))}{'  (declared: ' + why + ')' if why else ''}")
    print(f"{sum(not r[0] for r in rows)} of {len(rows)} values have no unmasked ci case")


if __name__ == "__main__":
    main()
