"""Known by replay (tpdp_verify.runner.replay): a failure is known when the baseline shows it
on the same case. The same code on both sides knows every failure, whatever the draw; a fault
planted in the candidate only is NEW, though the baseline file records its signature."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from tpdp_verify.properties import (chunk_tensor_metadata, registry_preserved, trains_like_one_device,
                                    trains_like_plain_ddp)
from tpdp_verify.runner import baseline, profiles, replay
from tpdp_verify.runner.gate import check_property
from tpdp_verify.runner.property import Stats

import torch_mutants

TESTS = Path(__file__).parent


def replayed(prop, pool, impl, profile, side, budget=600.0):
    stats = Stats()
    judge = replay.Replayed(side, prop, pool, stats, replay.Budget(budget))
    outcome = check_property(prop, pool, impl, profile, known=judge, stats=stats)
    return outcome, replay.judge([outcome])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("prop", [registry_preserved, trains_like_one_device], ids=lambda p: p.name)
def test_the_same_implementation_on_both_sides_knows_every_failure(tpdp_pools, prop, seed):
    profile = dataclasses.replace(profiles.get("smoke"), seed=seed)
    outcome, judged = replayed(prop, tpdp_pools.get(2), "torch", profile, replay.ImplSide("torch"))
    assert not judged.new and outcome.status == "known", outcome.findings
    assert outcome.stats.replays >= outcome.stats.known > 0  # torch 2.13 fails here: something was compared


@pytest.mark.timeout(600)
def test_a_fault_only_the_candidate_has_is_new_where_its_signature_is_known_elsewhere(tpdp_pools):
    mutant = torch_mutants.SyncGradHookScales
    parts = baseline.known_parts(baseline.load("torch-2.13.0")[1])[trains_like_plain_ddp.name]
    assert "value:gradient" in parts  # the shipped file records it elsewhere; replay tells the cases apart
    profile = dataclasses.replace(profiles.get("ci"), shrink=False)
    outcome, judged = replayed(trains_like_plain_ddp, tpdp_pools.get(2), f"torch_mutants.{mutant.__name__}",
                               profile, replay.ImplSide("torch"))
    assert outcome.status == "diverges" and judged.blocks
    assert any("value:gradient" in k.signature for k in judged.new), [k.signature for k in judged.new]
    assert all(f.replay for f in outcome.findings if f.status == "NEW")


@pytest.mark.timeout(300)
def test_overlapping_metadata_on_even_shards_is_new_though_torch_overlaps_uneven_ones(tpdp_pools):
    """torch 2.13 overlaps uneven shards' metadata; a regression that overlaps even ones is
    told apart by the replay of each case on torch, whatever the parts say."""
    profile = dataclasses.replace(profiles.get("release"), world_sizes=(2,), shrink=False)  # 200 cheap examples
    outcome, judged = replayed(chunk_tensor_metadata, tpdp_pools.get(2), "torch_mutants.ChunkBoxOffByOne",
                               profile, replay.ImplSide("torch"))
    assert judged.new and outcome.status == "diverges", outcome.findings
    even = [f.drawn["case"] for f in outcome.findings if f.status == "NEW"]
    assert even and all(c.shape[c.tp_placement.dim] % c.mesh_shape[-1] == 0 for c in even), even  # torch: no overlap


def test_a_spent_budget_still_replays_what_the_baseline_has_not_shown(tpdp_pools):
    """Once the budget is spent, only failures made of parts the baseline already showed are
    counted without a run; anything else is still run there."""
    runs = []

    class Side:
        def shows(self, prop, pool, drawn):
            runs.append(drawn)
            return ("check:a",)

    stats = Stats()
    judge = replay.Replayed(Side(), registry_preserved, tpdp_pools.get(2), stats, replay.Budget(0.0))
    assert judge(("check:a",), {"x": 1}) and len(runs) == 1  # nothing shown yet: it runs
    assert judge(("check:a",), {"x": 2}) and len(runs) == 1 and stats.by_parts == 1
    assert not judge(("check:a", "check:b"), {"x": 3}) and len(runs) == 2


def _gate(*args, cwd):
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(TESTS)}  # torch_mutants, toy_suite
    return subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=540)


@pytest.mark.timeout(600)
def test_baseline_python_replays_in_its_own_interpreter(tmp_path):
    """The toy suite fails the same way on both sides: every failure known, exit 0, and the
    replays counted in the report and the JSON."""
    out = _gate("--suite", "toy_suite", "--profile", "ci", "--seed", "3", "--baseline-python", sys.executable,
                "--json", str(tmp_path / "g.json"), cwd=TESTS)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "each failure's case replayed there" in out.stdout and "0 new" in out.stdout
    assert "replayed" in out.stdout and " failures on the baseline in " in out.stdout
    record = json.loads((tmp_path / "g.json").read_text())
    assert record["baseline"]["known"] > 0 and record["baseline"]["new"] == 0


@pytest.mark.timeout(600)
def test_baseline_python_reports_a_planted_fault_as_new(tmp_path):
    (tmp_path / "training_suite.py").write_text(
        "from tpdp_verify.properties import trains_like_one_device\nALL = (trains_like_one_device,)\n")
    out = _gate("--suite", "training_suite", "--profile", "smoke", "--impl", "torch_mutants.SyncGradHookScales",
                "--baseline-python", sys.executable, cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "NEW" in out.stdout and "gradient beyond its bound" in out.stdout


def test_baseline_python_that_cannot_run_is_one_line(tmp_path):
    out = _gate("--baseline-python", str(tmp_path / "nope"), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "not an executable" in out.stderr
    both = _gate("--baseline", "torch-2.13.0", "--baseline-impl", "torch", cwd=tmp_path)
    assert both.returncode == 2 and "two baselines" in both.stderr


def test_a_baseline_python_that_is_no_python_is_one_line(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho not a python >&2\nexit 7\n")
    fake.chmod(0o755)
    out = _gate("--baseline-python", str(fake), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "did not start the replay server" in out.stderr and "exit 7" in out.stderr
