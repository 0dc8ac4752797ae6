"""transformers models as they come: a tiny random-init Llama and Qwen2 with the TP plans
transformers ships, their own loss from labels, their ModelOutput, verified with no wrapper
from Python, pytest and the shell (issue 17). Needs the hf extra (`make test` installs it)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -c constraints.txt -e .[hf]")

import hf_models as hm  # noqa: E402

from tpdp_verify import UsageError, verify_plan  # noqa: E402
from tpdp_verify.ranks.pool import RankPool  # noqa: E402

TESTS = str(Path(__file__).parent)
pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as p:
        yield p


def verify(model_fn=hm.make_llama, plan="auto", **kw):
    kw.setdefault("steps", 2)
    return verify_plan(model_fn, plan, input_fn=hm.tokens, loss_fn=hm.model_loss, mesh=(1, 2), **kw)


@pytest.mark.parametrize("model_fn", [hm.make_llama, hm.make_qwen2], ids=["llama", "qwen2"])
def test_a_transformers_model_with_its_own_plan_passes_under_fsdp2(pool, model_fn):
    report = verify(model_fn, dp="fsdp2", pool=pool)
    assert report.status == "pass", str(report)
    lines = {x.check: x for x in report.lines}
    assert lines["plan keys resolve"].compared == 9  # lm_head, embed_tokens, 7 per-layer keys under model.
    outputs = [(r.name, r.step) for r in report.one_device.rows if r.what == "output"]
    assert outputs == [("logits", 1), ("logits", 2)] and lines["forward output"].failed == 0  # each step's batch
    assert report.one_device.unread == [
        "loss (shape []: no dim 0 of the batch's 2 rows to put together)",
        "past_key_values (a DynamicCache, not a tensor)"]  # the loss is judged as the loss; no cache compared
    assert "output leaves not compared: loss" in str(report)


@pytest.mark.parametrize("model_fn", [hm.make_llama, hm.make_qwen2], ids=["llama", "qwen2"])
def test_the_known_registry_fault_under_ddp_with_a_mesh_is_labelled_known(pool, model_fn):
    report = verify(model_fn, dp="ddp_mesh", pool=pool, baseline="torch==2.13.0")
    assert report.status == "known", str(report)
    assert "parameters stay registered in order (vs one device): with tpdp-verify's reference transform in " \
        "torch's place, the same run does not show it" in " ".join(str(report).split())
    assert "'model.layers.0.self_attn.q_proj.weight'" in str(report)


def test_a_wrong_style_for_o_proj_is_named(pool):
    """transformers' base_model_tp_plan as the config ships it (keys under the base model,
    style strings), with o_proj colwise: its forward fails on its sharded input."""
    report = verify(plan=hm.WRONG_O_PROJ, dp="fsdp2", pool=pool)
    assert report.status == "diverges"
    assert report.first_module == "model.layers.0.self_attn.o_proj", str(report)
    assert "the module whose forward raised: model.layers.0.self_attn.o_proj" in str(report)


@pytest.mark.parametrize("plan, expected", [
    ({"layers.*.mlp.gate_proj": "packed_colwise"}, "plan key 'layers.*.mlp.gate_proj': style 'packed_colwise' is not "
     "one tpdp-verify can map to torch's ParallelStyles; the strings it accepts (as transformers maps them): "
     "colwise, rowwise, "),
    ({"layers.*.mlp.gate_prj": "colwise"}, "plan key 'layers.*.mlp.gate_prj' matches no module of the model; did you "
     "mean"),
])
def test_plan_strings_it_cannot_take_are_one_line_before_any_rank(plan, expected):
    class NoRanks:
        world_size = 2

    with pytest.raises(UsageError) as excinfo:
        verify(plan=plan, pool=NoRanks())
    assert str(excinfo.value).startswith(expected) and "\n" not in str(excinfo.value)


def test_a_model_without_a_plan_of_its_own_cannot_take_auto():
    import user_models as um

    with pytest.raises(UsageError, match=r"^plan='auto' takes the model's own TP plan \(transformers' model.tp_plan\); "
                                         r"MLP has none: give a plan dict or parallelize_fn$"):
        verify_plan(um.make_mlp, "auto", input_fn=um.vectors, pool=RankPool.__new__(RankPool))


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tpdp_verify", "plan", "hf_models:make_llama", "--input",
                           "hf_models:tokens", "--loss", "hf_models:model_loss", "--steps", "1", *args],
                          capture_output=True, text=True, timeout=280, cwd=TESTS)


@pytest.mark.timeout(600)
def test_from_the_shell_with_no_wrapper(tmp_path):
    passes = cli("--plan", "auto", "--dp", "fsdp2", "--mesh", "2x2", "--json", str(tmp_path / "r.json"))
    assert passes.returncode == 0, passes.stdout + passes.stderr
    assert "hf_models:make_llama with TP on mesh (dp=2, tp=2), dp=fsdp2, 1 step, float32: PASS" in passes.stdout
    assert json.loads((tmp_path / "r.json").read_text())["outputs_not_compared"][0].startswith("loss")
    known = cli("--plan", "auto", "--dp", "ddp_mesh", "--baseline", "torch==2.13.0")
    assert known.returncode == 0 and "PASS but for known torch faults (torch==2.13.0)" in known.stdout, known.stdout
    wrong = cli("--plan", "hf_models:WRONG_O_PROJ", "--dp", "fsdp2")
    assert wrong.returncode == 1 and "the module whose forward raised: model.layers.0.self_attn.o_proj" in wrong.stdout
    assert "Traceback" not in wrong.stdout + wrong.stderr


@pytest.mark.timeout(300)
def test_from_pytest_with_the_fixture(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", TESTS)
    pytester.makepyfile(test_user="""
import hf_models as hm

def test_llama(tpdp):
    tpdp.verify_plan(hm.make_llama, "auto", input_fn=hm.tokens, loss_fn=hm.model_loss, dp="fsdp2", steps=1)

def test_llama_wrong(tpdp):
    tpdp.verify_plan(hm.make_llama, hm.WRONG_O_PROJ, input_fn=hm.tokens, loss_fn=hm.model_loss, dp="fsdp2", steps=1)
""")
    result = pytester.runpytest_subprocess("--tpdp-world-size", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*the module whose forward raised: model.layers.0.self_attn.o_proj*"])
    assert not re.search(r"^E\s+Traceback", result.stdout.str(), re.M)
