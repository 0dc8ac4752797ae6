"""The gate's own bounds, on toy properties over a real pool: shrinking has a budget for the
whole run, so a build that breaks many properties still gets a verdict in bounded time."""

import dataclasses

import pytest

from tpdp_verify.runner import profiles
from tpdp_verify.runner.gate import run_gate, summary

from toy_suite import chatty, first, second, silent


@pytest.mark.timeout(300)
def test_once_the_shrinking_budget_is_spent_later_failures_come_as_first_found():
    profile = dataclasses.replace(profiles.get("ci"), world_sizes=(2,), shrink_total=0.01)
    outcomes = run_gate((first, second), profile, "reference", progress=lambda line: None)
    shrunk, unshrunk = outcomes
    assert [o.status for o in outcomes] == ["diverges", "diverges"]
    assert not shrunk.unshrunk and shrunk.stats.shrink_seconds >= 0.01
    assert shrunk.findings[0].drawn == {"n": 11}  # shrunk to the boundary
    assert unshrunk.unshrunk and unshrunk.stats.shrink_seconds < 0.01
    assert unshrunk.findings[0].drawn["n"] > 11 and unshrunk.findings[0].replay  # as drawn, still replayable
    text = summary(outcomes, profile, "reference", 1.0)
    assert "the gate spent its 0.01 s of shrinking (ci); 1 later searches reported their failures as first " \
           "found: second (world 2)" in text
    assert "(the case as first found: the gate's shrinking budget was spent)" in text


def test_a_findings_text_keeps_the_failing_case_and_leaves_out_hypothesis_asides():
    from tpdp_verify.judging.divergence import divergence
    from tpdp_verify.runner.gate import _failure_text

    found = divergence(("check:toy-stays-small",))("n = 12 is above 10")
    found.add_note("Failing test case: first(n=12)")
    found.add_note("Explanation:\n    These lines were always and only run by failing test cases:\n        a.py:1")
    found.add_note("WARNING: Hypothesis has spent more than five minutes working to shrink a failing test case")
    text = _failure_text(found, ["Explanation: more of it", "the ranks said so"])
    assert text == ("tpdp_verify.judging.divergence.ToyStaysSmall: n = 12 is above 10\n"
                    "Failing test case: first(n=12)\nthe ranks said so")


@pytest.mark.timeout(300)
def test_what_the_ranks_print_is_kept_with_the_search_it_came_from(tmp_path):
    profile = dataclasses.replace(profiles.get("smoke"), world_sizes=(2,))
    outcomes = run_gate((chatty, silent), profile, "reference", progress=lambda line: None,
                        rank_output=str(tmp_path))
    loud, quiet = outcomes
    assert loud.status == "diverges" and loud.rank_output == str(tmp_path / "chatty-world2.log")
    text = (tmp_path / "chatty-world2.log").read_text()
    assert text.startswith("==> rank0 <==\n") and "==> rank1 <==\n" in text
    assert text.count("rank says n = ") == 2 * loud.stats.examples > 0  # every call, each rank once
    assert quiet.status == "pass" and quiet.rank_output == ""  # nothing printed: no file
    assert all(p.read_bytes() == b"" for p in tmp_path.glob("world2-rank*.log"))  # moved, not copied
    assert f"what the ranks printed during this search (-v shows it as it comes): {loud.rank_output}" \
        in summary(outcomes, profile, "reference", 1.0)


def test_a_keyword_a_new_torch_adds_to_an_entry_point_is_listed(monkeypatch):
    """The gate reads the entry points' signatures: a keyword no case sets shows at once."""
    from torch.nn.parallel import DistributedDataParallel

    from tpdp_verify.runner import coverage

    def init(self, module, process_group=None, device_mesh=None, static_graph=False, new_knob=None):
        pass

    monkeypatch.setattr(DistributedDataParallel, "__init__", init)
    missing = coverage.unexercised()
    assert missing["DistributedDataParallel"] == ["new_knob"]
    assert "DistributedDataParallel: new_knob;" in coverage.summary_line(missing)
    assert coverage.record(missing)["DistributedDataParallel"] == {"new_knob": ""}


def test_torch_2_13s_unset_keywords_are_each_listed_or_explained():
    from tpdp_verify.runner import coverage

    missing = coverage.unexercised()
    assert set(missing) == set(coverage.ENTRY_POINTS)  # torch 2.13 has every entry point
    assert {"bucket_cap_mb", "static_graph", "device_mesh", "forward_sync_buffers"}.isdisjoint(
        missing["DistributedDataParallel"])  # what cases set is not listed
    assert "(device_ids)" in coverage.summary_line(missing)  # not set on purpose, with a reason in the JSON
    assert coverage.record(missing)["DistributedDataParallel"]["device_ids"].startswith("a CUDA module")
    # every keyword of the DP that large models train with is drawn or explained (FSDP1's
    # process_group, auto_wrap_policy and mixed_precision drawn: tests/test_large_dp.py, test_wiring.py)
    for entry in ("fully_shard", "replicate (FSDP2-based)", "FullyShardedDataParallel"):
        assert all(coverage.reason(entry, k) for k in missing[entry]), (entry, missing[entry])
