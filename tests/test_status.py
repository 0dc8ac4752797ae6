"""Every status through every output: the gate's verdict and exit code, its JSON, JUnit and
Markdown, merge of its parts, the pytest item and the baseline's sentence all say what
tpdp_verify.status says of it. Made-up outcomes, in milliseconds: a run that the release
could not be asked about once exited 4 and failed its pytest item while its JUnit file
showed nothing red and its Markdown said "passes"."""

import json
import types
import xml.etree.ElementTree as ET

import pytest

from tpdp_verify import outputs, status
from tpdp_verify.collect import RUN, Search, SearchFailed
from tpdp_verify.errors import EXIT_DIVERGENCE, EXIT_INFRA, EXIT_NOT_ASKED, EXIT_OK
from tpdp_verify.runner import baseline, merge, profiles
from tpdp_verify.runner.gate import Finding, Outcome, interrupted, summary, verdict
from tpdp_verify.runner.property import Stats
from tpdp_verify.status import Found, Status

SIG = ("check:gradients-match",)
INTERRUPTED_EXIT = 130


def _finding(found: Found) -> Finding:
    return Finding(f"{found}: made up", "print('replay')\n", "gradients match", {"case": 1}, SIG, found)


def _search(name: str, found: list[Found] = (), infra: bool = False) -> Outcome:
    stats = Stats(examples=4, passed=4 - len(found), drawn=4, known=found.count(Found.KNOWN),
                  not_asked=found.count(Found.NOT_ASKED))
    o = Outcome(name, 2, Status.PASS, 1.0, stats, findings=[_finding(f) for f in found], backend="gloo", wanted=4,
                message="ranks would not start" if infra else "")
    if infra:
        o.status = Status.INFRA
    o.judged()
    return o


# One search of each status (and of each finding status within it), beside a passing one.
RUNS = {
    Status.PASS: [_search("passes"), _search("fixed", [Found.FIXED])],
    Status.KNOWN: [_search("passes"), _search("knows", [Found.KNOWN])],
    Status.NOT_ASKED: [_search("passes"), _search("unasked", [Found.KNOWN, Found.NOT_ASKED])],
    Status.DIVERGES: [_search("passes"), _search("found", [Found.FOUND]), _search("new", [Found.NEW, Found.KNOWN]),
                      _search("changed", [Found.CHANGED, Found.NOT_ASKED])],
    Status.INFRA: [_search("passes"), _search("new", [Found.NEW]), _search("lost", infra=True)],
    Status.INTERRUPTED: [_search("passes")],
}
EXIT = {Status.PASS: EXIT_OK, Status.KNOWN: EXIT_OK, Status.NOT_ASKED: EXIT_NOT_ASKED,
        Status.DIVERGES: EXIT_DIVERGENCE, Status.INFRA: EXIT_INFRA, Status.INTERRUPTED: INTERRUPTED_EXIT}


def _outcomes(s: Status) -> list[Outcome]:
    if s is Status.INTERRUPTED:
        left = [(types.SimpleNamespace(name="left"), 2)]
        return RUNS[s] + interrupted(left, "SIGINT", 3.0, 4)
    return RUNS[s]


def _record(s: Status, outcomes: list[Outcome], selection: dict | None = None) -> dict:
    code = EXIT[s]
    stopped = {"signal": "SIGINT", "during": "search"} if s is Status.INTERRUPTED else None
    judged = baseline.Judgement.of(outcomes)
    return json.loads(outputs.to_json(outputs.gate_record(
        outcomes, profiles.get("smoke"), "torch", "gloo", 9.0, code, "2026-01-01T00:00:00+00:00",
        baseline="torch==2.13.0", judged=judged, interrupted=stopped, selection=selection)))


@pytest.mark.parametrize("s", list(Status))
def test_the_gates_verdict_and_exit_code(s):
    outcomes = _outcomes(s)
    assert verdict(outcomes) is s
    assert s.exit_code == (EXIT_INFRA if s is Status.INTERRUPTED else EXIT[s])  # a signal's code is the CLI's
    assert s.green == (EXIT[s] == EXIT_OK) and s.blocks == (EXIT[s] == EXIT_DIVERGENCE)
    text = summary(outcomes, profiles.get("smoke"), "torch", 9.0, full=False)
    assert status.counted(status.count(o.status for o in outcomes)) in text


@pytest.mark.parametrize("s", list(Status))
def test_json_junit_and_markdown_agree_with_the_exit_code(s):
    record = _record(s, _outcomes(s))
    assert record["verdict"] == s and record["exit_code"] == EXIT[s]
    assert status.of_counts(record["counts"], record["error"]) is s
    root = ET.fromstring(outputs.to_junit(record))
    red = int(root.get("failures")) + int(root.get("errors"))
    assert (red == 0) == (EXIT[s] == EXIT_OK), outputs.to_junit(record)
    for case in root.iter("testcase"):
        name = case.get("name").split("[")[0]
        want = next(Status(p["status"]) for p in record["properties"] if p["name"] == name).junit
        assert [e.tag for e in case if e.tag in ("failure", "error")] == ([want] if want else []), name
    markdown = outputs.to_markdown(record)
    assert status.verdict_line(s, EXIT[s]) in markdown
    assert ("passes" in markdown.split("\n")[2]) == (EXIT[s] == EXIT_OK)


@pytest.mark.parametrize("s", list(Status))
def test_merge_of_the_parts_agrees_with_the_whole_run(s):
    outcomes = _outcomes(s)
    ids = [f"{o.property}[world_size={o.world_size}]" for o in outcomes]
    halves = [outcomes[: len(outcomes) // 2], outcomes[len(outcomes) // 2:]]
    parts = []
    for k, half in enumerate(halves, 1):
        selection = {"keyword": None, "shard": f"{k}/2", "plan": ids,
                     "searches": [f"{o.property}[world_size={o.world_size}]" for o in half]}
        part = s if any(o.status == s for o in half) or s is Status.PASS else status.worst(o.status for o in half)
        parts.append((f"part{k}.json", _record(part, half, selection)))
    merged = merge.merge(parts)
    whole = _record(s, outcomes)
    assert merged["exit_code"] == whole["exit_code"] == EXIT[s]
    assert merged["counts"] == whole["counts"]
    assert merge.summary(merged).endswith(status.verdict_line(s, EXIT[s]))
    assert outputs.to_junit(merged).count("<failure") == outputs.to_junit(whole).count("<failure")


@pytest.mark.parametrize("s", [s for s in Status if s is not Status.INTERRUPTED])
def test_a_pytest_item_fails_exactly_where_the_gate_does_not_exit_0(s):
    for o in RUNS[s]:
        item = types.SimpleNamespace(user_properties=[], prop=None, world_size=2,
                                     config=types.SimpleNamespace(stash={RUN: types.SimpleNamespace(
                                         search=lambda prop, ws, o=o: o)}))
        if o.status.green:
            Search.runtest(item)
            assert bool(item.user_properties) == (o.status is Status.KNOWN)
        else:
            with pytest.raises(SearchFailed):
                Search.runtest(item)


@pytest.mark.parametrize("s", [Status.KNOWN, Status.NOT_ASKED, Status.DIVERGES, Status.INFRA])
def test_the_baselines_sentence_is_the_runs(s):
    outcomes = _outcomes(s)
    text = baseline.report(baseline.Judgement.of(outcomes), "torch==2.13.0", verdict(outcomes))
    assert text.endswith(f": {s.sentence}")
    assert ("no verdict" in text) == (not s.judged) and ("passes" in text) == s.green


@pytest.mark.parametrize("s", [Status.PASS, Status.KNOWN, Status.DIVERGES, Status.INTERRUPTED])
def test_a_plans_outputs_agree_with_its_exit_code(s):
    checks = [{"check": "gradients match", "ok": s is Status.PASS, "compared": 3, "failed": 0 if s is Status.PASS
               else 1, "worst_ratio": 2.0, "detail": "w.grad beyond its bound"}]
    record = {"schema": outputs.SCHEMA, "command": "plan", "tpdp_verify": "x", "torch": "2.13.0", "python": "3.11",
              "started": "2026-01-01T00:00:00+00:00", "seconds": 1.0, "exit_code": EXIT[s],
              "interrupted": {"signal": "SIGINT"} if s is Status.INTERRUPTED else None, "ok": s.green, "status": s,
              "case": {"model": "m:f", "mesh": [1, 2], "dp": "fsdp2", "steps": 1, "dtype": "float32"},
              "checks": [] if s is Status.INTERRUPTED else checks, "report": "r", "replay": ""}
    root = ET.fromstring(outputs.to_junit(record))
    red = int(root.get("failures")) + int(root.get("errors"))
    assert (red == 0) == (EXIT[s] == EXIT_OK)
    assert outputs.to_markdown(record).startswith(f"# tpdp-verify plan: m:f: {s.label}")


def test_every_status_has_its_words():
    for s in Status:
        assert s.sentence and s.label == s.value.upper() and s.key.isidentifier()
    assert [f for f in Found if f.blocks] == [Found.FOUND, Found.NEW, Found.CHANGED]
    assert [f for f in Found if f.goes_on] == [Found.KNOWN, Found.NOT_ASKED]
