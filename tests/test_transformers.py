"""transformers models as they come: a tiny random-init Llama and Qwen2 with the TP plans
transformers ships, their own loss from labels, their ModelOutput, verified with no wrapper
from Python, pytest and the shell (issue 17); and sharded by transformers' own distributed
stack (tpdp_verify.integrations.transformers: its TP layers, EP and FSDP2), a dense, a tied
and an MoE model (issue 48). Needs the hf extra (`make test` installs it)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -c constraints.txt -e .[hf]")

import hf_models as hm  # noqa: E402

from tpdp_verify import UsageError, verify_plan  # noqa: E402
from tpdp_verify.integrations import transformers as stack  # noqa: E402
from tpdp_verify.ranks.pool import RankPool  # noqa: E402

TESTS = str(Path(__file__).parent)
pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as p:
        yield p


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4) as p:
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


def through_the_stack(model_fn, parallelize_fn=stack.parallelize, **kw):
    kw.setdefault("steps", 2)
    return verify_plan(model_fn, parallelize_fn=parallelize_fn, dp_alone_fn=stack.dp_alone, dp="own",
                       input_fn=hm.tokens, loss_fn=hm.model_loss, **kw)


@pytest.mark.parametrize("model_fn, sharded", [(hm.make_llama, 16), (hm.make_gemma3, 16), (hm.make_qwen3_moe, 14)],
                         ids=["dense", "tied", "moe"])
def test_transformers_own_stack_trains_like_one_device_and_like_its_dp_alone(pool4, model_fn, sharded):
    """TP by transformers' own layers, then its FSDP2 with the model's fsdp_plan, on (dp=2, tp=2)."""
    report = through_the_stack(model_fn, mesh=(2, 2), pool=pool4)
    assert report.status == "pass", str(report)
    lines = {x.check: x for x in report.lines}
    said = lines["plan keys resolve"].detail
    assert f"sharded {sharded} parameters by TP and wrapped DP itself (fully_shard)" in said
    assert lines["gradients vs plain DDP"].compared > 0 and lines["everything else vs plain DDP"].compared > 0
    assert lines["registry preserved"].compared > 0 and lines["gradients vs one device"].compared > 0


def test_a_tied_head_is_untied_and_tied_again_as_from_pretrained_does(pool4):
    """transformers distributes a model instantiated untied and ties it after loading; the
    ranks' model holds its head and embedding as one parameter again, as one device does."""
    report = through_the_stack(hm.make_gemma3, mesh=(2, 2), pool=pool4, steps=1)
    assert report.one_device.tied == [("model.embed_tokens.weight", "lm_head.weight")], report.one_device.tied
    assert report.status == "pass" and "tied parameters came apart" not in str(report)


def test_moe_experts_run_as_they_come_and_eagerly_in_the_exact_run(pool4):
    """grouped_mm has no float64 kernel: the exact run takes transformers' eager experts and
    the report says so; the ranks run grouped_mm, with EP splitting the experts too."""
    report = through_the_stack(hm.make_qwen3_moe, stack.expert_parallel, mesh=(2, 2), pool=pool4)
    assert report.status == "pass", str(report)
    assert report.one_device.substituted == [
        "the MoE experts ran eagerly (experts_implementation 'eager' for 'grouped_mm', which has no float64 kernel)"]
    said = " ".join(str(report).split())
    assert "the exact run (one device, float64) substituted: the MoE experts ran eagerly" in said
    assert report.to_dict()["exact_run_substituted"] == report.one_device.substituted
    # the experts EP splits count among what the plan sharded, said apart from TP's
    keys = {x.check: x for x in report.lines}["plan keys resolve"]
    assert " by EP and wrapped DP itself" in " ".join(keys.detail.split()) and keys.compared > 0


def test_what_a_model_keeps_in_float32_stays_float32_in_the_exact_run():
    """A router whose forward casts its input to float32 (Inkling2's) meets a float32 weight,
    as transformers' loader keeps it under bfloat16: the float64 run keeps what the model
    declares so (``_keep_in_fp32_modules_strict``, transformers' globs), nothing else, and says it."""
    from tpdp_verify.oracles.single_device import float64_kernels

    class Routed(torch.nn.Module):
        _keep_in_fp32_modules_strict = ["mlp.gate.weight", "*.bias_kept"]

        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.ModuleDict({"gate": torch.nn.Linear(4, 2, bias=False), "up": torch.nn.Linear(4, 4)})
            self.mlp.register_buffer("bias_kept", torch.zeros(2))

    model = Routed().to(torch.float64)
    said = float64_kernels(model)
    assert {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()]} == {
        "mlp.gate.weight": torch.float32, "mlp.up.weight": torch.float64, "mlp.up.bias": torch.float64,
        "mlp.bias_kept": torch.float32}
    assert said == ["what the model keeps in float32 at any dtype (_keep_in_fp32_modules_strict: *.bias_kept, "
                    "mlp.gate.weight) stayed float32, as transformers keeps it under bfloat16 and float16"]
    assert float64_kernels(torch.nn.Linear(2, 2).to(torch.float64)) == []


def test_a_wrong_override_in_transformers_own_stack_is_named(pool):
    """The stack with DistributedConfig(tp_plan={...o_proj: "colwise"}): its forward fails there."""
    report = through_the_stack(hm.make_llama, hm.o_proj_colwise, mesh=(1, 2), pool=pool, steps=1)
    assert report.status == "diverges" and report.first_module == "model.layers.0.self_attn.o_proj", str(report)
    assert "applied no DP (one dp rank)" in str(report)


def test_dp_alone_is_for_a_parallelize_fn_that_wraps_dp_itself():
    with pytest.raises(UsageError, match=r"^dp_alone_fn\(model, mesh\) applies your DP without TP, .*with dp='own'$"):
        verify_plan(hm.make_llama, parallelize_fn=stack.parallelize, dp_alone_fn=stack.dp_alone, dp="fsdp2",
                    input_fn=hm.tokens, pool=RankPool.__new__(RankPool))


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
    own = cli("--stack", "transformers", "--mesh", "1x2")
    assert own.returncode == 0 and "applied no DP (one dp rank)" in own.stdout, own.stdout + own.stderr
    refused = cli("--stack", "transformers", "--dp", "ddp")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "--stack transformers applies the stack's own DP" in refused.stderr
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
