"""Gradient equality on real ranks: the reference trains like one device and like plain
DDP through every entry point that exercises the transform, torch 2.13's departures are
found and shrunk, and every training mutant is caught within a minute."""

import dataclasses
import time

import pytest
import torch

from tpdp_verify import signature
from tpdp_verify.cases.training import ENTRIES, Habits, TrainCase
from tpdp_verify.fixtures import ZOO
from tpdp_verify.fixtures.zoo import DRAWN
from tpdp_verify.judging.divergence import Divergence
from tpdp_verify.judging.verdict import Verdict, _direct
from tpdp_verify.oracles.plain_ddp import observe_plain_ddp
from tpdp_verify.oracles.verdicts import verdict_one_device
from tpdp_verify.properties.training import (
    SOUND_TRAINING,
    entry_points_train_like_one_device,
    train_cases,
    trains_like_one_device,
    trains_like_plain_ddp,
)
from tpdp_verify.properties.registry import tp_keeps_requires_grad

import mutants
from helpers import divergences, the_one

FSDP1_MODELS = tuple(m for m in DRAWN if m not in ("tied", "frozen", "unused"))  # the fused model: a cover case


def found_first(profile):
    """Torch's known departures below are asserted by their message: found, not shrunk (the
    shrinking of torch's failures is shown in test_structure), which saves a minute each."""
    return dataclasses.replace(profile, shrink=False)


def searched(prop):
    """``prop``'s search alone, without its cover phase (each model's simplest case, run and
    run again where it fails, on fresh ranks: most of these tests' time): the departures
    below show on every case of their narrowed space, so the first drawn one says its
    message. What the cover phase reaches is tests/test_case_coverage.py's."""
    return dataclasses.replace(prop, cover=None)


def narrowed(prop, **narrower):
    return prop.drawing(case=lambda ws: train_cases(ws, **{**SOUND_TRAINING, **narrower}))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("prop", [trains_like_one_device, trains_like_plain_ddp], ids=lambda p: p.name)
def test_reference_trains_exactly(tpdp_pools, tpdp_profile, prop, world_size):
    stats = prop.run(tpdp_pools.get(world_size), "reference", tpdp_profile)
    assert stats.passed >= tpdp_profile.max_examples


def test_reference_trains_exactly_through_fsdp1(tpdp_pools, tpdp_profile):
    """FSDP1's DTensorExtensions call the transform's flatten/unflatten on every unshard.

    Narrowed to where FSDP1 with TP works whatever the transform (docs/properties.md):
    no tied weights (their gradients come out wrong), no frozen layer (it trains), no
    unused branch (FSDP1 gives it zero gradients, without TP too), no empty tp shards
    (tp 2 and the zoo's sizes keep every shard non-empty; with empty ones FSDP1 cannot
    write back), one microbatch a step (no_sync crashes)."""
    prop = entry_points_train_like_one_device.drawing(case=lambda ws: train_cases(
        ws, entries=("fsdp1",), built=("after_wrap",), models=FSDP1_MODELS, mesh_shapes=((2, 2),), options=False,
    ).filter(lambda c: c.accumulate == 1))
    stats = prop.run(tpdp_pools.get(4), "reference", tpdp_profile)
    assert stats.passed >= tpdp_profile.max_examples


def test_torch_optimizer_built_after_a_forward_gets_no_parameters(tpdp_pool, tpdp_profile):
    prop = narrowed(trains_like_one_device, entries=("ddp_mesh",), built=("after_forward",))
    found, _ = divergences(searched(prop), tpdp_pool, "torch", found_first(tpdp_profile))
    assert any("optimizer got an empty parameter list" in str(e) for e in found), found


def test_torch_optimizer_built_before_wrapping_never_steps(tpdp_pool, tpdp_profile):
    prop = narrowed(entry_points_train_like_one_device, entries=("transform_ddp",), built=("before_wrap",))
    found, _ = divergences(searched(prop), tpdp_pool, "torch", found_first(tpdp_profile))
    assert any("stayed where it was" in str(e) and "the departure is TP+DP's" in str(e) for e in found), found


def test_torch_replicate_with_a_mesh_never_trains(tpdp_pool, tpdp_profile):
    prop = narrowed(entry_points_train_like_one_device, entries=("replicate",))
    found, _ = divergences(searched(prop), tpdp_pool, "torch", found_first(tpdp_profile))
    assert any("gradient present where the oracle has one" in str(e) for e in found), found


def test_torch_fsdp1_cannot_accumulate_gradients_under_no_sync(tpdp_pools, tpdp_profile):
    """Narrowed to the MLP on a 2x2 mesh: a failing explicit example (the simplest case of
    each model) would end the run before any case is drawn, and other models reach an
    FSDP1 hang that has no verdict (docs/properties.md)."""
    prop = entry_points_train_like_one_device.drawing(case=lambda ws: train_cases(
        ws, entries=("fsdp1",), built=("after_wrap",), models=("mlp",), mesh_shapes=((2, 2),), options=False,
    ).filter(lambda c: c.accumulate > 1))
    found, _ = divergences(searched(prop), tpdp_pools.get(4), "torch", found_first(tpdp_profile))
    assert any("invalid python storage" in str(e) for e in found), found


def test_clip_grad_norm_under_ddp_with_tp_misses_the_global_norm(tpdp_pool):
    """docs/known-divergences.md, fault 8: each rank's norm is judged against one device's."""
    case = TrainCase(model="mlp", mesh_shape=(1, 2), entry="ddp_mesh", habits=Habits(clip=0.01))
    for impl in ("torch", "reference"):
        verdict = verdict_one_device(tpdp_pool, impl, case, lambda signature: False)
        assert any(r.what == "gradient norm" and not r.err.ok for r in verdict.rows), (impl, verdict.report())


def test_clip_grad_norm_under_fsdp2_with_a_parameter_tp_leaves_whole_raises(tpdp_pool):
    case = TrainCase(model="llama", mesh_shape=(1, 2), entry="fully_shard", habits=Habits(clip=1000.0))
    verdict = verdict_one_device(tpdp_pool, "torch", case, lambda signature: False)
    assert "must have the same mesh" in verdict.report(), verdict.report()


def test_activation_checkpointing_under_ddp_meets_local_shards_with_a_transform_that_keeps_the_registry(tpdp_pool):
    """docs/known-divergences.md, fault 9: the reference raises; torch 2.13 escapes through fault 1."""
    case = TrainCase(model="mlp", mesh_shape=(1, 2), entry="transform_ddp", habits=Habits(checkpoint=True))
    assert "CheckpointError" in verdict_one_device(tpdp_pool, "reference", case, lambda signature: False).report()
    assert not any(c.name == "every rank trains without an exception" and not c.ok
                   for c in verdict_one_device(tpdp_pool, "torch", case, lambda signature: False).checks)


def test_a_block_called_directly_under_ddp_meets_local_shards_with_a_transform_that_keeps_the_registry(tpdp_pool):
    """docs/known-divergences.md, fault 9: the transform's hooks are the root's, so between
    forwards a TP block holds local shards; torch 2.13 escapes through fault 1 and its
    direct output is compared, and right, at every step."""
    case = TrainCase(model="mlp", mesh_shape=(1, 2), entry="ddp_mesh", steps=2, habits=Habits(between="submodule"))
    reference = verdict_one_device(tpdp_pool, "reference", case, lambda signature: False)
    assert "calling w2 directly between steps" in reference.report()
    assert "mixed torch.Tensor and DTensor" in reference.report()
    # a torch whose fix of fault 1 keeps the registry as the reference does is NEW to the gate:
    # on this very case torch 2.13 fails otherwise
    assert {c.part for c in reference.checks if not c.ok} - set(verdict_one_device(
        tpdp_pool, "torch", case, lambda signature: False).signature)
    verdict = verdict_one_device(tpdp_pool, "torch", case, lambda signature: False)
    direct = [r for r in verdict.rows if r.what == "direct output"]
    assert [r.step for r in direct] == [1, 2] and all(r.err.ok for r in direct), verdict.report()


@pytest.mark.parametrize("entry", ["fsdp1", "fully_shard", "replicate_fsdp"])
def test_a_block_called_directly_under_fsdp_raises_without_tp_too(tpdp_pool, entry):
    """The exclusion direct_call_under_fsdp: the wrapper's own contract, not the composition's."""
    case = TrainCase(model="mlp", mesh_shape=(2, 1), entry=entry, habits=Habits(between="submodule"))
    errors = {t.error for t in tpdp_pool.run(observe_plain_ddp, case)}
    assert all("calling w2 directly between steps" in e for e in errors), errors


def test_a_direct_output_is_put_back_from_tp_shards_and_judged():
    """Each dp group's tp pieces, shards along one dimension, against the oracle's rows (the
    case's: an SPMD batch that does not divide gives the groups rows unevenly); a wrong piece
    departs; pieces that make no oracle shape are a failing check."""
    case = TrainCase(mesh_shape=(2, 2))
    exact = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    groups = [[exact[:2, :3], exact[:2, 3:]], [exact[2:, :3], exact[2:, 3:]]]
    for pieces, ok in ((groups, True), ([groups[0], [exact[2:, :3], exact[2:, 3:] + 1]], False)):
        verdict = Verdict()
        _direct(1, ("w2", pieces), ("w2", exact), ("w2", exact), verdict, case)
        assert [r.err.ok for r in verdict.rows] == [ok] and all(c.ok for c in verdict.checks)
    verdict = Verdict()
    _direct(1, ("w2", [[exact[:2, :2]], [exact[2:, :2]]]), ("w2", exact), ("w2", exact), verdict, case)
    assert not verdict.rows and [c.ok for c in verdict.checks] == [False]
    short = dataclasses.replace(case, entry="dtensor", dp_mesh_dims="replicate", batch_short=1)
    verdict = Verdict()
    _direct(1, ("w2", [[exact[:2, :3], exact[:2, 3:]], [exact[2:3, :3], exact[2:3, 3:]]]), ("w2", exact[:3]),
            ("w2", exact[:3]), verdict, short)
    assert [r.err.ok for r in verdict.rows] == [True] and all(c.ok for c in verdict.checks)


def test_tp_keeps_requires_grad_meets_sequence_parallel_thawing(tpdp_pool, tpdp_profile):
    """Fault 7 as the gate's search meets it, shrunk to llama_sp with its first parameter (a
    SequenceParallel norm's weight) frozen; with every parameter frozen, exactly the zoo
    models whose plans use SequenceParallel thaw."""
    found, stats = divergences(tp_keeps_requires_grad, tpdp_pool, "torch", tpdp_profile)
    message, drawn = the_one(found, stats, "TP keeps requires_grad")
    assert drawn["case"].model == "llama_sp" and drawn["mask"] == 1, drawn
    assert "attention_norm.weight: requires_grad False before TP, True after" in message
    thawed = set()
    for model in ZOO:
        try:
            tp_keeps_requires_grad.fn(tpdp_pool, "torch", case=TrainCase(model=model, mesh_shape=(1, 2)),
                                      mask=2**24 - 1)
        except Divergence:
            thawed.add(model)
    assert thawed == {"llama_sp", "llama_lm"}


@pytest.mark.parametrize("mutant", mutants.TRAINING_MUTANTS, ids=lambda m: m.__name__)
def test_every_training_mutant_is_caught(tpdp_pools, tpdp_profile, mutant):
    """Found (not shrunk) within a minute, every distinct failure by the check the mutant
    breaks (its consequences may fail beside it): an exception anywhere would be caught
    too, and would say nothing about the properties' power."""
    start = time.monotonic()
    prop = narrowed(trains_like_one_device, entries=("transform_ddp",))
    found, _ = divergences(prop, tpdp_pools.get(4), f"mutants.{mutant.__name__}",
                            dataclasses.replace(tpdp_profile, shrink=False))
    assert all({signature.describe(signature.api(p)) for p in e.signature} & mutant.training_caught_by
               for e in found), found
    assert time.monotonic() - start < 60


def test_the_shipped_cover_cases_cover_every_case_space_of_the_suite_and_are_in_use():
    """Found once (python -m tpdp_verify.properties) for this hypothesis: a gate
    reads them rather than spending half a minute finding them again."""
    import json

    import hypothesis

    from tpdp_verify.properties import training

    doc = json.loads(training.FOUND.read_text())
    from tpdp_verify.properties import ALL

    assert doc["hypothesis"] == hypothesis.__version__, "regenerate: python -m tpdp_verify.properties"
    spaces = training.cover_spaces(ALL)
    assert {repr(s) for s in spaces} == set(doc["cases"])
    through = {f"mlp through {e}" for e in ENTRIES}
    assert all(set(models) == set(DRAWN) | through for models in doc["cases"].values())
    assert training.find_cover_cases(ALL, shipped=True) == doc["cases"]  # each one rebuilds from its repr
    found = [c for models in doc["cases"].values() for m, c in models.items() if c and m in DRAWN]
    assert len(found) >= len(spaces) * len(DRAWN) * 0.8  # most spaces reach most models


@pytest.mark.timeout(300)
def test_a_run_made_to_explain_a_failure_never_becomes_its_finding(tpdp_pools):
    """Only failures a baseline does not know are explained (run without TP), so what an
    explaining run meets must not be the case's signature. Here FSDP1 without TP aborts a
    rank (gloo: a collective whose sizes the ranks disagree on) where FSDP1 with TP raises in
    its forward: the case is the raise, the abort is said beside it (issue 24)."""
    from tpdp_verify.cases.training import Size

    case = TrainCase(model="frozen", size=Size(dim=3, hidden=20), mesh_shape=(2, 2), entry="fsdp1",
                     habits=Habits(clip=0.01, checkpoint=True, between="no_grad", set_to_none=True, ignored="trained"),
                     optimizer="adam", built="before_wrap", eval_first=True, steps=2, accumulate=2, local_batch=1,
                     seed=742, dtype="bfloat16")
    verdict = verdict_one_device(tpdp_pools.get(4), "torch", case)
    assert [signature.api(p) for p in verdict.signature] == \
        ["raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:forward"]
    assert verdict.plain_ddp.startswith("could not be run: rank") and "SIGABRT" in verdict.plain_ddp, verdict.plain_ddp


def test_the_spmd_form_trains_after_tp_under_fsdp2_as_on_fresh_ranks(tpdp_pools):
    """Fault 42: after TP under FSDP2 on the same ranks, DTensor's caches hand the SPMD
    form's parameters an equal mesh of that case's, which fully_shard's SPMD form refuses; the
    harness makes them on the mesh itself, as in a fresh process, so that no case's verdict
    depends on the cases before it."""
    from tpdp_verify import RankPool
    from tpdp_verify.cases.training import Size

    first = TrainCase(model="mlp", size=Size(dim=4, hidden=6), mesh_shape=(2, 2), entry="replicate_fsdp")
    spmd = dataclasses.replace(first, entry="fully_shard", dp_mesh_dims="shard")
    pool = tpdp_pools.get(4)
    verdict_one_device(pool, "torch", first)
    after = verdict_one_device(pool, "torch", spmd)
    with RankPool(4) as fresh:
        alone = verdict_one_device(fresh, "torch", spmd)
    assert alone.checks and "different mesh objects" not in after.report(), after.report()
    assert [(c.name, c.ok) for c in after.checks] == [(c.name, c.ok) for c in alone.checks]
