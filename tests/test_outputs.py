"""The gate's files from made-up outcomes: what a smoke run against torch never produces
(a pass, ranks that hung, a run cut short, text XML cannot carry), in milliseconds."""

import json
import os
import xml.etree.ElementTree as ET

import pytest
import torch

from tpdp_verify import outputs
from tpdp_verify.errors import UsageError
from tpdp_verify.runner import profiles
from tpdp_verify.runner.gate import Finding, Outcome, interrupted
from tpdp_verify.runner.property import Stats
from tpdp_verify.status import Found

FAILURE = "tpdp_verify.judging.divergence.Diverged: 2 of 9 values beyond their bound\nFalsifying example: f(case=1)"
SIGNATURE = ("check:parameters-stay-registered-in-order", "value:gradient")
OUTCOMES = [
    Outcome("passes", 4, "pass", 1.25, Stats(examples=40, passed=40, drawn=40), backend="gloo", wanted=40),
    Outcome("diverges", 4, "diverges", 2.5, Stats(examples=12, passed=11, drawn=11),
            findings=[Finding(FAILURE + "\x1b[0m ```", "print('replay')\n", "k", {"case": 1}, SIGNATURE, Found.NEW)],
            backend="gloo", wanted=40),
    Outcome("hangs", 4, "infra", 120.0, Stats(examples=1),
            message="ranks 1, 3 hung:\n  all in a barrier", backend="gloo", wanted=40),
    Outcome("knows", 4, "known", 3.0, Stats(examples=40, passed=2, drawn=40, known=38),
            findings=[Finding("known", "print('replay')\n", "parameters stay registered in order", {"case": 2},
                              SIGNATURE[:1], Found.KNOWN)], backend="gloo", wanted=40),
]


def record(error=""):
    return outputs.gate_record(OUTCOMES, profiles.get("ci"), "reference", "auto", 130.0, 3,
                               "2025-01-01T00:00:00+00:00", error)


def test_json_counts_and_keys():
    data = json.loads(outputs.to_json(record()))
    assert data["counts"] == {"pass": 1, "known": 1, "not_asked": 0, "diverges": 1, "infra": 1, "interrupted": 0}
    assert data["interrupted"] is None
    assert [p["status"] for p in data["properties"]] == ["pass", "diverges", "infra", "known"]
    assert data["properties"][0]["report"] == "" and data["properties"][1]["findings"][0]["replay"]
    assert list(data["properties"][0]) == ["name", "world_size", "backend", "status", "drawn", "wanted",
                                           "drew_fewer", "stopped_because", "covered", "known_only",
                                           "examples", "passed", "discarded", "seconds", "unshrunk",
                                           "shrink_seconds", "not_asked", "reran", "not_rerun",
                                           "died_after_other_cases", "rank_output", "message", "findings", "report"]
    assert data["shrink_total"] == profiles.get("ci").shrink_total
    finding = data["properties"][1]["findings"][0]
    assert (finding["status"], finding["signature"]) == ("NEW", list(SIGNATURE))
    assert [p["drew_fewer"] for p in data["properties"]] == [False, True, False, False]


def test_junit_fails_exactly_the_blocking_divergences_and_errors_a_hang():
    suite = ET.fromstring(outputs.to_junit(record())).find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("4", "1", "1")
    passes, diverges, hangs, knows = suite.findall("testcase")
    assert list(passes) == [] and passes.get("time") == "1.250"
    failure = diverges.find("failure")
    assert failure.get("message") == "NEW: k"
    assert "\x1b" not in failure.text and "Falsifying example: f(case=1)" in failure.text
    assert hangs.find("error").get("message") == "ranks 1, 3 hung: all in a barrier"
    assert knows.find("failure") is None and "known" in knows.find("system-out").text


def test_junit_counts_a_run_cut_short_as_one_more_error():
    why = "ranks of world size 8 did not start"
    suite = ET.fromstring(outputs.to_junit(record(why))).find("testsuite")
    assert (suite.get("tests"), suite.get("errors")) == ("5", "2")
    assert suite.findall("testcase")[-1].find("error").get("message") == why


def test_an_interrupted_run_lists_the_searches_left_and_is_an_error_in_every_file():
    left = interrupted([(type("P", (), {"name": n})(), 4) for n in ("running", "waiting")], "SIGTERM", 2.5, 40)
    data = outputs.gate_record(OUTCOMES[:1] + left, profiles.get("ci"), "torch", "auto", 9.0, 143,
                               "2025-01-01T00:00:00+00:00", "interrupted by SIGTERM during running (world size 4)",
                               interrupted={"signal": "SIGTERM", "during": "search"})
    assert data["interrupted"] == {"signal": "SIGTERM", "during": "search", "not_run": [
        {"name": "running", "world_size": 4}, {"name": "waiting", "world_size": 4}]}
    assert data["counts"]["interrupted"] == 2 and not any(p["drew_fewer"] for p in data["properties"])
    assert [p["message"] for p in data["properties"][1:]] == ["interrupted by SIGTERM while it ran",
                                                              "not run: the gate was interrupted by SIGTERM"]
    suite = ET.fromstring(outputs.to_junit(data)).find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("4", "0", "3")
    assert [c.find("error").get("message") for c in suite.findall("testcase")[1:3]] == [
        "interrupted by SIGTERM while it ran", "not run: the gate was interrupted by SIGTERM"]
    md = outputs.to_markdown(data)
    assert md.startswith("# tpdp-verify gate: INTERRUPTED by SIGTERM: 1 passed, 0 known only, 0 diverged, "
                         "0 infrastructure failures, 2 interrupted\n")
    assert "| running | 4 | INTERRUPTED | 0 | 0 |  | 2.5 |" in md and "## running" not in md


def test_markdown_fences_each_report_beyond_its_own_backticks():
    md = outputs.to_markdown(record("cut short"))
    assert "| diverges | 4 | DIVERGES | 11 (fewer than 40) | 0 | NEW: k | 2.5 |" in md
    assert "**The run stopped early**: cut short" in md
    assert md.count("\n````text\n") == 1 and md.count("\n```text\n") == 2  # the hang and the known: none


def test_check_writable_leaves_no_file_and_keeps_an_existing_one(tmp_path):
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    outputs.check_writable({"--json": str(existing), "--junit": str(tmp_path / "new.xml")})
    assert existing.read_text() == "kept" and not (tmp_path / "new.xml").exists()
    with pytest.raises(UsageError, match=r"^cannot write --markdown .*/no/x.md: No such file"):
        outputs.check_writable({"--markdown": str(tmp_path / "no" / "x.md")})


def test_check_writable_refuses_a_folder_that_takes_no_new_file(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    (folder / "gate.json").write_text("old")
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("this user writes anywhere (root)")
        with pytest.raises(UsageError, match=r"^cannot write --json .*gate.json: Permission denied"):
            outputs.check_writable({"--json": str(folder / "gate.json")})
    finally:
        folder.chmod(0o755)


def test_a_plan_report_renders_as_json_junit_and_markdown_that_agree():
    from tpdp_verify.cases.training import TrainCase
    from tpdp_verify.judging.verdict import Verdict
    from tpdp_verify.ranks.observation import Check
    from tpdp_verify.report import Report

    one = Verdict([Check("trains without an exception", False, "rank 1: in the forward of up: boom | bang")])
    report = Report.of(TrainCase(model="m:make", mesh_shape=(1, 2)), 2, one, Verdict(against="plain DDP"), "replay")
    record = json.loads(outputs.to_json(outputs.plan_record(report, 1, "2025-01-01T00:00:00+00:00", 3.0)))
    assert (record["schema"], record["command"], record["exit_code"]) == (outputs.SCHEMA, "plan", 1)
    assert record["torch"] == torch.__version__ and not record["ok"]
    checks = {c["check"]: c for c in record["checks"]}
    assert checks["plan keys resolve"]["ok"] is True
    assert checks["trains without an exception"]["ok"] is False
    assert checks["gradients vs one device"] == {**checks["gradients vs one device"], "ok": None,
                                                 "detail": "not reached: training raised"}
    assert "buffers" not in checks  # nothing there: no row
    suite = ET.fromstring(outputs.to_junit(record)).find("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == (str(len(checks)), "1")
    (failed,) = [c for c in suite.findall("testcase") if c.find("failure") is not None]
    assert failed.get("name") == "trains without an exception"
    assert int(suite.get("skipped")) == sum(c["ok"] is None for c in checks.values()) > 0
    markdown = outputs.to_markdown(record)
    assert markdown.startswith("# tpdp-verify plan: m:make: DIVERGES")
    assert "| trains without an exception | FAIL | 1 | trains without an exception: rank 1: in the forward of up: boom \\| bang |" in markdown


def test_a_plan_report_files_every_kind_of_value_the_training_judge_compares():
    """Each Row.what of tpdp_verify.judging.verdict (habits' kinds too) lands in a report line."""
    from tpdp_verify.cases.training import TrainCase
    from tpdp_verify.judging.tolerance import Error
    from tpdp_verify.judging.verdict import Row, Verdict
    from tpdp_verify.report import Report

    kinds = ("output", "loss", "gradient", "gradient norm", "direct output", "parameter", "optimizer state", "buffer")
    one = Verdict(rows=[Row(kind, 1, "x", Error(0.0, 0.0, 1.0)) for kind in kinds])
    report = Report.of(TrainCase(model="m:make", mesh_shape=(1, 2)), 1, one, Verdict(against="plain DDP"), "replay")
    assert sum(line.compared for line in report.lines) == 1 + len(kinds)  # the plan key, then each value
