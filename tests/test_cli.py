"""The command line from the shell: exit codes, the summary, a replay script that replays,
the gate's JSON, JUnit and Markdown files, and ``env``."""

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tpdp_verify import files
from tpdp_verify.properties import (
    ALL,
    all_gather_dtensor_full,
    chunk_dtensor_layout,
    chunk_tensor_metadata,
    entry_points_checkpoint_resume,
    entry_points_state_dict_like_unsharded,
    entry_points_train_like_one_device,
    fused_projections_read_back,
    losses_train_like_one_device,
    tp_keeps_requires_grad,
)
from tpdp_verify.runner.gate import _heartbeat
from tpdp_verify.runner.property import Stats

ALL = tuple(p for p in ALL if p.min_world_size <= 2)  # what the smoke profile runs: world size 2 only

# On torch 2.13.0 every property departs on its simplest case (docs/known-divergences.md)
# but FSDP1's extension's three: smoke's 10 draws meet their faults, or not, as the draw
# goes (a derandomized draw changes with the property's code). With the reference
# transform, only torch's entry points' own departures remain, and TP's own (fault 7).
DRAWN_BY_LUCK = (chunk_dtensor_layout, all_gather_dtensor_full, chunk_tensor_metadata)
# torch's own departures, outside the transform: TP's, the entry points', and loss_parallel's
# (fault 15: a KL loss's gradients under loss_parallel), and DCP's and FSDP2's over a fused
# projection's per-part shards (faults 35, 36). FSDP2's fault 16 (TP's partial
# gradients summed in the compute dtype) the reference fixes, as its contract says.
REFERENCE_DEPARTS = (tp_keeps_requires_grad, entry_points_train_like_one_device, losses_train_like_one_device,
                     entry_points_state_dict_like_unsharded, entry_points_checkpoint_resume, fused_projections_read_back)


def cli(command, *args, cwd=None):
    """The command as a user runs it, in a terminal 100 columns wide (the README's, and the
    width where there is no terminal; pytest hands its children 80)."""
    return subprocess.run([sys.executable, "-m", "tpdp_verify", command, *args], capture_output=True, text=True,
                          timeout=880, cwd=cwd, env={**os.environ, "COLUMNS": "100"})


def gate(*args, cwd=None):
    return cli("gate", *args, cwd=cwd)


@pytest.fixture(scope="module")
def torch_gate(tmp_path_factory):
    """One smoke run against torch for every test of its output: a run takes a minute or more."""
    files = tmp_path_factory.mktemp("gate")
    out = gate("--profile", "smoke", "--json", str(files / "gate.json"),
               "--junit", str(files / "junit.xml"), "--markdown", str(files / "gate.md"))
    return out, files


@pytest.fixture(scope="module")
def passes(torch_gate) -> tuple:
    """The properties torch passed in that run, by the JSON's statuses: the outputs are
    checked against each other, and test_torch_departs_on_every_simplest_case bounds them."""
    record = json.loads((torch_gate[1] / "gate.json").read_text())
    status = {p["name"]: p["status"] for p in record["properties"]}
    return tuple(prop for prop in ALL if status[prop.name] == "pass")


def test_a_smoke_gate_keeps_torchs_warnings_and_the_ranks_output_off_the_terminal(torch_gate):
    out, _ = torch_gate
    noise = [line for line in out.stderr.splitlines() if "Warning" in line or "warn(" in line or line.startswith("[W")]
    assert out.stderr.strip() == "" and not noise, out.stderr[-3000:]
    logs = out.stdout.rsplit("the ranks' output (torch's warnings, C++ logs; -v shows it): ", 1)[1].strip()
    ranks = {"world2-rank0.log", "world2-rank1.log"}  # emptied after each search, into a file of its own
    searches = set(os.listdir(logs)) - ranks - {"report.txt", files.LIVE}  # the run's lock (tpdp_verify.files)
    assert ranks <= set(os.listdir(logs)) and all(os.path.getsize(os.path.join(logs, n)) == 0 for n in ranks)
    assert {n.removesuffix("-world2.log") for n in searches} <= {p.name for p in ALL}


def test_torch_departs_on_every_simplest_case(passes):
    assert {p.name for p in passes} <= {p.name for p in DRAWN_BY_LUCK}, passes


def full_report(out) -> str:
    """The report a run writes beside its rank logs, named on its last lines."""
    path = out.stdout.rsplit("the full report (every finding's case and replay, what is not searched): ", 1)[1]
    return Path(path.splitlines()[0].strip()).read_text()


def test_the_terminal_says_what_matters_in_a_screen_and_names_the_full_report(torch_gate):
    out, _ = torch_gate
    assert len(out.stdout.splitlines()) <= 80, out.stdout  # progress, counts, a line a finding: a screen or two
    assert "-- replay" not in out.stdout and "  found    flatten_roundtrip (world 2): " in out.stdout
    full = full_report(out)
    assert "-- replay (save as a file and run it with python):" in full and "not searched: " in full


def test_the_readmes_sample_of_make_demo_is_what_the_gate_prints(torch_gate):
    """Each line the README shows of `make demo`'s gate (up to the demo's own "next:" lines,
    but the elided and the cache path) is a line of a smoke gate's output, numbers aside."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    sample = readme.split("The demo still succeeds, because finding\ndivergences is its job:\n\n```\n", 1)[1]
    sample = sample.split("\nnext:", 1)[0].splitlines()
    shown = [line for line in sample if line.strip() not in ("", "...") and "~/" not in line]

    def numbers_aside(line: str) -> str:
        # the budget's verdict is a number's too: a loaded machine (two test workers) takes longer
        return re.sub(r"\d+(\.\d+)?", "#", line.replace(", OVER BUDGET)", ")"))

    printed = {numbers_aside(line) for line in torch_gate[0].stdout.splitlines()}
    assert len(shown) >= 8 and [x for x in shown if numbers_aside(x) not in printed] == []


def test_the_gate_says_its_next_steps_in_lines_that_fit_a_terminal(torch_gate):
    """After findings and no baseline, the gate itself names the command that tells torch's
    known faults from new ones and the fault to explain; finding lines fit the terminal (the
    full text is the report's), and check names are spelled as written."""
    out = torch_gate[0].stdout
    steps = out.split("\nnext:\n", 1)[1].splitlines()
    assert steps[0].startswith("  python -m tpdp_verify gate --profile smoke --baseline torch==2.13.0 "), steps
    assert re.match(r"  python -m tpdp_verify explain \d+ ", steps[1]), steps
    findings = out.split("findings (their cases and replays in the full report):\n", 1)[1].split("\nverdict:")[0]
    assert findings and max(map(len, findings.splitlines())) <= 100, findings
    assert "t's shard" in findings and "t s shard" not in findings
    assert "next:" not in gate("--profile", "smoke", "-k", "chunk_dtensor_layout and world2").stdout  # a pass


@pytest.mark.timeout(900)
def test_gate_against_torch_reports_the_divergence_and_a_replay_that_fails_the_same_way(
        torch_gate, passes, tmp_path):
    out, _ = torch_gate
    assert out.returncode == 1, out.stderr
    assert (f"{len(passes)} passed, 0 known only, {len(ALL) - len(passes)} diverged, "
            "0 infrastructure failures") in out.stdout
    report = full_report(out)
    assert "== flatten_roundtrip (world size 2): diverges" in report
    replay = report.split("-- replay (save as a file and run it with python):\n", 1)[1]
    replay = replay.split("\n\n== ", 1)[0]  # the first property's script only
    (tmp_path / "replay.py").write_text(replay)
    replayed = subprocess.run([sys.executable, "replay.py"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 1
    section = report.split("== flatten_roundtrip (world size 2): diverges\n", 1)[1].splitlines()
    assert section[1].startswith("found: ") and section[2].startswith("signature: check:")
    assert section[3].startswith("catalog: fault 2, DP transform thaws frozen TP parameters (workaround: ")
    found = section[4]
    assert found.startswith("tpdp_verify.judging.divergence.") and found in replayed.stderr, (found, replayed.stderr)


@pytest.mark.timeout(900)
def test_gate_against_the_reference_passes_every_property_of_the_transform():
    """What still departs with the reference in place is torch's own, outside the transform."""
    out = gate("--profile", "smoke", "--impl", "reference")
    assert out.returncode == 1, out.stdout + out.stderr
    for prop in ALL:
        status = "DIVERGES" if prop in REFERENCE_DEPARTS else "PASS"
        assert re.search(rf"{prop.name} +world 2 +{status} +\d+ drawn", out.stdout), out.stdout
    assert (f"{len(ALL) - len(REFERENCE_DEPARTS)} passed, 0 known only, {len(REFERENCE_DEPARTS)} diverged, "
            "0 infrastructure failures") in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [(["--impl", "no_such_pkg.transform"],
      "tpdp-verify: error: implementation 'no_such_pkg.transform' does not import"),
     (["--impl", "json"], "tpdp-verify: error: implementation 'json' lacks flatten_tensor, unflatten_tensor, "),
     (["--profile", "nightly"], "invalid choice: 'nightly'"),
     (["--suite", "no_such_suite"], "tpdp-verify: error: no suite module 'no_such_suite'"),
     (["--suite", "json"], "tpdp-verify: error: json has no ALL, a tuple of tpdp_verify properties")],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    out = gate(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_a_suite_of_ones_own_runs_by_its_module_name(tmp_path):
    """The gate runs the properties a user's module lists, and only those."""
    (tmp_path / "my_suite.py").write_text("from tpdp_verify.properties import flatten_roundtrip\n"
                                          "ALL = (flatten_roundtrip,)\n")
    out = gate("--suite", "my_suite", "--impl", "reference", "--json", "gate.json", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads((tmp_path / "gate.json").read_text())
    assert [p["name"] for p in record["properties"]] == ["flatten_roundtrip"] and not record["not_searched"]
    assert record["properties"][0]["drawn"] >= 10


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "tpdp-verify"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "exit codes: 0 ok, 1 divergence found" in out.stdout


@pytest.mark.timeout(900)
def test_progress_lines_count_properties_failures_and_elapsed_time(torch_gate, passes):
    out, _ = torch_gate
    lines = re.findall(r"\[ *(\d+)/(\d+)\] (\w+) +world 2 +([A-Z]+) +\d+ drawn.*"
                       r"\(failures so far: (\d+), elapsed (\d+) s\)", out.stdout)
    assert [(int(done), int(total), name) for done, total, name, *_ in lines] == [
        (i, len(ALL), prop.name) for i, prop in enumerate(ALL, 1)], out.stdout
    failures = [int(failed) for *_, failed, _ in lines]
    diverged = [prop not in passes for prop in ALL]
    assert failures == [sum(diverged[:i]) for i in range(1, len(ALL) + 1)]
    elapsed = [int(seconds) for *_, seconds in lines]
    assert elapsed == sorted(elapsed)


@pytest.mark.timeout(900)
def test_gate_json_has_the_header_and_an_entry_per_property(torch_gate, passes):
    out, files = torch_gate
    record = json.loads((files / "gate.json").read_text())
    assert {k: record[k] for k in ("command", "impl", "profile", "backend", "world_sizes",
                                   "exit_code", "error")} == {
        "command": "gate", "impl": "torch", "profile": "smoke", "backend": "auto",
        "world_sizes": [2], "exit_code": out.returncode, "error": ""}
    assert [p["name"] for p in record["properties"]] == [prop.name for prop in ALL]
    assert record["counts"] == {"pass": len(passes), "known": 0, "not_asked": 0, "diverges": len(ALL) - len(passes),
                                "infra": 0, "interrupted": 0}
    assert record["interrupted"] is None
    for p, prop in zip(record["properties"], ALL):
        assert p["examples"] >= 1 and p["backend"] == "gloo"
        if prop in passes:
            assert p["status"] == "pass" and not p["findings"]
            continue
        assert p["status"] == "diverges" and p["findings"] and all(f["failure"] for f in p["findings"])
        assert all(f["kind"] and f["case"] and f["signature"] and f["status"] == "found" for f in p["findings"])
        assert p["report"] in full_report(out)  # the report is the full report's, word for word
    assert sum(p["seconds"] for p in record["properties"]) <= record["seconds"]
    assert "RankPool(2)" in record["properties"][0]["findings"][0]["replay"]


@pytest.mark.timeout(900)
def test_gate_junit_has_a_failing_testcase_per_divergent_property(torch_gate, passes):
    out, files = torch_gate
    root = ET.parse(files / "junit.xml").getroot()
    (suite,) = root.iter("testsuite")
    assert suite.get("name") == "tpdp-verify gate"
    cases = suite.findall("testcase")
    assert len(cases) == int(suite.get("tests")) == len(ALL)
    assert [c.get("name") for c in cases] == [f"{p.name}[world_size=2]" for p in ALL]
    failures = [c.find("failure") for c, p in zip(cases, ALL) if p not in passes]
    assert out.returncode == 1 and all(f is not None for f in failures) and len(failures) == len(ALL) - len(passes)
    assert all(c.find("failure") is None for c, p in zip(cases, ALL) if p in passes)
    assert int(suite.get("failures")) == len(failures) and suite.get("errors") == "0"
    for f in failures:
        first = f.text.splitlines()[2]  # "found: <kind>", after the "== property" header
        message = f.get("message")  # "found: <kind> [fault N, ...]": the kind and the faults the catalog names
        assert "\n" not in message and first.startswith(message.partition(" [fault")[0][:100])
        assert re.search(r" \[fault \d+(, fault \d+)*\]$", message), message
        assert "-- replay" in f.text
    assert {p.get("name"): p.get("value") for p in suite.iter("property")}["impl"] == "torch"


@pytest.mark.timeout(900)
def test_gate_markdown_has_a_row_and_a_fenced_report_per_divergence(torch_gate, passes):
    _, files = torch_gate
    md = (files / "gate.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and " | 2 | " in line]
    assert [row.split(" | ")[2] for row in rows] == ["PASS" if p in passes else "DIVERGES" for p in ALL]
    assert md.count("\n```text\n") == len(ALL) - len(passes)
    assert f"{len(passes)} passed, 0 known only, {len(ALL) - len(passes)} diverged" in md.splitlines()[0]


@pytest.mark.parametrize("command, option, path, reason", [
    ("gate", "--json", "no_such_dir/gate.json", "No such file or directory"),
    ("gate", "--junit", ".", "Is a directory"),
    ("env", "--json", "no_such_dir/env.json", "No such file or directory"),
])
def test_an_unwritable_output_is_one_line_and_exit_code_2_before_anything_runs(
        command, option, path, reason, tmp_path):
    start = time.monotonic()
    out = cli(command, option, path, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == f"tpdp-verify: error: cannot write {option} {path}: {reason}\n"
    assert out.stdout == ""  # no rank started, no environment probed
    assert time.monotonic() - start < 30  # the smoke gate alone takes a minute
    assert list(tmp_path.iterdir()) == []


def test_the_same_file_for_two_outputs_is_refused(tmp_path):
    out = gate("--json", "run.out", "--markdown", "./run.out", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr == "tpdp-verify: error: --json and --markdown both name ./run.out; give " \
        "each its own file\n"


def test_env_says_what_this_machine_can_run_and_writes_it_as_json(tmp_path):
    import torch
    import torch.distributed as dist

    out = cli("env", "--json", "env.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    record = json.loads((tmp_path / "env.json").read_text())
    assert record["torch"] == torch.__version__ and record["torch"] in out.stdout
    assert record["backends"] == {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
    assert record["cpus"] == len(os.sched_getaffinity(0)) and record["gpus"] == torch.cuda.device_count()
    assert record["implementations"] == {"torch": "ok", "reference": "ok"}
    assert record["world_sizes"]["gloo"]["max"] is None
    if not torch.cuda.is_available():
        assert record["world_sizes"]["nccl"] == {"max": 0, "note": "none: no GPU"}
        assert "nccl: none: no GPU" in out.stdout
    assert re.search(r"^world sizes +gloo: any; more ranks than the \d+ CPUs time-share them$",
                     out.stdout, re.M), out.stdout


def test_python_m_and_the_console_script_are_the_same_command(tmp_path):
    script = Path(sys.executable).parent / "tpdp-verify"
    args = ["gate", "--json", "no_such_dir/gate.json"]  # the quickest path through main()
    by_script = subprocess.run([str(script), *args], capture_output=True, text=True, cwd=tmp_path)
    by_module = cli(*args, cwd=tmp_path)
    assert (by_script.returncode, by_script.stderr) == (by_module.returncode, by_module.stderr)
    assert by_module.returncode == 2 and by_module.stderr.startswith("tpdp-verify: error: ")


def test_a_long_property_says_it_still_runs():
    lines, stats = [], Stats(examples=3)
    with _heartbeat("slow_property", stats, lines.append, every=0.05):
        time.sleep(0.3)
    assert lines and re.fullmatch(r" +\.\.\. slow_property: 3 examples so far, \d+ s", lines[0])
    assert not any(t.name == "tpdp-heartbeat" for t in threading.enumerate())


def test_ranks_that_will_not_start_still_leave_the_files(tmp_path, monkeypatch, capsys):
    from tpdp_verify import cli as cli_mod
    from tpdp_verify.errors import PoolError
    from tpdp_verify.runner import gate as gate_mod

    def cut_short(*args, **kwargs):  # world size 2 ran, world size 4's ranks did not start
        yield gate_mod.Outcome("flatten_roundtrip", 2, "pass", 1.0, Stats(10, 10), backend="gloo")
        raise PoolError("ranks 2, 3 failed to join the gloo process group")

    monkeypatch.setattr(gate_mod, "iter_gate", cut_short)
    code = cli_mod.main(["gate", "--profile", "ci", "--json", str(tmp_path / "gate.json"),
                         "--junit", str(tmp_path / "junit.xml")])
    assert code == 3
    assert capsys.readouterr().err == ("tpdp-verify: infrastructure failure: ranks 2, 3 failed "
                                       "to join the gloo process group\n")
    record = json.loads((tmp_path / "gate.json").read_text())
    assert (record["exit_code"], record["counts"]["pass"]) == (3, 1)
    assert record["error"].startswith("ranks 2, 3 failed")
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("errors")) == ("2", "1")


# `tpdp-verify plan`: names resolve from the working directory, as for a user's project.
USER_MODELS = str(Path(__file__).parent)


def plan(*args):
    return cli("plan", *args, cwd=USER_MODELS)


def test_plan_passes_a_right_plan_and_writes_the_report(tmp_path):
    out = plan("user_models:make_mlp", "--plan", "user_models:PLAN", "--input", "user_models:vectors",
               "--mesh", "1x2", "--steps", "2", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout + out.stderr  # with torch, under the default DP entry point
    assert "user_models:make_mlp with TP on mesh (dp=1, tp=2), dp=fsdp2, 2 steps, float32: PASS" in out.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ok"] and sum(c["compared"] for c in data["checks"]) > 50
    assert data["replay"].startswith("tpdp-verify plan user_models:make_mlp --plan user_models:PLAN")


def test_plan_takes_ones_own_parallelize_function():
    out = plan("user_models:make_llama", "--parallelize", "tpdp_verify.fixtures.parallelize:parallelize_llama",
               "--input", "user_models:tokens", "--steps", "1", "--impl", "reference")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "parallelize_fn made 12 parameters DTensors" in out.stdout
    own = plan("user_models:make_mlp", "--parallelize", "user_models:parallelize_with_ddp", "--dp", "own",
               "--input", "user_models:vectors", "--steps", "1", "--baseline", "torch==2.13.0")
    assert own.returncode == 0, own.stdout + own.stderr
    assert "wrapped DP itself (ddp_mesh)" in own.stdout and "PASS but for known torch faults" in own.stdout
    both = plan("user_models:make_llama", "--plan", "user_models:PLAN",
                "--parallelize", "user_models:parallelize_nothing", "--input", "user_models:tokens")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


@pytest.mark.timeout(300)
def test_plan_tells_a_plan_bug_from_torchs_faults_by_evidence():
    """Under --dp ddp torch 2.13 loses the registry: the correct Llama passes with that
    attributed to torch; a model whose attention splits the config's heads, not the rank's,
    departs in its output with the reference in torch's place too: the plan's, exit 1."""
    args = ("--plan", "user_models:llama_blocks", "--input", "user_models:tokens", "--steps", "1", "--dp", "ddp",
            "--baseline", "torch==2.13.0")
    right, wrong = plan("user_models:make_llama", *args), plan("user_models:make_fixed_heads_llama", *args)
    assert right.returncode == 0 and "PASS but for known torch faults" in right.stdout, right.stdout + right.stderr
    assert "torch's faults, not the plan's" in right.stdout
    assert wrong.returncode == 1 and "DIVERGES" in wrong.stdout.splitlines()[0], wrong.stdout + wrong.stderr
    assert "the plan's departures (the run does not show them to be torch's): " in wrong.stdout


@pytest.mark.timeout(300)
def test_plan_verifies_a_parallelize_function_on_a_3d_mesh(tmp_path):
    """torchtitan's HSDP x TP on a 2x2x2 mesh: the user's function applies TP and HSDP itself
    (dp own), or TP alone with tpdp-verify wrapping HSDP (dp hsdp, both oracles)."""
    own = plan("user_models:make_llama", "--parallelize", "tpdp_verify.fixtures.parallelize:parallelize_llama_hsdp",
               "--dp", "own", "--mesh", "2x2x2", "--input", "user_models:tokens", "--steps", "2",
               "--json", str(tmp_path / "r.json"))
    assert own.returncode == 0, own.stdout + own.stderr
    assert "with TP on mesh (dp_replicate=2, dp_shard=2, tp=2), dp=own, 2 steps, float32: PASS" in own.stdout
    assert "wrapped DP itself (fully_shard)" in own.stdout
    assert json.loads((tmp_path / "r.json").read_text())["case"]["mesh"] == [2, 2, 2]
    hsdp = plan("user_models:make_llama", "--parallelize", "tpdp_verify.fixtures.parallelize:parallelize_llama",
                "--dp", "hsdp", "--mesh", "2x2x2", "--input", "user_models:tokens", "--steps", "1")
    assert hsdp.returncode == 0, hsdp.stdout + hsdp.stderr
    assert "with TP on mesh (dp_replicate=2, dp_shard=2, tp=2), dp=fsdp2, 1 step, float32: PASS" in hsdp.stdout
    compared = dict(re.findall(r"gradients vs (one device|plain DDP) +ok +(\d+)", hsdp.stdout))
    assert set(compared) == {"one device", "plain DDP"} and "0" not in compared.values(), hsdp.stdout


def test_plan_writes_junit_and_markdown_that_agree_with_its_json(tmp_path):
    files = {fmt: str(tmp_path / f"r.{fmt}") for fmt in ("json", "junit", "markdown")}
    out = plan("user_models:make_mlp", "--plan", "user_models:SWAPPED", "--input", "user_models:vectors",
               "--steps", "1", "--impl", "reference", *(a for fmt, path in files.items() for a in (f"--{fmt}", path)))
    assert out.returncode == 1 and out.stderr == "", out.stderr[-2000:]
    record = json.loads(Path(files["json"]).read_text())
    assert (record["command"], record["exit_code"], record["status"]) == ("plan", 1, "diverges")
    assert record["torch"] and record["schema"] >= 2
    failed = {c["check"] for c in record["checks"] if c["ok"] is False}
    suite = ET.parse(files["junit"]).getroot().find("testsuite")
    assert {c.get("name") for c in suite.findall("testcase") if c.find("failure") is not None} == failed != set()
    assert Path(files["markdown"]).read_text().startswith("# tpdp-verify plan: user_models:make_mlp: DIVERGES")


def test_plan_reports_a_rank_that_raises_in_the_model_with_exit_1_and_its_json(tmp_path):
    out = plan("user_models:make_raising", "--plan", "user_models:PLAN", "--input", "user_models:vectors",
               "--steps", "1", "--impl", "reference", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout.split("\n--- rank")[0] and out.stderr == "", out.stderr[-2000:]
    assert "every rank trains without an exception (rank 1): in the forward of boom: RuntimeError: boom on rank 1" \
        in " ".join(out.stdout.split())
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "diverges"


def test_version_names_tpdp_verify_and_torch():
    out = subprocess.run([sys.executable, "-m", "tpdp_verify", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and re.fullmatch(r"tpdp-verify \S+ \(torch 2\.\S+, python 3\.\S+\)\n", out.stdout)


def test_plan_reports_a_swapped_plan_with_exit_1():
    out = plan("user_models:make_mlp", "--plan", "user_models:SWAPPED", "--input", "user_models:vectors",
               "--steps", "1", "--impl", "reference")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the module whose forward raised: up" in out.stdout
    # up is Rowwise where the input it gets is whole: the report names the style that fits
    assert "up is split as RowwiseParallel splits it; ColwiseParallel() may fit" in " ".join(out.stdout.split())


@pytest.mark.parametrize("args, expected", [
    (["no_such_module:f"], "cannot import 'no_such_module' for the model: ModuleNotFoundError"),
    (["user_models:make_mpl"], "'user_models' has no 'make_mpl' for the model; did you mean 'make_mlp'?"),
    (["user_models"], "the model 'user_models' is not module:attribute"),
    (["user_models:make_mlp", "--mesh", "2x2", "--batch", "3"], "batch=3 does not split over dp=2 ranks"),
    (["user_models:make_mlp", "--mesh", "2x2x2", "--dp", "fsdp2", "--batch", "6"], "batch=6 does not split over dp=4 ranks"),
    (["user_models:make_mlp", "--mesh", "2x2x2", "--dp", "ddp"], "dp='ddp' takes a 1-D DP mesh; a (dp_replicate, "
                                                                 "dp_shard, tp) mesh takes hsdp, fsdp1_hybrid, spmd_hsdp, fsdp2"),
    (["user_models:make_mlp", "--mesh", "2x2", "--dp", "hsdp"], "dp='hsdp' needs a (dp_replicate, dp_shard, tp) mesh"),
], ids=["no-module", "no-attribute", "not-a-name", "batch", "batch-3d", "ddp-3d", "hsdp-2d"])
def test_plan_input_mistakes_are_one_line_and_exit_2(args, expected):
    out = plan(*args[:1], "--plan", "user_models:PLAN", "--input", "user_models:vectors", *args[1:])
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and expected in out.stderr, out.stderr


def _broken_judge(pool, impl, n):
    """A property whose judging (in the parent, tpdp-verify's own code) fails."""
    return {}["no such key"]


def test_an_internal_error_exits_3_with_one_line_and_a_log(tmp_path, monkeypatch, capsys):
    from hypothesis import strategies as st

    from tpdp_verify import cli as cli_mod
    from tpdp_verify import properties
    from tpdp_verify.runner.property import tpdp_property

    broken = tpdp_property(n=st.integers(0, 3))(_broken_judge)
    monkeypatch.setattr(properties, "ALL", (broken,))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the log it leaves, in the test's directory
    code = cli_mod.main(["gate", "--json", str(tmp_path / "gate.json"), "--junit", str(tmp_path / "junit.xml")])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1, err
    log = re.search(r"the traceback is in (\S+)$", err.strip()).group(1)
    assert "KeyError: 'no such key'" in Path(log).read_text() and "_broken_judge" in Path(log).read_text()
    record = json.loads((tmp_path / "gate.json").read_text())
    assert record["exit_code"] == 3 and log in record["error"]


def test_a_usage_error_still_writes_the_outputs_asked_for(tmp_path):
    """Exit 2 with --json, --junit and --markdown: each written, saying the input was refused."""
    files = {fmt: tmp_path / f"out.{fmt}" for fmt in ("json", "junit", "markdown")}
    out = cli("gate", "-k", "and and", *(a for fmt, path in files.items() for a in (f"--{fmt}", str(path))))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    record = json.loads(files["json"].read_text())
    assert record["exit_code"] == 2 and record["usage_error"] in out.stderr
    assert 'type="usage"' in files["junit"].read_text() and "usage error" in files["markdown"].read_text()


@pytest.mark.parametrize("refused", [["plan", "m:f", "--plan", "m:p", "--input", "m:i", "--mesh", "2by2"],
                                     ["gate", "--profile", "nightly"], ["gate", "--no-such-option"]])
def test_an_argument_the_parser_refuses_still_writes_the_outputs_asked_for(tmp_path, capsys, refused):
    """argparse's own refusals (a bad --mesh, a choice, an unknown option) exit 2 as any usage
    error does, with --json FILE and --junit=FILE written, saying what was refused."""
    from tpdp_verify import cli as cli_mod

    json_path, junit_path = tmp_path / "out.json", tmp_path / "out.xml"
    code = cli_mod.main([*refused, "--json", str(json_path), f"--junit={junit_path}"])
    err = capsys.readouterr().err
    record = json.loads(json_path.read_text())
    assert code == 2 and record["exit_code"] == 2 and record["command"] == refused[0], record
    assert record["usage_error"].split(":")[0] in err and "--help" in record["usage_error"]
    assert 'type="usage"' in junit_path.read_text()


def test_no_command_leaves_anything_in_the_temp_dir(tmp_path):
    """Each command run as a user runs it (the console script, which exits without Python's
    clean-up): multiprocessing's pymp-* directory and torch inductor's cache directory used
    to stay in the temp dir after every run."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    script = Path(sys.executable).parent / "tpdp-verify"
    runs = [["gate", "--profile", "smoke", "-k", "chunk_dtensor_layout and world2"],
            ["plan", "user_models:make_mlp", "--plan", "user_models:PLAN", "--input", "user_models:vectors",
             "--steps", "1"], ["explain", "1"], ["env"], ["memo"], ["gate", "--mesh"]]
    for args in runs:
        out = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=600, env=env,
                             cwd=USER_MODELS)
        assert out.returncode in (0, 2), (args, out.stdout, out.stderr)
        assert sorted(p.name for p in temp.iterdir()) == [], args


def test_every_gate_option_reaches_the_parts_of_jobs_or_says_why_not():
    """--jobs runs the gate in parts, each given the run's options: read from the parser, so a
    new option reaches them unless NOT_TO_PARTS says why not (it was a hand-made list, which
    dropped what it did not name)."""
    import argparse

    from tpdp_verify import cli as cli_mod

    checked = 0
    for action in cli_mod._subparser("gate")._actions:
        if not action.option_strings or set(action.option_strings) & set(cli_mod.NOT_TO_PARTS):
            continue
        option = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            given, want = [option], [option]
        else:
            value = next(c for c in action.choices if c != action.default) if action.choices else "7"
            given, want = [option, value], [option, str(action.type(value) if action.type else value)]
        parts = cli_mod.part_arguments(cli_mod._parser().parse_args(["gate", *given]))
        at = parts.index(want[0]) if want[0] in parts else next(
            i for i, p in enumerate(parts) if p in action.option_strings)
        assert parts[at + 1: at + len(want)] == want[1:], (option, parts)
        checked += 1
    assert checked >= 12


def test_help_cites_only_the_docs_the_install_ships(capsys):
    """--help once cited docs/*.md, which a wheel does not hold: the docs ship with it now,
    and every page a help text or the gate's next steps name is one `tpdp-verify docs` prints."""
    from tpdp_verify import cli as cli_mod

    cited = []
    for command in [None, *cli_mod.COMMANDS]:
        with pytest.raises(SystemExit):
            cli_mod.main([*([command] if command else []), "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "docs/" not in text, (command, text)
        cited += re.findall(r"tpdp-verify docs ([\w-]+)", text)
    assert "cli" in cited
    assert cli_mod.main(["docs"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert set(cited) <= listed and {"cli", "user-guide", "known-divergences"} <= listed
    assert cli_mod.main(["docs", "cli"]) == 0 and capsys.readouterr().out.startswith("# Command line")
