"""Known by replay: a failure is known when the baseline release shows it on the same case.
The same code on both sides knows every failure, whatever the draw; a fault planted in the
candidate only is NEW, though the release fails in the same checks on other cases; the
release's environment is another interpreter (``--baseline-python``) or this one where it
holds that release."""

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from tpdp_verify.properties import chunk_tensor_metadata, registry_preserved, trains_like_one_device, \
    trains_like_plain_ddp
from tpdp_verify.runner import profiles
from tpdp_verify.runner.baseline import Baseline
from tpdp_verify.runner.gate import judged_search

TESTS = Path(__file__).parent


def replayed(prop, pool, impl, profile, tmp_path):
    """The search judged by torch 2.13.0, asked afresh: no memo but the one this run writes."""
    release = Baseline("2.13.0", install=False, memo_path=tmp_path / "memo.json")
    release.memo.answers.clear()  # nothing shipped or remembered: every answer is a replay
    try:
        return judged_search(prop, pool, impl, profile, release), release
    finally:
        release.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("prop", [registry_preserved, trains_like_one_device], ids=lambda p: p.name)
def test_the_same_code_on_both_sides_knows_every_failure_at_any_seed(tpdp_pools, prop, seed, tmp_path):
    """torch's transform installed through the mutants' sites (another implementation, so each
    failure is replayed on torch itself) is known everywhere, at seeds no memo holds."""
    profile = dataclasses.replace(profiles.get("smoke"), seed=seed)
    outcome, release = replayed(prop, tpdp_pools.get(2), "torch_mutants.TorchReference", profile, tmp_path)
    assert outcome.status == "known" and not [f for f in outcome.findings if f.blocks], outcome.findings
    assert release.asking.replays >= outcome.stats.known > 0  # torch 2.13 fails here: something was compared
    assert json.loads((tmp_path / "memo.json").read_text())["asked"]  # remembered for the next run


@pytest.mark.timeout(600)
def test_a_fault_only_the_candidate_has_is_new_though_the_release_fails_alike_elsewhere(tpdp_pools, tmp_path):
    profile = dataclasses.replace(profiles.get("ci"), shrink=False)
    outcome, _ = replayed(trains_like_plain_ddp, tpdp_pools.get(2), "torch_mutants.SyncGradHookScales", profile,
                          tmp_path)
    new = [f for f in outcome.findings if f.status == "NEW"]
    assert outcome.status == "diverges" and any("value:gradient" in f.signature for f in new), outcome.findings
    assert all(f.replay for f in new)


@pytest.mark.timeout(300)
def test_overlapping_metadata_on_even_shards_is_new_though_torch_overlaps_uneven_ones(tpdp_pools, tmp_path):
    """torch 2.13 overlaps uneven shards' metadata; a regression that overlaps even ones is
    told apart by the replay of each case on torch: where torch passes the case, NEW; where
    it fails it otherwise (it misses the local shard in some even cases' metadata), CHANGED."""
    profile = dataclasses.replace(profiles.get("release"), world_sizes=(2,), shrink=False)  # 200 cheap examples
    outcome, _ = replayed(chunk_tensor_metadata, tpdp_pools.get(2), "torch_mutants.ChunkBoxOffByOne", profile,
                          tmp_path)
    even = [f.drawn["case"] for f in outcome.findings if f.status in ("NEW", "CHANGED")]
    assert outcome.status == "diverges" and even, outcome.findings
    assert all(c.shape[c.tp_placement.dim] % c.mesh_shape[-1] == 0 for c in even), even  # torch: no overlap


def _gate(*args, cwd, **env):
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(TESTS), **env}  # torch_mutants, toy_suite
    return subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=540)


@pytest.mark.timeout(600)
def test_baseline_python_replays_in_its_own_interpreter(tmp_path):
    """The toy suite fails the same way on both sides: every failure known, exit 0, and the
    replays counted in the report and the JSON."""
    out = _gate("--suite", "toy_suite", "--profile", "ci", "--seed", "3", "--baseline", "torch==2.13.0",
                "--baseline-python", sys.executable, "--json", str(tmp_path / "g.json"), cwd=TESTS)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "0 new" in out.stdout and " replayed there (" in out.stdout
    record = json.loads((tmp_path / "g.json").read_text())
    assert record["baseline"]["known"] > 0 and record["baseline"]["new"] == 0


@pytest.mark.timeout(600)
def test_baseline_python_reports_a_planted_fault_as_new(tmp_path):
    (tmp_path / "training_suite.py").write_text(
        "from tpdp_verify.properties import trains_like_one_device\nALL = (trains_like_one_device,)\n")
    out = _gate("--suite", "training_suite", "--profile", "smoke", "--impl", "torch_mutants.SyncGradHookScales",
                "--baseline", "torch==2.13.0", "--baseline-python", sys.executable, "--json", "gate.json", cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    new = [f["kind"] for p in json.loads((tmp_path / "gate.json").read_text())["properties"] for f in p["findings"]
           if f["status"] == "NEW"]
    assert "NEW" in out.stdout and any("gradient beyond its bound" in kind for kind in new), new


def test_baseline_python_that_cannot_run_is_one_line(tmp_path):
    out = _gate("--baseline", "torch==2.13.0", "--baseline-python", str(tmp_path / "nope"), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "not an executable" in out.stderr
    alone = _gate("--baseline-python", sys.executable, cwd=tmp_path)
    assert alone.returncode == 2 and "give --baseline torch==X.Y.Z too" in alone.stderr


def test_a_baseline_python_that_is_no_python_is_one_line(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho not a python >&2\nexit 7\n")
    fake.chmod(0o755)
    out = _gate("--baseline", "torch==2.13.0", "--baseline-python", str(fake), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "did not start the replay server" in out.stderr and "exit 7" in out.stderr


def bare_python(where: Path) -> str:
    """A python with this environment's packages (torch 2.13.0) but not tpdp-verify: how
    another release's environment looks to the replay server."""
    import subprocess
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = str(where / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # no .pth of it runs
    return python


@pytest.mark.timeout(600)
def test_a_baseline_python_replays_from_the_checkouts_root(tmp_path):
    """From the project's root, where make demo points, the replay server once imported the
    checkout's tpdp_verify folder (no properties in it) and its ranks died at start-up. Here
    a python without tpdp-verify replays a fresh seed's failures, run from that root; the
    cache is the test's own, so no earlier run's answer stands in for a replay."""
    out = _gate("--profile", "smoke", "-k", "chunk_tensor_metadata", "--seed", "20261127", "--baseline",
                "torch==2.13.0", "--baseline-python", bare_python(tmp_path / "bare"), cwd=TESTS.parent,
                TPDP_VERIFY_CACHE=str(tmp_path / "cache"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    replayed = re.search(r"(\d+) replayed there \(", out.stdout)
    assert replayed and int(replayed[1]) > 0 and ": passes" in out.stdout, out.stdout[-3000:]
