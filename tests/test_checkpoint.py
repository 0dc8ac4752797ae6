"""Checkpoints on real ranks: the reference checkpoints exactly on the sound space, torch
2.13's departures are found and shrunk, and a mutant of the module transform is caught."""

import dataclasses
import time
import warnings

import pytest

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.errors import UsageError
from tpdp_verify.judging.divergence import Divergence
from tpdp_verify.properties.checkpoint import (
    checkpoint_cases,
    checkpoint_resumes,
    entry_points_checkpoint_resume,
    entry_points_state_dict_like_unsharded,
    state_dict_like_unsharded,
)
from tpdp_verify.runner import profiles

from helpers import divergences


def quick(profile: profiles.Profile) -> profiles.Profile:
    """At most the smoke profile's examples: a checkpoint example trains, saves, builds a
    second model and steps both, and the machine's two cores are shared."""
    smoke = profiles.get("smoke")
    return smoke if profile.max_examples > smoke.max_examples else profile


def narrowed(prop, **narrower):
    return prop.drawing(case=lambda ws: checkpoint_cases(ws, **narrower))


def searched(prop):
    """``prop``'s search alone, without its cover phase (each model's simplest case, run and
    run again where it fails: most of a test's time): the departures below show on every
    case of their narrowed space. What the cover phase reaches is tests/test_case_coverage.py's."""
    return dataclasses.replace(prop, cover=None)


def _departure(prop, pool, impl, **drawn) -> str:
    with pytest.raises(Divergence) as info:
        prop.fn(pool, impl, **drawn)
    return str(info.value)


# -- the reference ---------------------------------------------------------------------


def test_reference_state_dict_is_the_unsharded_models(tpdp_pool, tpdp_profile):
    stats = state_dict_like_unsharded.run(tpdp_pool, "reference", quick(tpdp_profile))
    assert stats.passed >= quick(tpdp_profile).max_examples


def test_reference_resumes_exactly(tpdp_pool, tpdp_profile):
    """Its state_dict post-hook hands out DTensors and its load pre-hook cuts them back to
    this rank's shards: every sound route round-trips bit for bit."""
    stats = checkpoint_resumes.run(tpdp_pool, "reference", quick(tpdp_profile))
    assert stats.passed >= quick(tpdp_profile).max_examples // 2


# -- torch 2.13 ------------------------------------------------------------------------


def test_torch_state_dict_holds_local_shards_then_loses_tp_parameters(tpdp_pool, tpdp_profile):
    prop = searched(narrowed(state_dict_like_unsharded, entries=("ddp_mesh",)))
    found, _ = divergences(prop, tpdp_pool, "torch", quick(tpdp_profile))
    text = "\n".join(map(str, found))
    assert "state_dict holds global shapes: before training" in text, text
    assert "state_dict has the unsharded model's keys: after training: missing" in text, text
    assert "the departure is TP+DP's" in text, text


def test_torch_checkpoints_through_ddp_do_not_load(tpdp_pool, tpdp_profile):
    prop = searched(narrowed(checkpoint_resumes, entries=("ddp_mesh", "transform_ddp")))
    found, _ = divergences(prop, tpdp_pool, "torch", quick(tpdp_profile))
    text = "\n".join(map(str, found))
    assert "Missing key(s) in state_dict" in text or "model state_dict is empty" in text, text


def test_torch_fully_shard_resumes_exactly(tpdp_pool, tpdp_profile):
    """Narrowed for time to the MLP (the explicit examples are every drawn model's simplest)."""
    prop = narrowed(checkpoint_resumes, entries=("fully_shard",), models=("mlp",))
    stats = prop.run(tpdp_pool, "torch", quick(tpdp_profile))
    assert stats.passed >= quick(tpdp_profile).max_examples


# -- whatever the transform ------------------------------------------------------------


def test_dcp_gives_every_tp_rank_one_ranks_ddp_optimizer_state(tpdp_pool):
    text = _departure(entry_points_checkpoint_resume, tpdp_pool, "reference",
                      case=TrainCase(model="mlp", mesh_shape=(1, 2), optimizer="adam"), route="dcp")
    assert "the loaded optimizer holds the saved state: w1.weight: exp_avg:" in text, text
    assert "the departure is TP+DP's" in text, text


def test_replicate_state_dict_holds_local_shards_whatever_the_transform(tpdp_pool):
    text = _departure(entry_points_state_dict_like_unsharded, tpdp_pool, "reference",
                      case=TrainCase(model="mlp", mesh_shape=(1, 2), entry="replicate"))
    assert "state_dict holds global shapes: after training: w1.weight is a Tensor of shape [6, 8]" in text, text
    assert "the departure is TP+DP's" in text, text


def test_fsdp1_get_optimizer_state_dict_loses_the_tp_dimension(tpdp_pools):
    text = _departure(entry_points_checkpoint_resume, tpdp_pools.get(4), "reference",
                      case=TrainCase(model="mlp", mesh_shape=(2, 2), entry="fsdp1", optimizer="adam"),
                      route="get_set")
    assert "the loaded optimizer holds the saved state: rank 1's flat shard: w1.weight: exp_avg:" in text, text
    assert "the departure is TP+DP's" in text, text


# -- power -----------------------------------------------------------------------------


def test_a_mutant_replacing_by_delattr_is_caught(tpdp_pool, tpdp_profile):
    """Found (not shrunk) within a minute, by the check it breaks: delattr then setattr of
    the DTensor rebuilt for a forward puts it outside the registry, as torch does."""
    start = time.monotonic()
    found, _ = divergences(state_dict_like_unsharded, tpdp_pool, "mutants.ReplacesByDelattr",
                            dataclasses.replace(quick(tpdp_profile), shrink=False))
    assert any("state_dict has the unsharded model's keys: after training: missing" in str(e) for e in found), found
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("prop, entry", [(checkpoint_resumes, "replicate"), (entry_points_checkpoint_resume, "ddp_mesh")])
def test_a_replay_outside_the_property_space_is_a_usage_error(prop, entry):
    """Outside hypothesis (a replay, a baseline's rerun) there is no assume() to call."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no HypothesisDeprecationWarning either
        with pytest.raises(UsageError, match="outside this property's space"):
            prop.fn(None, "reference", case=TrainCase(model="mlp", mesh_shape=(1, 2), entry=entry), route="state_dict")


def test_a_departure_without_tp_excuses_only_departures_no_larger():
    """checkpoint_resumes excuses a TP+DP departure the same entry point shows without TP (DP's
    own rounding on resume) only value by value, where it is no larger: a gradient 1% off
    after a load departs in the same checks as an ulp of gloo's ring, by far more."""
    from tpdp_verify.judging.verdict import Verdict
    from tpdp_verify.oracles.checkpoints import no_larger

    key = "the resumed model after the step is the uninterrupted one's: w1.weight"
    alone = Verdict(departures={key: 6e-8})
    assert no_larger(Verdict(departures={key: 6e-8}), alone)
    assert not no_larger(Verdict(departures={key: 1e-2}), alone)  # the same check, a hundred thousand times further
    assert not no_larger(Verdict(departures={key.replace("w1", "w2"): 1e-9}), alone)  # a value DP alone keeps


@pytest.mark.parametrize("prop, in_space", [(checkpoint_resumes, True), (entry_points_checkpoint_resume, False)],
                         ids=lambda v: getattr(v, "name", v))
def test_the_cover_cases_reach_every_entry_point_by_every_route_in_the_space_at_dp_x_tp(prop, in_space):
    """A route is drawn apart from the case: 40 drawn cases at 4 ranks met FSDP1's one
    sound route once in a hundred and fifty checkpoint cases. The cover meets each pair."""
    from tpdp_verify.cases.training import ENTRIES
    from tpdp_verify.properties.checkpoint import sound
    from tpdp_verify.ranks.checkpoint import ROUTES

    strategies = {k: s(4) if callable(s) else s for k, s in prop.strategies.items()}
    covered = {(c["case"].entry, c["route"]) for c in prop.cover(strategies) if min(c["case"].mesh_shape) > 1}
    assert covered == {(e, r) for e in ENTRIES for r in ROUTES if sound(e, r) == in_space}
