"""The declared exclusions (properties/exclusions.py): each names real properties and a real
doc section, says why, and is live: the unfiltered space reaches cases its predicate
matches, and the properties it applies to never draw one."""

import re
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from tpdp_verify.cases.training import BETWEEN, BUILT, HSDP_ENTRIES, LOSS_MODELS, REDUCTIONS
from tpdp_verify.properties import ALL, EXCLUSIONS
from tpdp_verify.properties.large_dp import large_dp_cases
from tpdp_verify.properties.losses import CROSS_ENTROPY, SMOOTHING, loss_cases, losses
from tpdp_verify.properties.modules import module_trees
from tpdp_verify.properties.strategies import fused_cases
from tpdp_verify.properties.training import train_cases
from tpdp_verify.runner.suite import load as load_suite

ROOT = Path(__file__).resolve().parent.parent
PROPERTIES = {p.name: p for p in ALL}
WORLD_SIZES = (2, 4)
DRAWS = 100

_SETTINGS = dict(database=None, derandomize=True, suppress_health_check=list(HealthCheck), deadline=None)


def _redraw(strategy, field, values):
    """``strategy``'s cases with ``field`` drawn afresh from ``values(case)``."""
    return strategy.flatmap(lambda c: values(c).map(lambda v: replace(c, **{field: v})))


def _fsdp1_untrained(ws):
    return train_cases(ws, entries=("fsdp1",), built=("after_wrap",), static_graph=(False,))


# Each exclusion's region in the space before its filter: the strategy with the left-out
# dimension drawn freely.
UNFILTERED = {
    "fsdp_optimizer_before_wrap": lambda ws: _redraw(
        train_cases(ws, entries=("fsdp1", "fully_shard", "replicate_fsdp")), "built", lambda c: st.sampled_from(BUILT)),
    "fsdp2_optimizer_after_forward": lambda ws: _redraw(
        train_cases(ws, entries=("fully_shard", "replicate_fsdp")), "built", lambda c: st.sampled_from(BUILT)),
    "ddp_unused_without_find_unused": lambda ws: _redraw(
        train_cases(ws, entries=("ddp_mesh", "transform_ddp", "replicate"), models=("unused",)), "ddp",
        lambda c: st.booleans().map(lambda b: replace(c.ddp, find_unused_parameters=b))),
    "checkpoint_static_graph": train_cases,
    "fsdp1_checkpoint_one_dp_rank": _fsdp1_untrained,
    "fsdp1_checkpoint_accumulate": _fsdp1_untrained,
    "trees_without_parameters": module_trees,
    "half_precision_against_one_device": lambda ws: train_cases(ws, half=True),
    "half_precision_outside_the_sound_space": lambda ws: train_cases(ws, half=True),
    "checkpoint_options_and_habits": train_cases,
    "direct_call_under_fsdp": lambda ws: _redraw(
        train_cases(ws, entries=("fsdp1", "fully_shard", "replicate_fsdp")), "habits",
        lambda c: st.sampled_from(BETWEEN).map(lambda b: replace(c.habits, between=b))),
    "losses_with_options_and_habits": lambda ws: st.builds(lambda c, loss: replace(c, loss=loss), train_cases(ws),
                                                           losses()),
    "losses_through_replicate_and_fsdp1": lambda ws: st.builds(
        lambda c, loss: replace(c, loss=loss), train_cases(ws, models=LOSS_MODELS, options=False), losses()),
    "replicate_fsdp_on_a_2d_dp_mesh": lambda ws: _redraw(
        large_dp_cases(ws), "entry", lambda c: st.sampled_from(HSDP_ENTRIES)),
    "label_smoothing_under_loss_parallel": lambda ws: _redraw(
        loss_cases(ws), "loss", lambda c: st.sampled_from(SMOOTHING).map(
            lambda s: replace(c.loss, label_smoothing=s if c.loss.kind in CROSS_ENTROPY else 0.0))),
    # on the head whose DTensor program runs on the CPU in the SPMD form (fault 19 stops the others')
    "mean_under_loss_parallel_on_a_2d_mesh": lambda ws: _redraw(
        loss_cases(ws).filter(lambda c: c.model == "lm_head"), "loss",
        lambda c: st.sampled_from(REDUCTIONS).map(lambda r: replace(c.loss, reduction=r))),
    "fused_parts_of_one_row": lambda ws: _redraw(fused_cases(ws), "cols", lambda c: st.integers(1, 4)),
}

IDS = [x.name for x in EXCLUSIONS]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # no comments in code blocks
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


@cache
def _drawn(name: str, ws: int) -> tuple:
    """DRAWS cases the property ``name`` draws on ``ws`` ranks (derandomized)."""
    strategy = PROPERTIES[name].strategies["case"]
    out = []

    @settings(max_examples=DRAWS, phases=[Phase.generate], **_SETTINGS)
    @given(strategy(ws) if callable(strategy) else strategy)
    def collect(case):
        out.append(case)

    collect()
    return tuple(out)


def test_names_are_unique_and_every_exclusion_has_an_unfiltered_space():
    assert len(set(IDS)) == len(IDS)
    assert set(UNFILTERED) == set(IDS)


@pytest.mark.parametrize("exclusion", EXCLUSIONS, ids=IDS)
def test_declaration(exclusion):
    assert exclusion.applies_to and set(exclusion.applies_to) <= set(PROPERTIES), exclusion.applies_to
    assert exclusion.reason.strip()
    path, _, anchor = exclusion.doc.partition("#")
    assert (ROOT / path).is_file(), exclusion.doc
    assert anchor in _anchors(ROOT / path), f"{exclusion.doc}: no heading with that anchor"


@pytest.mark.parametrize("exclusion", EXCLUSIONS, ids=IDS)
def test_the_unfiltered_space_reaches_it(exclusion):
    found = find(UNFILTERED[exclusion.name](4), exclusion.test,
                 settings=settings(max_examples=500, phases=[Phase.generate], **_SETTINGS))
    assert exclusion.test(found)


@pytest.mark.parametrize("exclusion", EXCLUSIONS, ids=IDS)
def test_the_properties_never_draw_it(exclusion):
    for name in exclusion.applies_to:
        for ws in WORLD_SIZES:
            drawn = [c for c in _drawn(name, ws) if exclusion.test(c)]
            assert not drawn, f"{name} on {ws} ranks drew {drawn[0]!r}"


def test_summary_and_records():
    suite = load_suite()
    lines, records = suite.summary_lines(), suite.exclusion_records()
    assert len(lines) == len(records) == len(EXCLUSIONS)
    for x, line, record in zip(EXCLUSIONS, lines, records):
        assert line == f"not searched: {x.name} ({', '.join(x.applies_to)}): {x.reason} [{x.doc}]"
        assert record == {"name": x.name, "properties": list(x.applies_to), "reason": x.reason, "doc": x.doc}


# --------------------------------------------------------------------------- the reasons, shown
# Each exclusion whose reason says how torch behaves, run on a representative case (the
# simplest its unfiltered space has) with TP and without: "own", the same entry point
# departs without TP too (its contract, not TP's); "training fails", TP+DP's training
# raises where the entry point alone trains, so a checkpoint has nothing to hold and the
# training properties search it; "refused", torch raises under loss_parallel() where the
# same loss over replicated logits trains (what its docs say it does not support);
# "rounds", the option alone departs from one device in full precision beyond the
# float32 bound, so that run earns no bound for it; "the view refuses", DTensor raises
# building the layout by the public route, so there is nothing to read back. The other
# exclusions (SCOPE) say what tpdp-verify leaves to another property; their tests below
# show that the case left out has nothing for the property to check, or that the other
# property searches it.
CLAIMS = {
    "fsdp_optimizer_before_wrap": "own",
    "fsdp2_optimizer_after_forward": "own",
    "ddp_unused_without_find_unused": "own",
    "checkpoint_static_graph": "own",
    "direct_call_under_fsdp": "own",
    "fsdp1_checkpoint_one_dp_rank": "training fails",
    "fsdp1_checkpoint_accumulate": "training fails",
    "half_precision_against_one_device": "rounds",
    "label_smoothing_under_loss_parallel": "refused",
    "mean_under_loss_parallel_on_a_2d_mesh": "refused",
    "losses_through_replicate_and_fsdp1": "the entry point's",
    "replicate_fsdp_on_a_2d_dp_mesh": "own",
    "fused_parts_of_one_row": "the view refuses",
}
BY_NAME = {x.name: x for x in EXCLUSIONS}


def _representative(name: str):
    return find(UNFILTERED[name](4), BY_NAME[name].test,
                settings=settings(max_examples=500, phases=[Phase.generate, Phase.shrink], **_SETTINGS))


def _without_rounding(case):
    """The case judged as full precision: what a one-device run in the case's dtype earns."""
    return replace(case, ddp=replace(case.ddp, comm_hook=None), fsdp=replace(case.fsdp, mixed_precision=None))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_the_reason_holds_on_a_case_it_leaves_out(tpdp_pools, name):
    from tpdp_verify.judging.verdict import assemble, judge_training
    from tpdp_verify.oracles.plain_ddp import observe_plain_ddp
    from tpdp_verify.oracles.single_device import oracle
    from tpdp_verify.oracles.verdicts import verdict_one_device

    case, claim, pool = _representative(name), CLAIMS[name], tpdp_pools.get(4)
    if claim == "the view refuses":
        from tpdp_verify.errors import RankFailed
        from tpdp_verify.properties.layouts import observe_fused

        with pytest.raises(RankFailed, match="would remove or reshape sharded dimension"):
            pool.run(observe_fused, case, "torch", "")
        return
    if claim == "rounds":
        plain, _ = assemble(case, pool.run(observe_plain_ddp, case))
        verdict = judge_training(_without_rounding(case), plain, *oracle(case))
        assert not verdict.ok, f"{case!r}: plain DP with the option trains within the float32 bound"
        return
    verdict = verdict_one_device(pool, "torch", case)
    assert not verdict.ok, f"{case!r} trains exactly with TP: the exclusion hides nothing, draw it"
    if claim == "refused":
        outside = verdict_one_device(pool, "torch", replace(case, loss=replace(case.loss, parallel=False)))
        assert any(not c.ok and c.name == "trains without an exception" for c in verdict.checks), verdict.report()
        assert all(c.ok for c in outside.checks if c.name == "trains without an exception"), outside.report()
    elif claim == "the entry point's":  # and with the model's own loss too
        own_loss = verdict_one_device(pool, "torch", replace(case, loss=None))
        assert not own_loss.ok, f"{case!r} trains exactly with its model's own loss: draw the losses there"
    elif claim == "own":
        assert verdict.plain_ddp.startswith("departs too"), (case, verdict.plain_ddp)
    else:
        assert any(not c.ok and c.name == "trains without an exception" for c in verdict.checks), verdict.report()
        assert verdict.plain_ddp.startswith("trains like one device"), (case, verdict.plain_ddp)


SCOPE = ("trees_without_parameters", "checkpoint_options_and_habits", "half_precision_outside_the_sound_space",
         "losses_with_options_and_habits")


def test_every_exclusion_shows_its_reason():
    assert set(CLAIMS) | set(SCOPE) == set(IDS) and not set(CLAIMS) & set(SCOPE)


@pytest.mark.timeout(120)
def test_a_tree_without_parameters_leaves_paths_and_ignoring_nothing_to_check(tpdp_pools):
    """trees_without_parameters: on such a tree paths_resolve's ranks compare nothing (a
    verdict that fails on zero), ignored_params_untouched's only that an empty name list
    stays empty; registry_preserved, which checks what such a tree keeps, draws them."""
    from tpdp_verify.properties.registry import observe_ignored, observe_paths
    from tpdp_verify.judging.verdict import Verdict

    tree, pool = _representative("trees_without_parameters"), tpdp_pools.get(4)
    paths = Verdict.of_ranks(pool.run(observe_paths, tree, 0, "torch"))
    assert [c.name for c in paths.failures] == ["compared at least 1 item"], paths.report()
    for observed in pool.run(observe_ignored, tree, 2**24 - 1, "torch"):
        assert [(c.name, c.ok) for c in observed.checks] == [("names and their order survive localize", True)]
    drawn = [c for ws in WORLD_SIZES for c in _drawn("registry_preserved", ws)]
    assert any(BY_NAME["trees_without_parameters"].test(c) for c in drawn)


@pytest.mark.timeout(300)
def test_a_checkpoint_with_newer_options_holds_what_training_gave_it(tpdp_pools):
    """checkpoint_options_and_habits: the training properties draw those options, and a
    checkpoint of a case with one set resumes as the same case without it does."""
    from tpdp_verify.cases.training import DDPOptions, FSDP2Options, Habits
    from tpdp_verify.oracles.checkpoints import verdict_resume
    from tpdp_verify.properties.checkpoint import trainable

    x = BY_NAME["checkpoint_options_and_habits"]
    training = ("trains_like_one_device", "trains_like_plain_ddp", "entry_points_train_like_one_device")
    assert all(any(x.test(c) for c in _drawn(name, 4)) for name in training)
    case = find(train_cases(4, entries=("fully_shard",), built=("after_wrap",)), lambda c: x.test(c) and trainable(c),
                settings=settings(max_examples=500, phases=[Phase.generate, Phase.shrink], **_SETTINGS))
    plain = replace(case, ddp=DDPOptions(), fsdp=FSDP2Options(), habits=Habits())
    with_option, without = (verdict_resume(tpdp_pools.get(4), "torch", c, "state_dict") for c in (case, plain))
    assert with_option.ok == without.ok and with_option.signature == without.signature, \
        (case, with_option.report(), without.report())


def test_half_precision_beyond_the_sound_space_is_no_property_s_to_judge_yet():
    """half_precision_outside_the_sound_space: the one-device properties cannot judge an
    option that rounds by design (the claim "rounds" above), and trains_like_plain_ddp,
    which can, draws the sound space only."""
    from tpdp_verify.properties.exclusions import sound

    drawn = [c for ws in WORLD_SIZES for c in _drawn("trains_like_plain_ddp", ws)]
    assert drawn and all(sound(c) for c in drawn)
    assert CLAIMS["half_precision_against_one_device"] == "rounds"


def test_the_options_and_habits_a_drawn_loss_leaves_out_are_training_s_to_search():
    """losses_with_options_and_habits: the training properties draw every one of them (with
    each model's own loss, cross entropy under loss_parallel on llama_lm among them), and
    the loss property draws the rest of a training case: entry points, meshes, optimizers,
    dtypes, steps and microbatches."""
    x = BY_NAME["losses_with_options_and_habits"]
    training = [c for ws in WORLD_SIZES for name in ("trains_like_one_device", "entry_points_train_like_one_device")
                for c in _drawn(name, ws)]
    assert any(x.test(c) and c.model == "llama_lm" for c in training)
    drawn = [c for ws in WORLD_SIZES for c in _drawn("losses_train_like_one_device", ws)]
    assert {c.entry for c in drawn} >= {"ddp_mesh", "fully_shard"} and {c.accumulate for c in drawn} == {1, 2}
    assert {c.dtype for c in drawn} == {"float32", "bfloat16", "float16"} and any(min(c.mesh_shape) > 1 for c in drawn)
