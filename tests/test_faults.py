"""The fault catalog: its records whole and true to the installed torch, the docs page made
from it, what it explains on the shipped memo (torch 2.13.0's own failures), and what it
must not explain."""

import fnmatch
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpdp_verify import faults, signature
from tpdp_verify.cases.training import Habits, TrainCase
from tpdp_verify.faults import issue, pages
from tpdp_verify.runner import memo as memos

ROOT = Path(__file__).resolve().parent.parent


def test_each_fault_is_a_whole_record():
    numbers = [f.number for f in faults.CATALOG]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 21
    assert len({f.name for f in faults.CATALOG}) == len(numbers)
    for f in faults.CATALOG:
        assert f.title and f.what and f.consequence and f.workaround and f.fix and f.apis and f.source and f.releases, f.number
        assert f.repro_path.is_file() and f.repro.startswith(f"f{f.number:02d}_"), f.number
        assert all(s.parts and (s.properties != ("*",) or s.where) for s in f.shows), f.number  # never anything anywhere
        assert f.project == "torch", f.number  # another project's faults are findings (integrations.findings)


@pytest.mark.parametrize("ref", sorted({s for f in faults.CATALOG for s in f.source}))
def test_the_code_at_fault_is_in_the_installed_torch(ref):
    assert "not in this torch" not in issue.source(ref) and "```python" in issue.source(ref)


def test_the_docs_page_is_the_catalog():
    """docs/known-divergences.md is generated: `tpdp-verify explain --all > docs/known-divergences.md`."""
    assert (ROOT / "docs" / "known-divergences.md").read_text() == pages.page(faults.CATALOG)


def _failing_memo_answers():
    held = json.loads(gzip.open(memos.SHIPPED / "torch-2.13.0.json.gz").read())
    return [a for a in held["asked"] if a["signature"]]


def test_the_catalog_explains_torch_2_13_own_failures_on_the_shipped_memo():
    """Every failure torch 2.13.0 shows on the fixed draws of smoke, ci and release is named
    by a fault, or its parts are listed here (UNCATALOGUED) with what is known of them: the
    gate says of each that no catalogued fault explains it."""
    unexplained, failing = {}, _failing_memo_answers()
    for a in failing:
        e = faults.explain(a["property"], memos.rebuild(a["case"], tuple(a["types"])), a["signature"])
        for part in map(signature.api, e.unexplained):  # listed below by API, whatever the message
            unexplained[(a["property"], part)] = unexplained.get((a["property"], part), 0) + 1
    assert set(unexplained) <= set(UNCATALOGUED), sorted(set(unexplained) - set(UNCATALOGUED))
    assert set(UNCATALOGUED) <= set(unexplained), sorted(set(UNCATALOGUED) - set(unexplained))  # none stale
    # the catalog names all but a few parts (214 of 8566 failing answers when the release draw
    # was recorded whole, 2026-11-28; 105 of 7392 before), each listed above with its reason
    assert sum(unexplained.values()) < 0.03 * len(failing)


def test_every_rule_that_names_a_message_matches_a_failure_torch_2_13_shows():
    """A rule's message is fnmatch text ([ ] a set of characters): one that matches no part
    of the shipped memo names nothing, and the fault's failures would be unexplained."""
    parts = {p for a in _failing_memo_answers() for p in a["signature"]}
    for f in faults.CATALOG:
        for pattern in (p for s in f.shows for p in s.parts if ": " in p):
            assert any(fnmatch.fnmatchcase(part, pattern) for part in parts), (f.number, pattern)


# (property, part) that no record explains on the shipped memo's cases, and why not (yet):
# the harness's own (to fix there, with a HARNESS bump), or torch's not yet shrunk to a reproduction
HARNESS_SPMD = "the harness: an optimizer built after a forward in the SPMD replicate form holds the parameters the unsharded root replaced; the unsharded_after_forward exclusion misses this form"
HARNESS_WRAP = "the harness: its FSDP1 wrap policy makes a ModuleList a unit, whose forward never runs; plain FSDP1 fails alike"
HARNESS_LOSS = "the harness: fixtures.losses.token_cross_entropy mixes full_tensor() with the DTensor weight on a tp mesh of 1 in the SPMD form"
HARNESS_TEACHER = ("the harness: fixtures.losses._like redistributes the SPMD form's replicated teacher to the "
                   "logits' placements, Partial(sum) under loss_parallel on a tp mesh of 1, which DTensor refuses")
EMPTY = "torch, not yet shrunk: FSDP2 with an empty TP shard beside fault 22 (replicas disagree on the state_dict before training; _dynamo asserts with shard_dim=1)"
UNCATALOGUED = {
    **{(p, part): EMPTY for p in ("state_dict_like_unsharded", "entry_points_state_dict_like_unsharded",
                                  "large_dp_state_dict_like_unsharded")
       for part in ("check:every-rank-has-the-same-state_dict-entries", "check:replicas-agree-on-the-state_dict",
                    "check:replicas-agree-on-the-state_dict-before-training",
                    "check:replicas-agree-on-the-trained-model")},
    ("large_dp_trains_like_plain_dp", "raised:AssertionError at torch/_dynamo/eval_frame.py:_fn"): EMPTY,
    **{(p, part): HARNESS_SPMD for p in ("large_dp_trains_like_one_device", "large_dp_trains_like_plain_dp",
                                         "losses_train_like_one_device")
       for part in ("check:every-optimizer-state-is-there", "check:trainable-parameters-move-as-in-the-oracle")},
    **{("large_dp_trains_like_one_device", f"raised:RuntimeError at torch/nn/modules/{at}"): HARNESS_WRAP
       for at in ("container.py:forward", "normalization.py:forward", "module.py:_wrapped_call_impl")},
    ("losses_train_like_one_device", "raised:RuntimeError at torch/distributed/tensor/_api.py:redistribute"):
        HARNESS_TEACHER,
    ("large_dp_checkpoint_resumes", "raised:RuntimeError"): HARNESS_LOSS,
    ("large_dp_state_dict_like_unsharded", "raised:RuntimeError"): HARNESS_LOSS,
    ("entry_points_train_like_one_device", "check:gradient-present-where-the-oracle-has-one"):
        "FSDP1's own (plain FSDP1 alike): the unused model's spare branch gets a zero gradient, not none",
    ("large_dp_trains_like_one_device", "check:gradient-present-where-the-oracle-has-one"): "not yet shrunk",
    ("trains_like_plain_ddp", "value:gradient"): "not yet shrunk: llama_lm in bfloat16 under transform_ddp",
}


def test_a_failure_outside_every_faults_conditions_is_not_named():
    """The same part that fault 1 explains under DDP is not torch's fault 1 under FSDP2,
    where the transform does not run: a user's bug there is never filed as a known fault."""
    part = "check:parameters-stay-registered-in-order"
    under_ddp = faults.explain("trains_like_one_device", {"case": TrainCase(entry="ddp_mesh", built="after_forward")},
                               (part,))
    under_fsdp2 = faults.explain("trains_like_one_device", {"case": TrainCase(entry="fully_shard")}, (part,))
    assert 1 in [f.number for f in under_ddp.faults] and under_ddp.explained
    assert not under_fsdp2.faults and under_fsdp2.unexplained == (part,)
    nothing = faults.explain("trains_like_one_device", {"case": TrainCase(habits=Habits())}, ("check:no-such-check",))
    assert not nothing.explained and "no catalogued fault explains check:no-such-check" in nothing.line()


def test_fsdp2_over_a_per_part_shard_is_named_only_where_a_weight_is_sharded_per_part_and_over_dp():
    """Fault 36 names a value's departure through fully_shard where a weight is sharded per
    part over tp (the zoo's fused model, or a user's model whose run says so: the plan
    report's ``per_part``) and FSDP2 shards it over more than one dp rank; not elsewhere."""
    part = "value:gradient"

    def named(case, **drawn):
        return [f.number for f in faults.explain("trains_like_one_device", {"case": case, **drawn}, (part,)).faults]

    assert 36 in named(TrainCase(model="fused", entry="fully_shard", mesh_shape=(2, 2)))
    users = TrainCase(model="mlp", entry="fully_shard", mesh_shape=(2, 2), user=object())
    assert 36 in named(users, per_part=True) and 36 not in named(users, per_part=False)
    assert 36 not in named(TrainCase(model="fused", entry="fully_shard", mesh_shape=(1, 2)))  # one dp rank
    assert 36 not in named(TrainCase(model="fused", entry="replicate_fsdp", mesh_shape=(2, 2)))  # no dp shard
    assert 36 not in named(TrainCase(model="mlp", entry="fully_shard", mesh_shape=(2, 2)))


def test_a_runs_known_failures_are_tallied_by_fault():
    named = {"faults": [faults.find("15").summary()], "unexplained": []}
    record = [{"name": "p", "world_size": 2, "findings": [
        {"status": "known", **named}, {"status": "known", "faults": [], "unexplained": ["hang"]},
        {"status": "NEW", **named}]}]
    assert faults.tally(record) == {"known": 2, "explained": 1, "by_fault": {"15": 1},
                                    "unexplained": [{"property": "p", "world_size": 2, "parts": ["hang"]}]}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tpdp_verify", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT / "tests")


def test_explain_prints_a_fault_and_refuses_an_unknown_one_in_one_line():
    out = _cli("explain", "15")
    assert out.returncode == 0 and out.stdout.startswith("### 15. Under `loss_parallel`") and "Workaround" in out.stdout
    assert _cli("explain", "fault 15").stdout == out.stdout and "[pytorch#191606](" in out.stdout
    listing = _cli("explain")
    assert listing.returncode == 0 and len(re.findall(r"^\| \[\d+\]", listing.stdout, re.M)) == len(faults.CATALOG)
    bad = _cli("explain", "99")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "tpdp-verify explain" in bad.stderr


def test_report_prints_an_upstream_issue_with_the_code_at_fault():
    out = _cli("report", "16", "--no-run")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("title: [DTensor] Under a float32 `reduce_dtype`")
    assert text.splitlines()[1] == "file at: https://github.com/pytorch/pytorch/issues"  # whose code: torch's
    assert faults.find("16").repro_path.read_text().strip() in text  # the standalone reproduction, whole
    assert "def _get_grad_inner_tensor" in text and "_fsdp_param.py`, lines " in text  # torch's code as installed
    assert "https://github.com/pytorch/pytorch/issues/190626" in text and "### Workaround" in text


def test_an_upstream_draft_is_filed_as_it_is():
    """What a maintainer asks of an issue: torch's environment (collect_env), no path of this
    machine, and of torch's code the lines at fault with their numbers, not whole functions."""
    import sys
    from pathlib import Path

    text = _cli("report", "2", "--no-run").stdout
    assert "### Environment" in text and "PyTorch version:" in text and "Python version:" in text
    assert sys.prefix not in text and str(Path.home()) not in text
    where = text.split("### Where", 1)[1].split("### Workaround", 1)[0]
    assert "`torch/distributed/tensor/parallel/ddp.py`, lines " in where and "the lines at fault:" in where
    assert re.search(r"^ +\d+ +t = nn\.Parameter\(t\)$", where, re.M), where  # the line, numbered
    body = [ln for ln in where.splitlines() if re.match(r"^ +\d+  ", ln)]
    assert "    ..." in where and len(body) < 20, where  # not the functions whole


@pytest.mark.timeout(300)
def test_report_runs_the_reproduction_and_says_which_releases_show_it():
    out = _cli("report", "15")
    assert out.returncode == 0, out.stderr
    assert re.search(r"torch 2\.13\.0\S*: the fault is present", out.stdout), out.stdout[-3000:]
    assert "expected:" in out.stdout and "actual:" in out.stdout
    assert "Releases that show it here: 2.13.0" in out.stdout
