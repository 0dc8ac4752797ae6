"""The gate's power on torch's own code: a regression planted in torch's transform blocks
against torch 2.13.0 (NEW, or CHANGED where 2.13.0 fails the same case otherwise), judged by replay on the unmutated release (the shipped memo, else a
run of the case on torch 2.13.0 in this interpreter), even where it only shows in cases
that also show a known fault (every DDP case loses the registry on 2.13: the gradient
mutant's cases).

The whole table (every mutant, the ci profile, both world sizes) is in docs/performance.md
(bench/bench_torch_mutants.py); these are a few of its rows, each on the property that
must catch it, with the ci profile's budget.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpdp_verify.properties import (checkpoint_resumes, chunk_tensor_metadata, entry_points_train_like_one_device,
                                    fused_projections_read_back,
                                    flatten_roundtrip, ignored_params_untouched, losses_train_like_one_device,
                                    miswiring_refused_or_exact, nested_shards_read_back, paths_resolve,
                                    trains_like_one_device,
                                    trains_like_plain_ddp)
from tpdp_verify import signature
from tpdp_verify.cases.training import TrainCase
from tpdp_verify.properties.losses import EDGE_SIZE, EDGES, SPMD_EDGES
from tpdp_verify.properties.training import uneven_batches
from tpdp_verify.runner import profiles
from tpdp_verify.runner.baseline import Baseline
from tpdp_verify.runner.gate import judged_search

import torch_mutants


def judged(prop, pool, mutant, drawn: int | None = None):
    """The mutant's search at ci (unshrunk: the search's power, not shrinking's), judged by
    torch 2.13.0 on each failure's own case; the memo's other failing cases are not rerun
    (that is how FIXED is found: tests/test_baseline.py). ``drawn``: fewer drawn cases than
    ci's, where the property's cover cases (run whatever the profile) must catch the mutant."""
    ci = profiles.get("ci")
    profile = dataclasses.replace(ci, shrink=False, rerun_total=0.0, max_examples=drawn or ci.max_examples)
    release = Baseline("2.13.0", install=False)
    assert not release.is_candidate(f"torch_mutants.{mutant.__name__}")  # judged by replay, not by itself
    try:
        return judged_search(prop, pool, f"torch_mutants.{mutant.__name__}", profile, release)
    finally:
        release.close()


def new(outcome, part=None):
    """The findings that block, with ``part`` (a raised part by its API, whatever its
    message): NEW where 2.13.0 passes the case, CHANGED where it fails it otherwise (a
    different error, other checks)."""
    return [f for f in outcome.findings if f.status in ("NEW", "CHANGED")
            and (part is None or part in {signature.api(p) for p in f.signature})]


# the mutants whose cases the cover phase reaches (properties/losses.py EDGES): one drawn case
BY_COVER = {torch_mutants.IgnoredTargetsCountedInTheMean: 1, torch_mutants.ClassWeightsLeftOutOfTheBackward: 1,
            torch_mutants.MaxNormSummedOverShards: 1, torch_mutants.DPReducedInParamDtype: 1,
            torch_mutants.SoftmaxBackwardKeepsTheShard: 1, torch_mutants.FusedBackwardScaledUnderMean: 1,
            torch_mutants.FusedBackwardScaledUnderSum: 1, torch_mutants.FusedBackwardScaledUnderNone: 1,
            torch_mutants.BatchSumAveragedOverDP: 1, torch_mutants.ParallelCrossEntropyGradScales: 1}


def at_the_edges(prop):
    """The loss property with the part of its cover phase that its loss mutants are planted
    for: each kind of loss at its edges (properties/losses.py EDGES through FSDP2, SPMD_EDGES
    through DTensor alone), where torch 2.13 trains exactly. Not each model's simplest case
    with every kind, on which the release fails first (most of a run's time there)."""
    edges = [*EDGES.values(), *SPMD_EDGES.values()]

    def cover(strategies):
        cases = [c for c in prop.cover(strategies) if c["case"].size == EDGE_SIZE and c["case"].loss in edges]
        assert len(cases) >= len(edges), cases  # each edge among the gate's cover cases
        return cases

    return dataclasses.replace(prop, cover=cover)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mutant, prop, part", [
    (torch_mutants.SyncGradHookScales, trains_like_one_device, "value:gradient"),
    (torch_mutants.UnflattenDropsShapeAndStride, trains_like_one_device, "crash:SIGABRT"),
    (torch_mutants.LocalizeForgetsIgnored, ignored_params_untouched,
     "check:ignored-and-plain-parameters-stay-untouched"),
    (torch_mutants.FlattenReturnsTheFullTensor, flatten_roundtrip, "check:local-has-the-shape-of-t-s-shard"),
    # overlapping metadata on even shards, which ShardedTensor refuses: the ValueError torch
    # 2.13 raises on uneven shards, or where FSDP's group is more than one rank
    (torch_mutants.ChunkBoxOffByOne, chunk_tensor_metadata,
     "raised:ValueError at torch/distributed/tensor/parallel/fsdp.py:chunk_tensor"),
    # beside fault 15 (a KL loss's gradients under loss_parallel), in the losses that go
    # through cross entropy's sharded backward
    (torch_mutants.ParallelCrossEntropyGradScales, losses_train_like_one_device, "value:gradient"),
    # loss_parallel's own branches, each with a mean over a sample's tokens, which the cover
    # cases reach through FSDP2 (properties/losses.py EDGES): the padding counted in the mean,
    # and the class weights left out of the fused backward
    (torch_mutants.IgnoredTargetsCountedInTheMean, losses_train_like_one_device, "value:loss"),
    (torch_mutants.ClassWeightsLeftOutOfTheBackward, losses_train_like_one_device, "value:gradient"),
    # the fused backward off under one reduction alone: each reduction's edge through FSDP2
    # reaches it where torch 2.13 is exact (issue 52)
    (torch_mutants.FusedBackwardScaledUnderMean, losses_train_like_one_device, "value:gradient"),
    (torch_mutants.FusedBackwardScaledUnderSum, losses_train_like_one_device, "value:gradient"),
    (torch_mutants.FusedBackwardScaledUnderNone, losses_train_like_one_device, "value:gradient"),
    # DTensor's nll_loss reducing a batch's sum as a mean over the dp ranks: the SPMD edges'
    # batch losses through DTensor alone, where torch 2.13 is exact (issue 49)
    (torch_mutants.BatchSumAveragedOverDP, losses_train_like_one_device, "value:loss"),
    # softmax's backward summing over each rank's own shard of the vocabulary, which only a
    # gradient arriving vocab-sharded meets (the edge's expected cost; issue 42)
    (torch_mutants.SoftmaxBackwardKeepsTheShard, losses_train_like_one_device, "value:gradient"),
    # each rank's total norm left unreduced, where torch 2.13 clips exactly (FSDP2 over a plan
    # that shards every parameter over tp: the cover cases clip the MLP both ways, by 1e-2):
    # each rank clips by its own norm, so the clipped gradients depart first
    (torch_mutants.NormLeftPerRank, entry_points_train_like_one_device, "value:gradient"),
    # the max norm's shards summed, not maxed, where torch 2.13 clips exactly by it: the
    # cover cases clip by each norm through fully_shard over dp alone (issue 42)
    (torch_mutants.MaxNormSummedOverShards, entry_points_train_like_one_device, "value:gradient"),
    # FSDP2's reduce-scatter in bfloat16 where the policy asks float32: the cover cases
    # reduce a step's gradients over dp alone under the policy (issue 42)
    (torch_mutants.DPReducedInParamDtype, trains_like_plain_ddp, "check:dp-sums-gradients-in-the-reduce-dtype"),
    # an accumulated gradient's TP sum in bfloat16, on the path torch 2.13 sums in float32
    # (beside fault 16, its step's gradients summed in bfloat16)
    (torch_mutants.AccumulatedGradReducedInParamDtype, trains_like_plain_ddp,
     "check:tp-sums-gradients-accumulated-over-microbatches-in-the-reduce-dtype"),
    # every TP parameter gone from its module: a failed check of the modules the edit leaves,
    # never the harness's error (issue 42; the gate's exit code for such an edit: below)
    (torch_mutants.UpdateSkipsSetattr, paths_resolve, None),
], ids=lambda v: getattr(v, "__name__", getattr(v, "name", v)))
def test_a_regression_in_torch_is_new_against_the_release(tpdp_pools, mutant, prop, part):
    if mutant in BY_COVER and prop is losses_train_like_one_device:
        prop = at_the_edges(prop)
    outcome = judged(prop, tpdp_pools.get(2), mutant, drawn=BY_COVER.get(mutant))
    assert outcome.status == "diverges" and new(outcome, part), outcome.findings
    assert all(f.replay for f in new(outcome))


@pytest.mark.timeout(600)
def test_a_gradient_fault_of_fsdp1_alone_is_new_where_another_entry_point_departs_in_gradients(tpdp_pools):
    """torch 2.13 departs in gradients under some entry points (replicate on the tied model,
    FSDP1 on the tied, uneven and sequence-parallel models); a regression scaling FSDP1 +
    TP's gradients by 1 + 1e-3 is NEW on FSDP1's cases, where 2.13 keeps its gradients."""
    outcome = judged(entry_points_train_like_one_device, tpdp_pools.get(4), torch_mutants.FSDP1GradScales)
    found = new(outcome, "value:gradient")
    assert found and all(f.drawn["case"].entry == "fsdp1" for f in found), outcome.findings


@pytest.mark.timeout(300)
def test_a_merged_gather_on_the_wrong_mesh_is_new_where_the_release_reads_nested_shards_back(tpdp_pools):
    """DTensor's merged gather of a dim sharded over two mesh dims, run over the root mesh's
    first dim instead of their flattened submesh: NEW on the ci draw's nested layouts that
    torch 2.13 reads back exactly (the even ones; fault 34 is the uneven ones; issue 49)."""
    outcome = judged(nested_shards_read_back, tpdp_pools.get(4), torch_mutants.MergedGatherOnTheRootMesh)
    assert new(outcome, "check:full_tensor-gives-t"), outcome.findings


@pytest.mark.timeout(300)
def test_a_mean_over_uneven_shards_taken_as_linear_is_new_on_the_uneven_batches(tpdp_pools):
    """DTensor's mean over an unevenly sharded dim taken as the mean of the ranks' means: NEW
    on the SPMD batches of 3 rows over 2 dp ranks, which torch 2.13 trains exactly (issue 49);
    the property's other cover cases are not run (uneven_batches' are the ones that meet it)."""
    prop = dataclasses.replace(entry_points_train_like_one_device, cover=lambda strategies: [
        {"case": c} for c in uneven_batches([TrainCase(mesh_shape=(1, 2), entry="fully_shard")])])
    outcome = judged(prop, tpdp_pools.get(2), torch_mutants.UnevenMeanTakenAsLinear, drawn=1)
    found = new(outcome, "value:loss")
    assert found and all(f.drawn["case"].batch_short for f in found), outcome.findings


@pytest.mark.timeout(300)
def test_a_checkpoint_chunk_of_swapped_sizes_and_offsets_is_new_where_the_release_checkpoints(tpdp_pools):
    """DCP's chunk of a DTensor's shard with its sizes and offsets swapped: NEW at ci on the
    unfused weights torch 2.13 checkpoints exactly (fault 35 fails the fused ones; issue 49)."""
    outcome = judged(fused_projections_read_back, tpdp_pools.get(2), torch_mutants.ChunkSizesAndOffsetsSwapped)
    assert new(outcome), outcome.findings
    assert all(f.drawn["case"].parts == 1 for f in new(outcome)), outcome.findings


@pytest.mark.timeout(600)
def test_a_five_percent_gradient_fault_of_bfloat16_cases_alone_is_new(tpdp_pools):
    """A scaling of 1.05 is 6 units of a bfloat16's last place, inside the 32 of the max
    bound: the first step's gradients judged as whole tensors catch it (issue 29)."""
    outcome = judged(trains_like_one_device, tpdp_pools.get(2), torch_mutants.BFloat16GradScales)
    found = new(outcome, "value:gradient")
    assert found and all(f.drawn["case"].dtype == "bfloat16" for f in found), outcome.findings


@pytest.mark.timeout(600)
def test_gradients_one_percent_too_large_after_a_load_are_new(tpdp_pools):
    """A regression that scales gradients by 1.01 once a model has loaded a checkpoint: only
    the resumed step departs, through FSDP1 (the one entry point whose checkpoints load
    through the transform on torch 2.13), which the cover cases reach at dp x tp whatever
    the draw. DP alone resumes within an ulp at world size 4, which excuses only a departure
    no larger (issue 29)."""
    outcome = judged(checkpoint_resumes, tpdp_pools.get(4), torch_mutants.LoadedGradScales, drawn=1)
    found = new(outcome)
    assert found and all(f.drawn["case"].entry == "fsdp1" for f in found), outcome.findings
    assert all(any("the-resumed" in p for p in f.signature) for f in found)


@pytest.mark.timeout(600)
def test_an_exception_before_the_first_step_that_is_not_a_refusal_is_new(tpdp_pools):
    """A miswired case is refused only by an error about the mesh or group; a regression
    that raises about anything else while wrapping is NEW (issue 29)."""
    outcome = judged(miswiring_refused_or_exact, tpdp_pools.get(4), torch_mutants.FlattenRefusesViews)
    found = new(outcome)
    assert found and all("check:refuses-a-miswiring-before-training-or-trains-exactly" in f.signature
                         for f in found), outcome.findings
    # the planted error itself, and where it makes FSDP1's wrapping fail otherwise on the memo's cases
    assert any("contiguous local tensor" in f.failure for f in found), [f.failure for f in found]


@pytest.mark.timeout(600)
def test_an_edit_that_unregisters_parameters_blocks_the_gate_as_its_finding(tmp_path):
    """The gate at ci, as a user runs it: exit 1 with the edit NEW by replay on 2.13.0, never
    exit 3 (the harness's own error) on the modules the edit leaves (issue 42). One such
    edit here; UpdateSkipsSetattr's search is judged in process above, and each such edit
    through every property in tests/test_totality.py."""
    mutant, prop = torch_mutants.LocalizeKeepsPlainTensors, "ignored_params_untouched"
    out = subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", "--profile", "ci", "--impl",
                          f"torch_mutants.{mutant.__name__}", "--baseline", "torch==2.13.0", "--no-install", "-k", prop,
                          "--json", str(tmp_path / "gate.json")], capture_output=True, text=True, timeout=580,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    record = json.loads((tmp_path / "gate.json").read_text())
    found = [f for p in record["properties"] for f in p["findings"] if f["status"] == "NEW"]
    assert {p["world_size"] for p in record["properties"] if any(f["status"] == "NEW" for f in p["findings"])} == {2, 4}
    assert all(f["replay"] for f in found) and record["counts"]["infra"] == 0, found


@pytest.mark.timeout(300)
def test_another_error_under_the_same_api_on_a_case_the_release_fails_is_changed(tpdp_pools):
    """A hurried fix of fault 24 that gathers the class weights by the flattened target
    raises in ``backward``, where 2.13 raises fault 24's own error on the same case: the
    errors differ, so CHANGED; on the case with class weights alone, where 2.13 is exact,
    NEW (issue 42)."""
    from tpdp_verify.properties.losses import EDGES, every_loss
    from tpdp_verify.runner.baseline import status
    from tpdp_verify.runner.replay import run_case

    pool, prop = tpdp_pools.get(2), losses_train_like_one_device
    strategies = {k: s(2) if callable(s) else s for k, s in prop.strategies.items()}
    weighted = next(c["case"] for c in every_loss(strategies) if c["case"].loss == EDGES["class weights, mean"])
    padded = dataclasses.replace(weighted, loss=dataclasses.replace(weighted.loss, ignore_index=True))
    impl = f"torch_mutants.{torch_mutants.WeightsGatheredByTheFlatTarget.__name__}"
    release = Baseline("2.13.0", install=False)
    try:
        judged_as = {}
        for name, case in (("weighted", weighted), ("padded", padded)):
            shown = run_case(prop, pool, impl, {"case": case})
            answer = release.answer(prop, pool, impl, {"case": case}, shown)
            judged_as[name] = (status(shown, answer), shown, answer)
    finally:
        release.close()
    assert judged_as["weighted"][0] == "NEW" and judged_as["weighted"][2] == (), judged_as
    said, shown, answer = judged_as["padded"]
    assert said == "CHANGED", judged_as
    assert [signature.api(p) for p in shown] == [signature.api(p) for p in answer], judged_as  # one API
    assert "out of bounds" in answer[0] and "same number of dimensions" in shown[0], judged_as
