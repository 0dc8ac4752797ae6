"""Known divergences: a run sorted by a baseline into known, new, changed and fixed."""

import json
import re
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from tpdp_verify import signature
from tpdp_verify.cases.tensors import FSDPCase, TensorCase
from tpdp_verify.cases.training import TrainCase
from tpdp_verify.errors import UsageError
from tpdp_verify.fixtures.zoo import Size
from tpdp_verify.runner import baseline
from tpdp_verify.runner.gate import Finding, Outcome

CASE = TrainCase(model="frozen", size=Size(dim=3), mesh_shape=(2, 1))
REGISTRY, GRADIENT = "check:parameters-stay-registered-in-order", "value:gradient"
HERE = "ddp_mesh frozen dp"  # CASE's region: its entry point, model and mesh kind


def diverges(prop, *parts, world_size=2, case=CASE, status=""):
    return Outcome(prop, world_size, "diverges", 1.0, findings=[
        Finding(f"{parts[0]}: departs\nmore", "", "", {"case": case}, tuple(parts), status)])


def passes(prop, world_size=2):
    return Outcome(prop, world_size, "pass", 1.0)


def test_entries_round_trip_through_a_file_and_rebuild_the_case(tmp_path):
    path = tmp_path / "b.json"
    assert baseline.write(str(path), [diverges("p", REGISTRY, GRADIENT), passes("q")], "ci", "torch") == 1
    header, known = baseline.load(str(path))
    assert header["profile"] == "ci" and [k.key for k in known] == [("p", 2, HERE, (REGISTRY, GRADIENT))]
    assert known[0].drawn() == {"case": CASE} and known[0].summary == f"{REGISTRY}: departs"


def test_a_file_learned_with_two_profiles_says_both(tmp_path):
    path = str(tmp_path / "b.json")
    baseline.write(path, [diverges("p", REGISTRY)], "ci", "torch")
    baseline.write(path, [diverges("p", REGISTRY)], "smoke", "torch", baseline.load(path)[1])
    assert baseline.load(path)[0]["profile"] == "ci, smoke"
    baseline.write(path, [diverges("p", REGISTRY)], "ci", "torch")
    assert baseline.load(path)[0]["profile"] == "ci, smoke"  # no profile twice


def test_a_run_is_sorted_into_known_new_changed_fixed_and_not_run():
    listed = baseline.entries([diverges("a", "K"), diverges("b", "K"), diverges("c", "K"), diverges("d", "K"),
                               diverges("e", "K", world_size=8)])
    # what the searches met: a's known failure (counted), and a's new one (raised)
    run = [diverges("a", "K", status="known"), diverges("a", "K", "Other"), passes("b"), passes("c"), passes("d")]
    reran = []

    def rerun(entry):
        reran.append(entry.property)
        return {"b": ("K",), "c": ("K", "Else"), "d": ()}[entry.property]

    j = baseline.judge(run, listed, rerun)
    assert [k.key for k in j.new] == [("a", 2, HERE, ("K", "Other"))]
    assert [k.property for k in j.known] == ["a", "b"]  # b: found again by its recorded case
    assert [(k.property, now) for k, now in j.changed] == [("c", "now K + Else")]
    assert [k.property for k in j.fixed] == ["d"] and [k.property for k in j.not_run] == ["e"]
    assert reran == ["b", "c", "d"] and j.blocks
    assert [o.status for o in run] == ["known", "diverges", "known", "diverges", "pass"]
    text = baseline.judgement_report(j, {"torch": "2.13.0", "profile": "ci"}, "b.json")
    assert "1 new, 1 changed, 1 fixed, 2 known: blocks" in text


def test_a_listed_case_whose_parts_all_showed_in_other_cases_is_known_without_a_rerun():
    listed = baseline.entries([diverges("a", "K", "L"), diverges("a", "M")])
    run = [Outcome("a", 2, "known", 1.0, findings=[
        Finding("", "", "", {"case": CASE}, ("K",), "known"), Finding("", "", "", {"case": CASE}, ("L", "M"), "known")])]
    j = baseline.judge(run, listed, rerun=lambda entry: pytest.fail(f"reran {entry.key}"))
    assert {k.key for k in j.known} == {("a", 2, HERE, ("K", "L")), ("a", 2, HERE, ("M",))} and not j.blocks


def test_a_known_fault_with_a_new_one_in_the_same_case_is_new():
    """The registry fault is known; a case that also departs in its gradients is not."""
    listed = baseline.entries([diverges("a", REGISTRY)])
    run = [diverges("a", REGISTRY, GRADIENT)]
    j = baseline.judge(run, listed, lambda e: pytest.fail("a's entry was met: the new failure shows it"))
    assert [k.signature for k in j.new] == [(REGISTRY, GRADIENT)] and j.blocks and len(j.known) == 1
    assert run[0].findings[0].status == "NEW" and run[0].status == "diverges"


def test_every_part_known_from_different_entries_of_a_region_is_known():
    other = TrainCase(model="frozen", size=Size(dim=2), mesh_shape=(2, 1), seed=3)  # the same region
    listed = baseline.entries([diverges("a", REGISTRY), diverges("a", GRADIENT, case=other)])
    run = [diverges("a", REGISTRY, GRADIENT, status="known")]
    j = baseline.judge(run, listed, lambda e: pytest.fail("both entries were met"))
    assert not j.new and run[0].status == "known" and len(j.known) == 2


@pytest.mark.parametrize("elsewhere", [TrainCase(model="frozen", mesh_shape=(2, 1), entry="fsdp1"),
                                       TrainCase(model="tied", mesh_shape=(2, 1)),
                                       TrainCase(model="frozen", mesh_shape=(1, 2))],
                         ids=["another entry point", "another model", "another mesh kind"])
def test_a_part_is_known_only_in_the_region_it_was_seen_in(elsewhere):
    """A gradient departure recorded under one entry point, model and mesh kind says nothing
    of another: there it is NEW (issue 29: FSDP1 + TP's gradients were known because
    replicate on the tied model departed in gradients)."""
    listed = baseline.entries([diverges("a", GRADIENT)])
    run = [diverges("a", GRADIENT, case=elsewhere)]
    j = baseline.judge(run, listed, lambda e: ("value:gradient",))
    assert [k.signature for k in j.new] == [(GRADIENT,)] and j.blocks and run[0].status == "diverges"
    assert baseline.regional_parts(listed) == {"a": {HERE: {GRADIENT}}}


@pytest.mark.parametrize("case, expected", [
    (FSDPCase((1, 2), Shard(0), (4,), torch.float32, 0), "tp shard even on tp"),
    (FSDPCase((1, 2), Shard(0), (3,), torch.float32, 0), "tp shard uneven on tp"),
    (FSDPCase((2, 1, 2), Shard(0), (4,), torch.float32, 0), "tp shard even on dp x tp"),
    (FSDPCase((1, 2, 1), Replicate(), (3,), torch.float32, 0), "tp replicate on dp"),
    (FSDPCase((2, 2), None, (3,), torch.float32, 0), "plain on dp x tp"),
    (TensorCase((2, 2), (Replicate(), Shard(1)), (3, 4), torch.float32, True, 0), "sharded evenly"),
    (TensorCase((2, 2), (Shard(1), Shard(1)), (3, 3), torch.float32, True, 0), "sharded unevenly"),
    (TensorCase((4,), (Replicate(),), (3,), torch.float32, True, 0), "replicated"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_tensor_case_lies_in_its_layout(case, expected):
    """Overlapping metadata on uneven shards (torch 2.13's fault 6) says nothing of even
    ones, nor of a mesh whose FSDP group is one rank: ChunkBoxOffByOne is NEW there."""
    from tpdp_verify.runner.property import region

    assert region({"case": case}) == expected


def test_nothing_new_passes():
    j = baseline.judge([diverges("a", "K", status="known")], baseline.entries([diverges("a", "K")]),
                       lambda e: pytest.fail())
    assert not j.blocks and len(j.known) == 1


def test_an_old_baseline_says_how_to_regenerate_it(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"schema": 1, "profile": "ci", "known": []}')
    with pytest.raises(UsageError, match=r"schema 1, .*regenerate it: tpdp-verify gate --profile ci --baseline "
                                         r".*old.json --update-baseline$"):
        baseline.load(str(path))


@pytest.mark.parametrize("text, expected", [
    (None, "no baseline"), ("{not json", "cannot read the baseline"),
    ('{"schema": 9, "known": []}', "is not a tpdp-verify baseline"),
    ('{"schema": 2, "known": [{"property": "p"}]}', "an entry lacks 'world_size'"),
])
def test_a_bad_baseline_is_one_line(tmp_path, text, expected):
    path = tmp_path / "b.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=expected) as excinfo:
        baseline.load(str(path))
    assert "\n" not in str(excinfo.value)


@pytest.mark.timeout(300)
def test_updating_a_baseline_keeps_what_the_new_draw_missed_and_drops_what_is_fixed(tmp_path):
    """A draw meets only some faults: --update-baseline on an existing file keeps each
    recorded case that still fails (rerun), or that this run did not reach, and drops the
    fixed ones."""
    import os

    from toy_suite import RARE

    def recorded(n, part, world_size=2):
        return {"property": "rare", "world_size": world_size, "signature": [part], "case": {"n": repr(n)},
                "types": [], "summary": "recorded"}

    path = tmp_path / "toy.json"
    path.write_text(json.dumps({"schema": baseline.SCHEMA, "torch": "x", "profile": "smoke", "impl": "torch",
                                "known": [recorded(RARE, "check:toy-avoids-rare"),  # still fails, not drawn
                                          recorded(500, "check:toy-was-fixed"),  # passes now
                                          recorded(RARE, "check:toy-avoids-rare", world_size=4)]}))  # not run
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", "--suite", "toy_suite", "--baseline",
                          str(path), "--update-baseline"], capture_output=True, text=True, timeout=280,
                         env={**os.environ, "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "FIXED    rare" in out.stdout and "1 fixed dropped" in out.stdout
    _, known = baseline.load(str(path))
    rare, met = ("check:toy-avoids-rare",), ("check:toy-stays-large",)
    cases = {(k.world_size, k.signature): k.case["n"] for k in known}
    assert set(cases) == {(2, rare), (2, met), (4, rare)}  # the fixed one dropped
    assert cases[2, rare] == cases[4, rare] == repr(RARE)  # kept: still fails; world size 4 did not run
    assert int(cases[2, met]) < 100  # met by this run's draw


def test_the_shipped_baseline_loads_by_name_and_every_case_rebuilds():
    header, known = baseline.load("torch-2.13.0")
    assert header["torch"].startswith("2.13.0") and known
    for entry in known:
        assert entry.drawn(), entry


@pytest.mark.timeout(600)
def test_the_smoke_gate_passes_against_torch_with_the_shipped_baseline(tmp_path):
    """Every property draws its full budget past torch's known faults, and the files a CI
    reads agree with the exit code."""
    import xml.etree.ElementTree as ET

    out = subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", "--baseline", "torch-2.13.0",
                          "--json", str(tmp_path / "gate.json"), "--junit", str(tmp_path / "junit.xml")],
                         capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " 0 new, 0 changed, " in out.stdout
    record = json.loads((tmp_path / "gate.json").read_text())
    assert record["exit_code"] == 0 and record["counts"]["known"] > 0 and record["counts"]["diverges"] == 0
    assert record["baseline"]["name"] == "torch-2.13.0" and not record["baseline"]["blocks"]
    assert all(p["drawn"] == p["wanted"] == 10 and not p["drew_fewer"] for p in record["properties"])
    assert sum(p["known_only"] for p in record["properties"]) > 0  # the search went on past them
    assert {f["status"] for p in record["properties"] for f in p["findings"]} <= {"known"}
    assert record["not_searched"] and "not searched: ddp_unused_without_find_unused" in out.stdout
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("failures"), suite.get("errors")) == ("0", "0")


def test_known_divergences_md_lists_every_entry_of_the_shipped_baseline():
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "known-divergences.md").read_text()
    _, known = baseline.load("torch-2.13.0")
    missing = [k.key for k in known if f"### {baseline.heading(k)}" not in doc]
    assert not missing, f"regenerate with python -m tpdp_verify.runner.baseline: {missing}"


@pytest.mark.timeout(600)
def test_a_broken_transform_blocks_against_the_shipped_baseline():
    """The reference with every sharded gradient scaled by 1 + 1e-3: its departures are not
    torch's known ones, so the gate blocks with them listed as new."""
    import os
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    out = subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", "--impl", "mutants.ScalesGradientUp",
                          "--baseline", "torch-2.13.0"], capture_output=True, text=True, timeout=580, env=env)
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(r"  NEW +trains_like_one_device +world 2( \([^)]*\))?  .*gradient beyond its bound", out.stdout), \
        out.stdout[-4000:]
    assert re.search(r"against the baseline: [1-9]\d* new, .*: blocks", out.stdout)


def test_reruns_stop_at_their_budget_and_say_how_many_were_left():
    listed = baseline.entries([diverges("b", "K"), diverges("c", "K")])
    run = [passes("b"), passes("c")]
    j = baseline.judge(run, listed, lambda e: pytest.fail("no budget: no rerun"), rerun_seconds=0.0)
    assert len(j.not_rerun) == 2 and not j.known and not j.blocks
    text = baseline.judgement_report(j, {"torch": "2.13.0", "profile": "ci"}, "b.json")
    assert "not rerun: 2 entries" in text and "0 known, 2 not rerun: passes" in text
    assert len(baseline.judge(run, listed, lambda e: ("K",)).known) == 2  # no budget given: every one rerun


def test_a_recorded_hang_is_rerun_only_while_the_budget_holds_its_timeout():
    listed = baseline.entries([diverges("b", signature.HANG), diverges("c", "K")])
    run = [passes("b"), passes("c")]
    j = baseline.judge(run, listed, lambda e: e.signature, rerun_seconds=60.0, hang_seconds=120.0)
    assert [e.property for e in j.not_rerun] == ["b"] and [e.property for e in j.known] == ["c"]
    assert len(baseline.judge(run, listed, lambda e: e.signature, 600.0, hang_seconds=120.0).known) == 2
