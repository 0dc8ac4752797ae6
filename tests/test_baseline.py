"""Known means the baseline release shows the same failure on the same case: its answers
(asked by replay, remembered in a memo by the exact case), each failure judged by the answer
on its own case, the memo's failing cases rerun on the candidate (FIXED, CHANGED), and no
verdict where the release could not be asked."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.errors import UsageError
from tpdp_verify.fixtures.zoo import Size
from tpdp_verify.properties import EXCLUSIONS, registry_preserved, trains_like_one_device
from tpdp_verify.runner import memo, profiles
from tpdp_verify.runner.baseline import Baseline, release_of, status
from tpdp_verify.runner.gate import judged_search

CASE = TrainCase(model="frozen", size=Size(dim=3), mesh_shape=(2, 1))
TESTS = Path(__file__).parent


@pytest.mark.parametrize("spec", ["torch==2.13.0", "torch-2.13.0", "2.13.0", " torch == 2.13.0 "])
def test_a_release_is_named_as_pip_spells_it(spec):
    assert release_of(spec) == "2.13.0"


@pytest.mark.parametrize("spec", ["torch", "baseline.json", "torch>=2.13", ""])
def test_anything_else_is_one_line_saying_how_to_name_one(spec):
    with pytest.raises(UsageError, match=r"e\.g\. --baseline torch==2\.13\.0"):
        release_of(spec)


@pytest.mark.parametrize("shown, answer, expected", [
    (("check:a",), ("check:a",), "known"),
    (("check:a",), ("check:a", "check:b"), "known"),  # the release fails in more: the candidate's failure is its
    (("check:a",), (), "NEW"),  # the release passes this case
    (("check:a", "value:gradient"), ("check:a",), "NEW"),  # a fault added to the release's own
    (("raised:RuntimeError at x",), ("check:a",), "CHANGED"),  # the same case fails otherwise
    (("check:a",), None, "not asked"),
])
def test_a_failure_is_judged_by_the_releases_answer_on_its_own_case(shown, answer, expected):
    assert status(shown, answer) == expected


def _asked(prop="p", world_size=2, case=CASE, sig=("check:a",)):
    return memo.Asked.of(prop, world_size, {"case": case}, sig)


def test_a_memo_keeps_each_answer_by_its_exact_case_and_rebuilds_the_case(tmp_path):
    path = tmp_path / "m.json"
    m = memo.Memo("2.13.0")
    m.put(_asked())
    m.put(_asked(world_size=4, sig=()))
    m.put(_asked(case=dataclasses.replace(CASE, seed=CASE.seed + 1), sig=("check:b",)))
    assert m.save(path) == 3
    again = memo.Memo.load("2.13.0", [path])
    drawn = {"case": CASE}
    assert again.get("p", 2, drawn).signature == ("check:a",) and again.get("p", 4, drawn).signature == ()
    assert again.get("p", 2, drawn).drawn() == drawn
    assert again.get("q", 2, drawn) is None  # another property: never asked
    assert sorted(a.signature for a in again.failing("p", 2)) == [("check:a",), ("check:b",)]


def test_a_cases_identity_is_its_fields_a_field_added_with_a_default_keeps_every_answer(tmp_path, monkeypatch):
    """The key is the case's fields that differ from their defaults: a field the case space
    gains, with a default, changes no key (its printed form changes every one); an answer
    kept by an earlier identity is keyed anew from its case, rebuilt."""
    import dataclasses as dc

    from tpdp_verify.cases import training

    before = memo.key("p", 2, {"case": CASE})
    assert before == memo.key("p", 2, {"case": dc.replace(CASE)})
    assert before != memo.key("p", 2, {"case": dc.replace(CASE, seed=CASE.seed + 1)})
    grown = dc.make_dataclass("TrainCase", [("added", int, dc.field(default=0))], bases=(training.TrainCase,),
                              frozen=True)
    assert memo.key("p", 2, {"case": grown(**{f.name: getattr(CASE, f.name) for f in dc.fields(CASE)})}) == before
    from tpdp_verify.cases.training import Loss

    # fields printed late (repr=False) are the case too: left out, cases differing in them
    # collided, and one's answer stood for the other's (identity revision 1)
    with_loss = dc.replace(CASE, loss=Loss())
    assert len({memo.key("p", 2, {"case": c}) for c in
                (CASE, with_loss, dc.replace(with_loss, loss=Loss(logits="nchw")),
                 dc.replace(CASE, dp_mesh_dims="shard"))}) == 4
    old = dc.replace(_asked(), key="")  # as read from a memo without keys
    assert old.key == _asked().key
    monkeypatch.setattr(memo, "IDENTITY", memo.IDENTITY + 1)
    assert memo.key("p", 2, {"case": CASE}) != before  # another revision: the keys computed anew


def test_a_memo_of_another_release_or_harness_revision_answers_nothing(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    m = memo.Memo("2.13.0")
    m.put(_asked())
    m.save(path)
    assert not memo.Memo.load("2.14.1", [path]).answers
    monkeypatch.setattr(memo, "HARNESS", memo.HARNESS + 1)
    assert not memo.Memo.load("2.13.0", [path]).answers


def test_runs_adding_to_one_memo_keep_each_others_answers(tmp_path):
    path = tmp_path / "m.json"
    first, second = memo.Memo("2.13.0"), memo.Memo("2.13.0")
    first.put(_asked(prop="a"))
    second.put(_asked(prop="b"))
    first.save(path)
    assert second.save(path) == 2


def test_a_memo_that_is_no_memo_is_one_line(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("{not json")
    with pytest.raises(UsageError, match="delete it"):
        memo.Memo.load("2.13.0", [path])


def test_the_shipped_memo_holds_the_fixed_draws_and_every_case_rebuilds():
    held = memo.read(memo.shipped("2.13.0"), "2.13.0")
    assert held and {a.property for a in held} >= {p.name for p in (registry_preserved, trains_like_one_device)}
    assert {a.world_size for a in held} >= {2, 4}  # smoke and ci at least
    for asked in held[::50]:
        assert asked.drawn(), asked


@pytest.mark.timeout(300)
def test_the_fixed_draw_needs_no_replay_the_shipped_memo_answers_it(tpdp_pools, tmp_path):
    """The candidate is another implementation (torch's functions through the mutants'
    sites: the same code), so only the memo or a replay can answer; the memo does, for
    every failure of the fixed draw."""
    release = Baseline("2.13.0", install=False, memo_path=tmp_path / "m.json")
    outcome = judged_search(registry_preserved, tpdp_pools.get(2), "torch_mutants.TorchReference",
                            profiles.get("smoke"), release)
    assert outcome.status == "known" and outcome.stats.known > 0, outcome.findings
    assert release.asking.memo > 0 and release.asking.replays == 0


@pytest.mark.timeout(300)
def test_a_fault_the_candidate_no_longer_has_is_fixed(tpdp_pools, tmp_path):
    """The reference transform keeps the registry that torch 2.13 loses: the memo's failing
    cases of registry_preserved, run on it, pass: FIXED, which does not block."""
    release = Baseline("2.13.0", install=False, memo_path=tmp_path / "m.json")
    outcome = judged_search(registry_preserved, tpdp_pools.get(2), "reference", profiles.get("smoke"), release)
    fixed = [f for f in outcome.findings if f.status == "FIXED"]
    assert fixed and outcome.status != "diverges" and outcome.stats.reran + len(outcome.stats.ran) > 0, \
        outcome.findings
    assert all("the candidate passes" in f.failure and f.replay for f in fixed)


@pytest.mark.timeout(300)
def test_a_memo_case_the_candidate_fails_otherwise_is_changed(tpdp_pools, tmp_path):
    """A memo answer that says the release fails a case in a check the candidate does not
    fail: the same code now fails it otherwise, CHANGED, which blocks."""
    release = Baseline("2.13.0", install=False, memo_path=tmp_path / "m.json")
    mine = release.memo.failing(registry_preserved.name, 2)[0]
    release.memo.answers[mine.key] = dataclasses.replace(mine, signature=("check:a-check-it-never-had",))
    outcome = judged_search(registry_preserved, tpdp_pools.get(2), "torch_mutants.TorchReference",
                            profiles.get("smoke"), release)
    changed = [f for f in outcome.findings if f.status == "CHANGED"]
    assert changed and outcome.status == "diverges", outcome.findings


@pytest.mark.timeout(300)
def test_reruns_stop_at_their_budget_and_say_how_many_were_left(tpdp_pools, tmp_path):
    release = Baseline("2.13.0", install=False, memo_path=tmp_path / "m.json")
    profile = dataclasses.replace(profiles.get("smoke"), seed=12345, rerun_total=0.0)  # meets none of the memo's
    outcome = judged_search(registry_preserved, tpdp_pools.get(2), "torch_mutants.TorchReference", profile, release)
    assert outcome.stats.not_rerun > 0 and outcome.stats.reran == 0


def _gate(*args, cwd=TESTS):
    import os

    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=580)


@pytest.mark.timeout(600)
def test_the_smoke_gate_passes_against_the_release_with_no_environment(smoke_against_the_release):
    """Every property draws its full budget past torch's known faults, and the files a CI
    reads agree with the exit code (the run: conftest's smoke_against_the_release)."""
    import xml.etree.ElementTree as ET

    out, files = smoke_against_the_release, smoke_against_the_release.dir
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " 0 new, 0 changed, " in out.stdout
    record = json.loads((files / "gate.json").read_text())
    assert record["exit_code"] == 0 and record["counts"]["known"] > 0 and record["counts"]["diverges"] == 0
    assert record["baseline"]["name"] == "torch==2.13.0" and not record["baseline"]["blocks"]
    assert all(p["drawn"] == p["wanted"] == 10 and not p["drew_fewer"] for p in record["properties"])
    assert sum(p["known_only"] for p in record["properties"]) > 0  # the search went on past them
    assert {f["status"] for p in record["properties"] for f in p["findings"]} <= {"known"}
    assert record["not_searched"] and f"not searched: {len(EXCLUSIONS)} regions of the case space" in out.stdout
    catalog = record["catalog"]  # every known failure named by a catalogued fault
    assert catalog["known"] > 0 and catalog["explained"] == catalog["known"] and not catalog["unexplained"], catalog
    assert f"the fault catalog explains {catalog['known']} of {catalog['known']} known failures" in out.stdout
    assert all(f["faults"] for p in record["properties"] for f in p["findings"])
    assert len(out.stdout.splitlines()) < 60  # known only: it fits in a screen
    suite = ET.parse(files / "junit.xml").getroot().find("testsuite")
    assert (suite.get("failures"), suite.get("errors")) == ("0", "0")


@pytest.mark.timeout(600)
def test_a_broken_transform_blocks_against_the_release(tmp_path):
    """The reference with every sharded gradient scaled by 1 + 1e-3: torch 2.13.0 does not
    fail so on those cases (it passes them: NEW; it loses the registry there, which the
    reference keeps: CHANGED), so the gate blocks with them listed; the faults of 2.13.0 the
    reference does not have are FIXED, a line each way. `report` drafts the issue of the
    first blocking finding from its shrunk case, and names no torch fault for its gradient."""
    out = _gate("--impl", "mutants.ScalesGradientUp", "--baseline", "torch==2.13.0", "--no-install",
                "-k", "trains_like_one_device or registry_preserved", "--json", str(tmp_path / "gate.json"))
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-2000:]
    # which example the time-bounded shrinking ends on (NEW or CHANGED) depends on the machine's
    # load, and a finding's line is cut to the terminal: its signature is the record's
    record = json.loads((tmp_path / "gate.json").read_text())
    assert any(f["status"] in ("NEW", "CHANGED") and "value:gradient" in f["signature"]
               for p in record["properties"] if p["name"] == "trains_like_one_device" for f in p["findings"]), \
        out.stdout[-4000:]
    assert re.search(r"against the baseline: \d+ new, \d+ changed, [1-9]\d* fixed, .*: blocks", out.stdout)
    drafted = subprocess.run([sys.executable, "-m", "tpdp_verify", "report", str(tmp_path / "gate.json")],
                             capture_output=True, text=True, timeout=120)
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout.startswith("title: [DTensor] ") and "The shrunk case:" in drafted.stdout
    assert "No catalogued fault explains: " in drafted.stdout and "value:gradient" in drafted.stdout


@pytest.mark.timeout(600)
def test_a_release_that_cannot_be_asked_is_no_verdict_never_known_nor_new(tmp_path):
    """torch 2.12.1: no memo ships for it, it is not installed here, and --no-install: every
    failure is not asked, said in the summary, exit 4."""
    (tmp_path / "one.py").write_text("from tpdp_verify.properties import registry_preserved\n"
                                     "ALL = (registry_preserved,)\n")
    out = _gate("--suite", "one", "--baseline", "torch==2.12.1", "--no-install", "--json",
                str(tmp_path / "g.json"), cwd=tmp_path)
    assert out.returncode == 4, out.stdout[-3000:] + out.stderr[-2000:]
    assert "no environment of torch 2.12.1 (--no-install)" in out.stdout and "not asked" in out.stdout
    record = json.loads((tmp_path / "g.json").read_text())
    assert record["baseline"]["not_asked"] > 0 and record["baseline"]["new"] == record["baseline"]["known"] == 0


@pytest.mark.timeout(300)
def test_a_release_that_cannot_be_installed_is_one_line_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """No such torch on the index: one line that says what to do, no half-made environment
    (the next run tries again), and the baseline then answers nothing: not asked."""
    from tpdp_verify.runner import provision

    monkeypatch.setenv("TPDP_VERIFY_CACHE", str(tmp_path))
    said = []
    with pytest.raises(UsageError, match=r"could not install torch==0\.0\.1 .*--baseline-python PATH"):
        provision.environment("0.0.1", said.append)
    assert said and said[0].startswith("baseline: installing torch==0.0.1 once into ")
    assert not provision.where("0.0.1").exists()
    release = Baseline("0.0.1", memo_path=tmp_path / "m.json", progress=said.append)
    assert release.side() is None and "could not install torch==0.0.1" in release.unavailable


def test_a_compressed_memo_reads_as_the_plain_one_and_writes_the_same_bytes_twice(tmp_path):
    m = memo.Memo("2.13.0")
    m.put(_asked())
    plain, packed = tmp_path / "m.json", tmp_path / "m.json.gz"
    m.save(plain)
    m.save(packed)
    first = packed.read_bytes()
    m.save(packed)
    assert packed.read_bytes() == first and len(first) < plain.stat().st_size
    assert memo.Memo.load("2.13.0", [packed]).answers == memo.Memo.load("2.13.0", [plain]).answers
