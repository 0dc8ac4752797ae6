"""verify_plan: a user's model and plan against one device and plain DP, and every mistake
it is given explained in one line before any training."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import user_models as um
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tpdp_verify import UsageError, verify_plan
from tpdp_verify.fixtures.models import LlamaLM
from tpdp_verify.fixtures.parallelize import parallelize_llama, parallelize_llama_ddp, parallelize_llama_fsdp
from tpdp_verify.plan import plan_problems
from tpdp_verify.ranks.pool import RankPool
from tpdp_verify.plan.verify import REFERENCE


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as p:
        yield p


def verify(plan=um.PLAN, model_fn=um.make_mlp, **kw):
    kw.setdefault("input_fn", um.vectors)
    kw.setdefault("mesh", (1, 2))
    kw.setdefault("impl", "reference")
    kw.setdefault("dp", "ddp")  # the reference transform's entry point (the default, fsdp2, has a test of its own)
    return verify_plan(model_fn, plan, **kw)


def test_a_correct_plan_passes_every_check(pool):
    report = verify(pool=pool)
    assert report.ok, str(report)
    counts = {line.check: line.compared for line in report.lines}
    assert counts["plan keys resolve"] == 2
    # Four parameters, three steps: every gradient of every step against one device, and a
    # step's two structural checks (every gradient there, none unexpected).
    assert counts["gradients vs one device"] == 4 * 3 + 2 * 3
    assert counts["gradients vs plain DDP"] == 4 * 3
    assert all(counts[c] > 0 for c in ("forward output", "parameters after each step", "registry preserved",
                                       "requires_grad preserved", "DP replicas equal"))
    data = json.loads(report.to_json())
    assert data["ok"] and len(data["checks"]) == len(report.lines) and data["failures"] == []
    # what the PASS covers: the Rowwise layer's bias is the one gradient TP reduces
    assert data["exercised"] == {"reduced by tp": ["down.bias"], "sharded per part": [], "precision": [],
                                 "unobservable": []}
    assert "loss: not under loss_parallel" in str(report) and "mixed precision: none" in str(report)


def test_with_no_dp_argument_a_correct_plan_passes_on_the_pinned_torch(pool):
    """The default entry point is fsdp2 (fully_shard), where torch 2.13 trains a TP'd model
    exactly; under DDP it cannot pass (fault 1), and the report's first lines say so, with
    the entry point that avoids it."""
    report = verify_plan(um.make_mlp, um.PLAN, input_fn=um.vectors, mesh=(1, 2), steps=2, pool=pool, impl="torch")
    assert report.status == "pass", str(report)
    assert "dp=fsdp2" in str(report).splitlines()[0]
    under_ddp = verify_plan(um.make_mlp, um.PLAN, input_fn=um.vectors, mesh=(1, 2), steps=1, pool=pool,
                            impl="torch", dp="ddp")
    first = " ".join(str(under_ddp).split("\n\n")[1].split())  # the paragraph after the title, unfolded
    assert under_ddp.status == "diverges" and "every departure below matches torch's catalogued fault 1, DDP " \
        "transform unregisters TP parameters" in first, str(under_ddp)
    assert "--dp fsdp2" in first and "--baseline torch==2.13.0" in first


def test_wildcard_keys_a_plan_function_targets_and_adam(pool):
    report = verify(um.BLOCKS_PLAN, um.make_blocks, input_fn=um.with_targets, loss_fn=um.mse,
                    optimizer_fn=um.adam, pool=pool)
    assert report.ok, str(report)
    assert report.lines[0].compared == 2  # two keys, each reaching two modules
    assert next(x for x in report.lines if x.check == "gradients vs one device").compared == 8 * 3 + 2 * 3
    assert verify(um.plan_of_mesh, pool=pool, steps=1).ok


def test_outputs_of_any_pytree_shape_and_inputs_by_keyword(pool):
    """Each tensor leaf with the batch's rows is compared under its path; the rest are named
    as not compared, with why. The batch's keys the forward names are its keyword arguments."""
    report = verify(model_fn=um.make_outputs, input_fn=um.keyword_vectors, pool=pool, steps=2)
    assert report.ok, str(report)
    outputs = sorted({r.name for r in report.one_device.rows if r.what == "output"})
    assert outputs == ["aux[0]", "logits"]
    assert report.one_device.unread == ["aux[1] (shape []: no dim 0 of the batch's 2 rows to put together)",
                                        "steps (a int, not a tensor)"]
    broken = verify(um.LOCAL_HEAD, model_fn=um.make_outputs, input_fn=um.keyword_vectors, pool=pool, steps=1)
    assert "output shape: step 1: logits: shape (2, 4), oracle (2, 8)" in str(broken), str(broken)


def test_a_constant_argument_reaches_every_rank_whole(pool):
    """input_fn's non-tensor value (``scale``: a float) is the forward's on every dp rank as
    given, not split: dropped or split, the forward would raise on its None or its rows."""
    report = verify(model_fn=um.make_outputs, input_fn=um.keyword_vector_and_constant, pool=pool, steps=1,
                    mesh=(2, 1), dp="ddp")
    assert report.ok, str(report)
    assert next(x for x in report.lines if x.check == "forward output").compared > 0


def test_a_swapped_plan_is_reported_at_its_module(pool):
    report = verify(um.SWAPPED, pool=pool, steps=1)
    assert not report.ok
    assert report.first_module == "up"
    assert "in the forward of up" in str(report)
    assert "from user_models import make_mlp, vectors, SWAPPED" in report.replay


def test_a_tie_that_comes_apart_is_said_so(pool):
    report = verify(um.tied_plan_without_retie, um.make_tied, input_fn=um.tokens, dp="fsdp2", pool=pool, steps=1)
    assert not report.ok
    assert "tied parameters came apart: embed.weight, head.weight" in str(report), str(report)
    assert "tie them again after it, in a parallelize_fn" in " ".join(str(report).split())  # what to do about it


def test_the_tied_models_workaround_works_for_a_vocabulary_parallel_plan(pool):
    """Fault 3's workaround for a user's tied model (not the zoo's: its ties are found on one
    device), with the vocabulary sharded under loss_parallel: DDP cannot wrap it, and the
    report names the fault and the flag; FSDP2, the default, with the weights re-tied passes."""
    def run(**dp):
        return verify_plan(um.make_tied, parallelize_fn=um.parallelize_tied_vocab, input_fn=um.tokens_and_targets,
                           loss_fn=um.dtensor_token_loss, loss_parallel=True, pool=pool, steps=2, **dp)

    under_ddp = str(run(dp="ddp")).split("\n\n")
    assert under_ddp[0].endswith("DIVERGES"), under_ddp
    paragraph = " ".join(under_ddp[1].split())  # folded to 100 characters a line
    assert paragraph.startswith("every departure below matches torch's catalogued fault 3, tied TP "), under_ddp
    assert "(--dp fsdp2) avoids it" in paragraph
    report = run()
    assert report.ok and report.case.entry == "fully_shard", str(report)
    assert "nll_loss_backward" in report.to_dict()["exercised"]["loss ops"]
    assert next(x for x in report.lines if x.check == "gradients vs one device").compared > 0


def test_a_head_that_returns_its_shard_is_named(pool):
    report = verify(um.LOCAL_HEAD, pool=pool, steps=1)
    assert not report.ok and report.first_module == "down", str(report)
    assert "output shape: step 1: model: shape (2, 4), oracle (2, 8)" in str(report)


@pytest.mark.timeout(300)
def test_the_replay_of_a_report_runs_as_it_is_from_anywhere(pool, tmp_path):
    report = verify(um.SWAPPED, um.MLPOf(), pool=pool, steps=1)  # a callable object: written as its repr
    assert "replay (save as a file and run it with python):" in str(report)
    assert "from user_models import MLPOf, vectors, SWAPPED" in report.replay and "verify_plan(MLPOf(kind='mlp'), " \
        "SWAPPED, input_fn=vectors" in report.replay, report.replay
    (tmp_path / "replay.py").write_text(report.replay)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds user_models itself
    replayed = subprocess.run([sys.executable, "replay.py"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=280, env=env)
    assert replayed.returncode == 1, replayed.stderr[-3000:]
    assert "DIVERGES" in replayed.stdout.splitlines()[0] and "in the forward of up" in replayed.stdout


def test_a_parallelize_function_of_ones_own_is_verified_like_a_plan(pool):
    """torchtitan's way: the user's function applies TP per module on the mesh's tp
    dimension (fixtures/parallelize.py); the tool wraps DP and trains it against both oracles."""
    report = verify(None, um.make_llama, parallelize_fn=parallelize_llama, input_fn=um.tokens, pool=pool, steps=2)
    assert report.ok, str(report)
    keys = report.lines[0]  # embedding, final norm, head; a block's 7 projections and 2 norms
    assert keys.compared == 12 and keys.detail == "parallelize_fn made 12 parameters DTensors"
    assert "from tpdp_verify.fixtures.parallelize import parallelize_llama" in report.replay
    assert "parallelize_fn=parallelize_llama" in report.replay


@pytest.mark.timeout(300)
def test_a_parallelize_function_that_wraps_dp_itself_is_driven_as_it_wraps():
    """torchtitan's whole parallelize_llama: TP, then its own FSDP2 or replicate on the dp
    dimension. dp="own": the tool finds the wrapper, drives it (two microbatches a step) and
    says the plain-DP comparison was not made."""
    with RankPool(4) as four:
        fsdp = verify(None, um.make_llama, parallelize_fn=parallelize_llama_fsdp, input_fn=um.tokens, dp="own",
                      mesh=(2, 2), steps=2, accumulate=2, pool=four, impl="torch")
        ddp = verify(None, um.make_llama, parallelize_fn=parallelize_llama_ddp, input_fn=um.tokens, dp="own",
                     mesh=(2, 2), steps=1, pool=four, impl="torch", baseline="torch==2.13.0")
    assert fsdp.status == "pass", str(fsdp)
    lines = {x.check: x for x in fsdp.lines}
    assert lines["plan keys resolve"].detail == "parallelize_fn sharded 12 parameters by TP and wrapped DP itself " \
        "(fully_shard)"
    assert lines["gradients vs one device"].compared > 0 and lines["DP replicas equal"].compared > 0
    skipped = [c for c in json.loads(fsdp.to_json())["checks"] if c["check"].endswith("vs plain DDP")]
    assert [(c["ok"], c["compared"]) for c in skipped] == [(None, 0)] * 2
    assert all(c["detail"].startswith("not compared: parallelize_fn wraps DP itself") for c in skipped)
    assert "dp='own'" in fsdp.replay and "parallelize_fn=parallelize_llama_fsdp" in fsdp.replay
    # torch 2.13's replicate loses the TP parameters' registry: known for the entry point found
    assert "wrapped DP itself (replicate)" in str(ddp)
    assert "parameters stay registered in order (vs one device): with tpdp-verify's reference transform in " \
        "torch's place" in " ".join(str(ddp).split()), str(ddp)


@pytest.mark.timeout(300)
def test_a_parallelize_function_that_shards_over_the_whole_mesh_is_driven_in_the_spmd_form():
    """fully_shard(mesh=<the whole mesh>, dp_mesh_dims=...) in the user's own function: the
    tool finds the SPMD form and feeds it batches as DTensors sharded on dp. With fault 17's
    workaround it trains exactly; as documented it scales gradients by 1/dp, and nothing in
    the run shows that to be torch's (the reference does not replace FSDP2's reduction, and
    a function that wraps DP itself has no run without TP): the plan's, until shown otherwise."""
    with RankPool(4) as four:
        fixed = verify(None, parallelize_fn=um.parallelize_spmd_undivided, dp="own", mesh=(2, 1, 2), steps=2,
                       pool=four, impl="torch")
        documented = verify(None, parallelize_fn=um.parallelize_spmd, dp="own", mesh=(2, 2), steps=2,
                            pool=four, impl="torch", baseline="torch==2.13.0")
    assert fixed.status == "pass", str(fixed)
    lines = {x.check: x for x in fixed.lines}
    assert lines["plan keys resolve"].detail.endswith("wrapped DP itself (fully_shard(dp_mesh_dims=replicate))")
    assert lines["gradients vs one device"].compared > 0
    assert documented.status == "diverges" and not documented.ok, str(documented)
    assert any(n["part"] == "value:gradient" for n in json.loads(documented.to_json())["new"])


def test_a_function_wrapping_ddp_itself_is_assembled_from_its_local_shards(pool):
    """DDP holds the TP parameters as plain local shards; their layouts are inferred from
    the unsharded model's shapes, and every value compared."""
    report = verify(None, parallelize_fn=um.parallelize_with_ddp, dp="own", pool=pool, impl="torch",
                    baseline="torch==2.13.0")
    assert report.status == "known", str(report)
    assert "wrapped DP itself (ddp_mesh)" in str(report)
    lines = {x.check: x for x in report.lines}
    assert lines["parameters after each step"].compared > 0 and lines["forward output"].failed == 0


def test_loss_parallel_takes_the_per_sample_loss_users_write_a_dtensor(pool):
    report = verify(um.lm_plan, um.make_llama, input_fn=um.tokens_and_targets, loss_fn=um.dtensor_token_loss,
                    loss_parallel=True, pool=pool, steps=2)
    assert report.ok, str(report)
    assert next(x for x in report.lines if x.check == "gradients vs one device").compared > 0
    seen = report.to_dict()["exercised"]  # the report says the loss ran sharded, and which ops did
    assert {"_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward"} <= set(
        seen["loss ops"]), str(report)
    assert {"norm.weight", "layers.0.ffn_norm.weight"} <= set(seen["reduced by tp"])  # SequenceParallel's norms


def test_an_exception_in_the_loss_is_located_there(pool):
    report = verify(loss_fn=um.loss_raising_on_rank_1, pool=pool, steps=1)
    assert report.status == "diverges"
    assert "in the per-sample loss (loss_fn): ValueError: the loss broke on rank 1" in " ".join(str(report).split()), \
        str(report)
    check = json.loads(report.to_json())["checks"][1]
    assert (check["check"], check["ok"]) == ("trains without an exception", False)


@pytest.mark.timeout(120)
def test_a_hang_in_the_users_forward_is_a_report_with_each_silent_ranks_stack(tmp_path):
    with RankPool(2, timeout=8.0) as short:
        report = verify(model_fn=um.make_hanging, pool=short, steps=1)
    assert report.status == "diverges"
    text = str(report)
    assert "did not answer within the 8 s timeout" in text and "in forward" in text, text
    assert "pending: torch/distributed/" in text
    # each rank's place first: the user's own frame where it has one, then the stacks without the pool's machinery
    first = text.index("--- rank ")
    assert re.search(r"^rank \d: at (tests/)?user_models\.py:\d+ in forward$", text[:first], re.M), text
    assert re.search(r"^rank \d: in torch/distributed/\S+ in \w+, called from\s", text[:first], re.M), text
    assert "multiprocessing" not in text and "ranks/pool.py" not in text and "Thread 0x" not in text


def test_a_wrong_parallelize_function_is_reported_at_its_module(pool):
    report = verify(None, parallelize_fn=um.parallelize_swapped, pool=pool, steps=1)
    assert not report.ok and report.first_module == "up", str(report)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(parallelize_fn=um.parallelize_nothing),
     "parallelize_fn user_models:parallelize_nothing left every parameter a plain tensor"),
    (dict(parallelize_fn=um.parallelize_raises),
     "parallelize_fn user_models:parallelize_raises raised AttributeError"),
    (dict(plan=um.PLAN, parallelize_fn=um.parallelize_nothing), "give a plan (module path -> ParallelStyle) or "
     "parallelize_fn(model, mesh), not both"),
    (dict(plan=None), "give a plan (module path -> ParallelStyle) or parallelize_fn(model, mesh), one of them"),
    (dict(parallelize_fn=um.parallelize_with_ddp), "parallelize_fn user_models:parallelize_with_ddp wrapped the "
     "model in DP (ddp_mesh) itself: pass dp='own'"),
    (dict(parallelize_fn=um.parallelize_swapped, dp="own", mesh=(2, 1)), "parallelize_fn user_models:parallelize_swapped "
     "applied no DP, and dp='own' says it does"),
    (dict(plan=um.PLAN, dp="own"), "dp='own' means your parallelize_fn wraps DP itself"),
    # meshes crossed, which torch accepts without a word
    (dict(parallelize_fn=um.parallelize_with_ddp_over_tp, dp="own"), "parallelize_fn "
     "user_models:parallelize_with_ddp_over_tp wraps DP (ddp_mesh) over ranks [0, 1] (mesh['tp']'s), not "
     "mesh['dp']'s [0] (on this rank): its replicas would average different TP shards; give the wrapper mesh['dp']"),
    (dict(parallelize_fn=um.parallelize_tp_over_dp), "parallelize_fn user_models:parallelize_tp_over_dp applies TP "
     "to up.weight over mesh ('dp',), not mesh['tp']"),
    (dict(parallelize_fn=um.parallelize_with_fsdp_over_tp, dp="own"), "parallelize_fn "
     "user_models:parallelize_with_fsdp_over_tp raised RuntimeError: Cannot concatenate overlapping meshes"),
])
def test_parallelize_function_mistakes_are_one_line(pool, kwargs, expected):
    with pytest.raises(UsageError, match=re.escape(expected)):
        verify(**{"plan": None, **kwargs}, pool=pool)


@pytest.mark.parametrize("dp", ["ddp", "ddp_mesh"])
def test_a_correct_plan_passes_on_torch_with_the_shipped_baseline_its_known_faults_labelled(pool, dp):
    bare = verify(pool=pool, impl="torch", dp=dp)
    assert bare.status == "diverges"  # torch 2.13's DDP transform loses the TP parameters' registry
    report = verify(pool=pool, impl="torch", dp=dp, baseline="torch==2.13.0")
    assert report.status == "known" and report.ok, str(report)
    text, data = str(report), json.loads(report.to_json())
    assert "PASS but for known torch faults (torch==2.13.0)" in text.splitlines()[0]
    # the evidence is the run's own: the reference transform in torch's place does not show it
    assert "parameters stay registered in order (vs one device): with tpdp-verify's reference transform" in \
        " ".join(text.split())
    assert data["status"] == "known" and data["new"] == [] and data["known"]
    assert all(k["evidence"] == REFERENCE for k in data["known"])
    # named by the catalog, with its workaround
    assert "fault 1, DDP transform unregisters TP parameters: workaround: " in text, text
    assert [f["number"] for f in data["faults"]] == [1] and data["unexplained"] == []


def test_a_wrong_plan_diverges_with_the_baseline_too(pool):
    report = verify(um.SWAPPED, pool=pool, impl="torch", steps=1, baseline="torch==2.13.0")
    assert report.status == "diverges" and report.first_module == "up", str(report)
    # the swapped shards fail in DTensor's dispatch under the user's forward: the reference in
    # torch's place fails there too, so it is the plan's, whatever torch's faults beside it
    assert "the plan's departures (the run does not show them to be torch's)" in str(report), str(report)
    assert json.loads(report.to_json())["new"]


def test_a_broken_transform_is_reported_with_its_table(pool):
    report = verify(pool=pool, impl="mutants.ScalesGradientUp", steps=1)
    assert not report.ok
    failed = [x.check for x in report.lines if not x.ok]
    assert "gradients vs one device" in failed, str(report)
    assert "max abs" in str(report) and json.loads(report.to_json())["failures"]


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize("plan, model_fn, expected", [
    (um.TYPO, um.make_mlp, "plan key 'upp' matches no module of the model; did you mean 'up'?"),
    (um.WRONG_TYPE, um.make_mlp, "gives ColwiseParallel to 'act', a ReLU; it shards only Linear and Embedding"),
    (um.PLAN, um.make_narrow, "shards dim 0 of up.weight (size 1) over 2 tp ranks"),
    (um.PARTIAL, um.make_blocks, "plan key 'layers.1.dwn' matches no module of the model; did you mean 'layers.1.down'"),
    (um.PLAN, um.make_per_rank, "model_fn builds different weights on rank"),
], ids=["typo", "style-misfit", "unshardable-dim", "wildcard-typo", "per-rank-weights"])
def test_mistakes_seen_on_the_ranks(pool, plan, model_fn, expected):
    with pytest.raises(UsageError) as excinfo:
        verify(plan, model_fn, pool=pool)
    assert expected in one_line(excinfo)


class NoRanks:
    """A pool that must not be used: the mistake is to be found before any rank runs."""

    world_size = 2

    def run(self, *args, **kwargs):
        raise AssertionError("the ranks were asked to run")


@pytest.mark.parametrize("plan, expected", [
    (um.TYPO, "plan key 'upp' matches no module of the model; did you mean 'up'?"),
    (um.WRONG_TYPE, "gives ColwiseParallel to 'act', a ReLU"),
])
def test_a_plan_dict_is_checked_in_this_process_before_any_rank_runs(plan, expected):
    with pytest.raises(UsageError) as excinfo:
        verify(plan, pool=NoRanks())
    assert expected in one_line(excinfo)


def test_heads_that_do_not_split_over_tp_are_refused_before_any_rank():
    """A 3x3 mesh once spawned 9 ranks on 2 cores to meet a reshape error: 2 heads of width
    4 over tp=3 leave a rank part of a head. Uneven splits of whole heads are fine."""
    with pytest.raises(UsageError) as excinfo:
        verify(um.ATTENTION, um.make_llama, input_fn=um.tokens, mesh=(3, 3), pool=NoRanks())
    assert one_line(excinfo) == (
        "plan key 'layers.*.attention.wq': ColwiseParallel splits the 2 heads of layers.0.attention.wq "
        "(head_dim 4) over 3 tp ranks as [3, 3, 2] columns, so some rank would hold part of a head; use a tp "
        "that divides 2, or leave 'layers.0.attention.wq' out of the plan")
    assert plan_problems(um.make_llama(), um.ATTENTION, 2) == []
    five = LlamaLM(vocab=16, dim=10, hidden=12, heads=5, seq=4)  # 5 heads over 3 ranks: 2, 2 and 1
    assert plan_problems(five, um.ATTENTION, 3) == []


@pytest.mark.parametrize("kwargs, expected", [
    ({"input_fn": um.three_rows}, "input_fn(2, generator) returned 'input' of shape [3, 8]: dim 0 must hold the 2 samples"),
    ({"input_fn": um.unseeded}, "input_fn returned different batches for the same generator"),
    ({"input_fn": um.keyword_vector_and_list}, "input_fn returned dict: return the model's input tensor, or a dict "
     "of tensors"),
    ({"loss_fn": um.unreduced_loss}, "loss_fn returned [2, 8] for a batch of 2: return one loss per sample "
     "(shape [2]), which tpdp-verify weights at random, or the batch's mean loss (a scalar)"),
    ({"model_fn": lambda: um.MLP()}, "model_fn cannot be sent to the ranks"),
    ({"batch": 3, "mesh": (2, 2)}, "batch=3 does not split over dp=2 ranks"),
    ({"mesh": (2, 2)}, "mesh (2, 2) holds 4 ranks but the pool has 2"),
    ({"dp": "ddp2"}, "dp must be one of ddp, ddp_mesh, replicate, fsdp2, fsdp1, replicate_fsdp, own"),
    ({"dtype": torch.int32}, "dtype must be one of float32, bfloat16, float16"),
    ({"plan": [("up", None)]}, "plan is a list; give a dict"),
], ids=["batch-rows", "unseeded-input", "list-input", "unreduced-loss", "lambda", "batch-split", "mesh-size",
        "dp-name", "dtype", "plan-type"])
def test_mistakes_seen_before_any_rank(pool, kwargs, expected):
    kwargs = {"pool": pool, "model_fn": um.make_mlp, "plan": um.PLAN, **kwargs}
    with pytest.raises(UsageError) as excinfo:
        verify(**kwargs)
    assert expected in one_line(excinfo)


def test_a_model_that_cannot_train_unsharded_is_one_line(pool):
    """The one-device runs are the fixed point; a model that cannot train there (here: a
    float32 constant in its forward, which the float64 run meets) is the user's to fix."""
    with pytest.raises(UsageError) as excinfo:
        verify(model_fn=um.make_float32_only, pool=pool, steps=1)
    assert one_line(excinfo).startswith("the model does not train on one device in float64 (the exact run every "
                                        "bound is measured against): in the forward of <the whole model>: ")


def test_hypothesis_prints_a_user_case_without_the_user_model():
    from hypothesis.vendor.pretty import pretty

    from tpdp_verify.cases.training import TrainCase

    text = pretty(TrainCase(user=um.make_mlp))
    assert "user" not in text and text.startswith("TrainCase(model='mlp',") and "dtype='float32'" in text


@pytest.mark.timeout(300)
def test_a_wrong_attention_head_split_is_the_plans_though_torch_departs_beside_it(pool):
    """Heads read from the config, not from the columns a rank holds: under ddp torch 2.13's
    registry fault departs too, but the reference transform in torch's place still departs
    in the output, so the departure is the plan's: DIVERGES, listed as the plan's."""
    report = verify(um.llama_blocks, um.make_fixed_heads_llama, input_fn=um.tokens, dp="ddp", steps=1,
                    pool=pool, impl="torch", baseline="torch==2.13.0")
    data = json.loads(report.to_json())
    assert report.status == "diverges" and not report.ok, str(report)
    assert any(n["part"] == "value:output" for n in data["new"]), data["new"]
    assert "the plan's departures (the run does not show them to be torch's): " in str(report)
    assert all(k["part"] != "value:output" for k in data["known"])


@pytest.mark.timeout(300)
def test_the_same_plan_on_the_correct_model_passes_with_torchs_departures_attributed(pool):
    report = verify(um.llama_blocks, um.make_llama, input_fn=um.tokens, dp="ddp", steps=1, pool=pool,
                    impl="torch", baseline="torch==2.13.0")
    data = json.loads(report.to_json())
    assert report.status == "known" and report.ok and data["new"] == [], str(report)
    assert data["known"] and all(k["evidence"] == REFERENCE for k in data["known"])


@pytest.mark.parametrize("make, plan, expected", [
    (um.make_blocks, {"layers.*.dwn": ColwiseParallel()}, "did you mean 'layers.*.down'"),  # the wildcard kept
    (um.make_blocks, {"layers.0": ColwiseParallel()}, "give its children their styles, or lay out its input and "
                                                      "output with PrepareModuleInput / PrepareModuleOutput"),
    (um.make_mlp, {"act": ColwiseParallel()}, "a ReLU holds no parameter to shard: leave it out of the plan"),
])
def test_a_plan_mistake_names_what_would_fit(make, plan, expected):
    problems = plan_problems(make(), plan, 2)
    assert problems and expected in problems[0], problems


def test_a_norm_given_a_sharding_style_is_told_sequence_parallel_fits():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    (problem,) = plan_problems(model, {"1": RowwiseParallel()}, 2)
    assert "a LayerNorm runs on sequence shards: SequenceParallel()" in problem


def test_a_vocabulary_head_left_sharded_is_named_not_the_loss(pool):
    """The loss raises (a target past the shard of the vocabulary the head hands on): the
    report names the head, its output's shape against the unsharded model's, and what fits."""
    report = verify(um.blocks_and_local_head, um.make_llama, input_fn=um.tokens_and_targets, loss_fn=um.token_loss,
                    dp="fsdp2", impl="torch", pool=pool, steps=1)
    text = str(report)
    assert not report.ok and report.first_module == "output", text
    assert "output hands on its tp shard: the model's output is [2, 4, 8] on each rank, the unsharded model's " \
           "[2, 4, 16]" in " ".join(text.split()), text
    assert "loss_parallel()" in text


def test_a_module_that_departs_first_points_at_what_feeds_it_and_lines_fit(pool):
    """A silent wrong head split departs first at the attention's output projection; its
    cause sits in the attention's own code before it, and the report says to look there.
    Every line of prose fits 100 characters."""
    report = verify(um.llama_blocks, um.make_fixed_heads_llama, input_fn=um.tokens, dp="fsdp2", impl="torch",
                    steps=1, pool=pool)
    text = str(report)
    assert report.first_module == "layers.0.attention.wo", text
    assert "its input comes through layers.0.attention's own forward code (a split into heads" in \
        " ".join(text.split()), text
    prose = [ln for ln in text.split("\nreplay")[0].splitlines()  # the replay is code; the table is columns
             if not ln.lstrip().startswith(("gradient ", "optimizer ", "parameter ", "output ", "value "))]
    assert max(map(len, prose)) <= 100, max(prose, key=len)


def test_no_module_departs_where_no_value_does_and_names_are_said_once(pool):
    """Torch 2.13's DDP transform unregisters the TP parameters: a check fails, every value is
    within its bound, so no module "departs"; the missing names are listed once, not in each
    table row."""
    report = verify(um.llama_blocks, um.make_llama, input_fn=um.tokens, dp="ddp", impl="torch", steps=1, pool=pool)
    text = str(report)
    assert not report.ok and report.first_module is None and "departs (forward order)" not in text, text
    assert text.count("layers.0.attention.wq.weight") == 1, text


def test_a_wrong_style_is_named_with_the_style_that_fits(pool):
    """A feed-forward's down projection given ColwiseParallel after a ColwiseParallel one
    raises in its forward: the report names the module, how TP split it, and the other style."""
    report = verify_plan(um.make_llama, um.blocks_with_colwise_w2, input_fn=um.tokens, mesh=(1, 2), steps=1,
                         pool=pool, impl="torch")
    text = " ".join(str(report).split())
    assert report.first_module == "layers.0.feed_forward.w2", str(report)
    assert "the module whose forward raised: layers.0.feed_forward.w2 layers.0.feed_forward.w2 is split as " \
           "ColwiseParallel splits it; RowwiseParallel() may fit" in text, str(report)
