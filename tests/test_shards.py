"""A gate run split by --shard and put back by merge is the run itself: the same verdicts,
counts, judgement, exit code and outputs, whatever the split, and so is --jobs and the suite
run as pytest items over pytest-xdist workers; -k selects searches; a part missing, twice or
of another run is an error, never a pass."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tpdp_verify.errors import UsageError
from tpdp_verify.runner import selection
from tpdp_verify.runner.profiles import PROFILES

CI = PROFILES["ci"]

TESTS = Path(__file__).resolve().parent


def gate(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}  # toy_suite
    return subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env)


def merged(*paths, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpdp_verify", "merge", *map(str, paths), "--json", "merged.json",
                           "--junit", "merged.xml"], capture_output=True, text=True, timeout=120, cwd=cwd)


HOLDS = {"pass": "holds", "known": "holds"}  # no blocking finding: JUnit passes either


def verdict(record: dict) -> dict:
    """What a record says of the torch under test: its exit code, blocking counts and
    judgement, and each search's verdict, draw and blocking findings. Not the seconds, the
    ranks' log paths, or which recorded cases the rerun budget reached: each part spends
    its own (and a whole run's reruns vary with its timing too); a rerun that finds its case
    still failing labels the entry known, and the search that met no failure "known" with it."""
    b = record["baseline"] or {}
    searches = [{k: p[k] for k in ("name", "world_size", "drawn", "wanted", "covered", "known_only")}
                | {"status": HOLDS.get(p["status"], p["status"]),
                   "blocking": sorted(f["signature"] for f in p["findings"] if f["status"] in ("found", "NEW", "CHANGED"))}
                for p in record["properties"]]
    blocking = {k: record["counts"].get(k, 0) for k in ("diverges", "infra", "interrupted")}
    return {k: record[k] for k in ("exit_code", "torch", "impl", "profile", "seed", "world_sizes", "error")} \
        | {k: b.get(k) for k in ("name", "blocks", "new", "changed")} | {"counts": blocking, "searches": searches}


def cases(junit: Path) -> list[tuple[str, str]]:
    return [(c.get("name"), next((x.tag for x in c if x.tag in ("failure", "error")), "ok"))
            for c in ET.parse(junit).getroot().iter("testcase")]


def test_shard_parses_k_of_n_and_nothing_else():
    assert selection.parse("2/4") == (2, 4)
    for bad in ("0/2", "3/2", "2", "a/b", "1/0", ""):
        with pytest.raises(UsageError, match="--shard takes K/N"):
            selection.parse(bad)


def test_the_parts_cover_every_search_once_balanced_by_cost_the_same_everywhere():
    plan = [(f"p{i}", ws) for ws in (2, 4) for i in range(9)]
    parts = selection.split(plan, 4, CI)
    assert sorted(s for part in parts for s in part) == sorted(plan)
    assert parts == selection.split(list(plan), 4, CI)  # deterministic
    assert all(part == [s for s in plan if s in part] for part in parts)  # each in the run's order
    loads = [sum(selection.cost(*s, CI) for s in part) for part in parts]
    assert max(loads) - min(loads) <= max(selection.cost(*s, CI) for s in plan) + 1e-9  # greedy's guarantee


def test_the_measured_costs_name_every_search_of_the_suite():
    from tpdp_verify.properties import ALL
    from tpdp_verify.runner.gate import searches

    for name, table in selection._measured().items():
        wanted = [selection.search_id(p.name, ws) for p, ws in searches(ALL, PROFILES[name])]
        assert wanted and all(sid in table["seconds"] for sid in wanted), (name, sorted(set(wanted) - set(table["seconds"])))
    assert "ci" in selection._measured()  # what every profile not measured scales


def test_a_profile_costs_what_it_measured_else_what_ci_did_scaled_by_its_examples(monkeypatch):
    tables = {"ci": {"seconds": {"a[world_size=2]": 2.0, "b[world_size=2]": 4.0}},
              "release": {"seconds": {"a[world_size=8]": 30.0}}}
    monkeypatch.setattr(selection, "_measured", lambda: tables)
    release = PROFILES["release"]
    assert selection.cost("a", 8, release) == 30.0
    assert selection.cost("b", 2, release) == 4.0 * release.max_examples / 40
    assert selection.cost("c", 8, release) == 30.0  # never measured: the median of its own
    assert selection.cost("c", 2, CI) == 4.0
    assert selection.cost("c", 2, PROFILES["smoke"]) == 4.0 * 10 / 40


def test_k_selects_by_id_as_pytest_does_and_says_when_it_selects_nothing():
    plan = [("trains_like_one_device", 2), ("trains_like_plain_ddp", 2), ("trains_like_one_device", 4)]
    assert selection.select(plan, "trains and not plain", None, CI) == [plan[0], plan[2]]
    assert selection.select(plan, "world4", None, CI) == [plan[2]]
    with pytest.raises(UsageError, match="selects none of the 3 searches"):
        selection.select(plan, "checkpoint", None, CI)
    with pytest.raises(UsageError, match="does not parse"):
        selection.select(plan, "trains and (", None, CI)


@pytest.fixture(scope="module")
def toy_parts(tmp_path_factory):
    """The toy suite at ci (4 searches, failing on purpose, no ranks' work): whole, and in 2 and 3 parts."""
    cwd = tmp_path_factory.mktemp("toy")
    args = ("--suite", "toy_suite", "--profile", "ci")
    whole = gate(*args, "--json", "whole.json", "--junit", "whole.xml", cwd=cwd)
    parts = {n: [gate(*args, "--shard", f"{k}/{n}", "--json", f"part{k}of{n}.json", cwd=cwd) for k in range(1, n + 1)]
             for n in (2, 3)}
    return cwd, whole, parts


def test_merged_parts_are_the_whole_run(toy_parts):
    cwd, whole, parts = toy_parts
    assert whole.returncode == 1, whole.stderr
    expected = json.loads((cwd / "whole.json").read_text())
    for n in (2, 3):
        assert all(p.returncode == 1 or "0 of" in p.stdout for p in parts[n])
        out = merged(*(f"part{k}of{n}.json" for k in range(1, n + 1)), cwd=cwd)
        assert out.returncode == expected["exit_code"] == 1, out.stdout + out.stderr
        got = json.loads((cwd / "merged.json").read_text())
        assert verdict(got) == verdict(expected)
        assert [p["shard"] for p in got["parts"]] == [f"{k}/{n}" for k in range(1, n + 1)]
        assert cases(cwd / "merged.xml") == cases(cwd / "whole.xml")


def test_jobs_run_the_parts_at_once_with_the_whole_runs_outputs(toy_parts, tmp_path):
    cwd, whole = toy_parts[:2]
    out = gate("--suite", "toy_suite", "--profile", "ci", "--jobs", "3", "--json", "jobs.json", "--junit", "jobs.xml",
               cwd=tmp_path)
    assert out.returncode == 1 and "3 parts at once" in out.stdout and "[3/3] " in out.stdout, out.stdout + out.stderr
    got, expected = (json.loads(p.read_text()) for p in (tmp_path / "jobs.json", cwd / "whole.json"))
    assert verdict(got) == verdict(expected) and got["selection"] is None
    assert cases(tmp_path / "jobs.xml") == cases(cwd / "whole.xml")


@pytest.mark.parametrize("args, said", [(["--jobs", "0"], "--jobs takes a positive number"),
                                        (["--jobs", "2", "--shard", "1/2"], "which --shard cannot take"),
                                        (["-k", "nothing_of_the_kind"], "selects none of the 2 searches")])
def test_a_split_that_cannot_be_made_is_one_line(tmp_path, args, said):
    out = gate("--suite", "toy_suite", "--profile", "ci", *args, cwd=tmp_path)
    assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_part_missing_twice_or_of_another_run_is_an_error(toy_parts, tmp_path):
    cwd = toy_parts[0]
    two = cwd / "part1of2.json", cwd / "part2of2.json"
    for paths, said in [((two[0],), "part 2/2 missing"), ((two[0], two[0], two[1]), "given twice"),
                        ((two[0], cwd / "part2of3.json"), "is part 2/3, the others of 2 parts"),
                        ((cwd / "whole.json",), "is a whole run, not a part")]:
        out = merged(*paths, cwd=tmp_path)
        assert out.returncode == 2 and said in out.stderr, out.stderr
        assert said in json.loads((tmp_path / "merged.json").read_text())["usage_error"]  # the outputs say so
    (tmp_path / "old.json").write_text(json.dumps({k: v for k, v in json.loads(two[1].read_text()).items()
                                                   if k != "selection"}))
    out = merged(two[0], tmp_path / "old.json", cwd=tmp_path)
    assert out.returncode == 2 and "old.json lacks selection" in out.stderr, out.stderr
    other = json.loads(two[1].read_text()) | {"seed": 7}
    (tmp_path / "other.json").write_text(json.dumps(other))
    out = merged(two[0], tmp_path / "other.json", cwd=tmp_path)
    assert out.returncode == 2 and "are parts of different runs (seed: 7 and None)" in out.stderr, out.stderr


SMOKE = ("--profile", "smoke", "--baseline", "torch==2.13.0")
# The smoke run's searches the splits below run again: the cheap ones, known faults and passes
# among them. A split's mechanics are the toy suite's tests above; these check the real suite's
# records against the shipped baseline, which any searches show, at a sixth of the whole's cost.
SELECTED = "roundtrip or registry or requires_grad or chunk or trains_like_one_device"


def selected_of(record: dict) -> dict:
    """The whole run's record as a run of SELECTED would be: its searches of SELECTED alone
    (every blocking count is 0 in a run that passes)."""
    searches = [(p["name"], p["world_size"]) for p in record["properties"]]
    picked = set(selection.select(searches, SELECTED, None, PROFILES["smoke"]))
    assert 1 < len(picked) < len(searches), picked
    return record | {"properties": [p for p in record["properties"] if (p["name"], p["world_size"]) in picked]}


@pytest.fixture(scope="module")
def smoke(smoke_against_the_release):
    """The suite at smoke against the shipped baseline, whole (conftest's run, which
    test_baseline judges too): what the splits must give. Its gate.json and junit.xml."""
    whole = smoke_against_the_release
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr
    return whole.dir


@pytest.mark.timeout(900)
def test_the_suite_split_in_two_and_merged_gives_the_whole_runs_verdict_against_the_shipped_baseline(smoke, tmp_path):
    for k in (1, 2):
        part = gate(*SMOKE, "-k", SELECTED, "--shard", f"{k}/2", "--json", f"part{k}.json", cwd=tmp_path)
        assert part.returncode == 0 and f"shard {k}/2: " in part.stdout, part.stdout[-3000:] + part.stderr
    out = merged("part1.json", "part2.json", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    got, expected = json.loads((tmp_path / "merged.json").read_text()), json.loads((smoke / "gate.json").read_text())
    assert verdict(got) == verdict(selected_of(expected))
    known = [p for p in got["properties"] if p["status"] == "known"]
    assert known and len(known) < len(got["properties"]), got["properties"]  # known faults and passes merged
    names = {f"{p['name']}[world_size={p['world_size']}]" for p in got["properties"]}
    assert cases(tmp_path / "merged.xml") == [c for c in cases(smoke / "junit.xml") if c[0] in names]


def collected(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``pytest --pyargs tpdp_verify.properties --collect-only`` with ``args``: the run and its item names."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "tpdp_verify.properties", "-p", "no:cacheprovider",
                          "--collect-only", "-q", *args], capture_output=True, text=True, timeout=120)
    return run, [line.rpartition("::")[2] for line in run.stdout.splitlines() if "::" in line]


def test_tpdp_shard_collects_the_gates_part_and_refuses_a_bad_one_in_a_line():
    from tpdp_verify.properties import ALL
    from tpdp_verify.runner.gate import searches

    _, whole = collected()
    plan = [(p.name, ws) for p, ws in searches(ALL, CI)]
    assert whole == [selection.search_id(*s) for s in plan]
    parts = [collected("--tpdp-shard", f"{k}/3")[1] for k in (1, 2, 3)]
    assert parts == [[selection.search_id(*s) for s in selection.select(plan, None, f"{k}/3", CI)] for k in (1, 2, 3)]
    assert sorted(sum(parts, [])) == sorted(whole)
    for option in ("--tpdp-shard=4/3", "--tpdp-seed=x", "--tpdp-profile=nightly"):
        bad, items = collected(option)
        assert bad.returncode == 4 and not items, bad.stdout + bad.stderr  # pytest's usage error
        assert "Traceback" not in bad.stderr and bad.stderr.strip().count("\n") == 0, bad.stderr
        assert "tpdp-verify: " in bad.stderr, bad.stderr


@pytest.mark.timeout(900)
def test_the_suite_as_pytest_items_over_two_workers_gives_the_gates_verdicts(smoke, tmp_path):
    """pytest --pyargs tpdp_verify.properties -n 2 -rA -k SELECTED: an item per search, passing exactly
    where the gate's search passes or holds only known faults; the ranks' C++ logs and
    torch's warnings stay in the rank logs, not in the items' captured output."""
    items = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "tpdp_verify.properties", "-p",
                            "no:cacheprovider", "--tpdp-profile", "smoke", "--tpdp-baseline", "torch==2.13.0", "-n", "2",
                            "-k", SELECTED, "--junitxml", "items.xml", "-q", "-rA"], capture_output=True, text=True,
                           timeout=900,
                           cwd=tmp_path)
    assert items.returncode == 0, items.stdout[-3000:] + items.stderr[-2000:]
    assert items.stdout.count("PASSED ") == len(cases(tmp_path / "items.xml")), items.stdout
    noise = [line for line in (items.stdout + items.stderr).splitlines()
             if "Captured" in line or "Warning" in line or line.startswith(("[W", "[I", "[E"))]
    assert not noise, noise
    verdicts = {f"{p['name']}[world_size={p['world_size']}]": p["status"] in ("pass", "known")
                for p in selected_of(json.loads((smoke / "gate.json").read_text()))["properties"]}
    assert {name: status == "ok" for name, status in cases(tmp_path / "items.xml")} == verdicts
    known = {p.get("value") for p in ET.parse(tmp_path / "items.xml").getroot().iter("property")
             if p.get("name") == "known"}
    assert known  # the known faults an item passes with are in its JUnit properties


def test_the_k_names_listed_in_cli_md_are_the_suites_and_its_examples_select_what_it_says():
    from tpdp_verify.runner.suite import load

    doc = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    names = [p.name for p in load("tpdp_verify.properties").properties]
    section = doc[doc.index("### Selecting searches (`-k`)"):doc.index("### Splitting a run")]
    assert all(f"`{n}`" in section for n in names)
    every = [(n, 2) for n in names]
    picked = {n for n, _ in selection.select(every, "trains", None, PROFILES["ci"])}
    assert "entry_points_train_like_one_device" not in picked and "trains_like_one_device" in picked
    training = {n for n, _ in selection.select(every, "train_like or trains_like", None, PROFILES["ci"])}
    assert {"entry_points_train_like_one_device", "losses_train_like_one_device"} <= training
