"""The replay scripts of docs/known-divergences.md for the faults the exclusions hid and the
drawn losses, the policy's reductions and the DP large models train with found (faults 12 to 21), as
shipped: each runs on gloo ranks and prints the fault."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


def _run(name: str) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


@pytest.mark.timeout(300)
def test_fsdp1_with_tp_trains_nothing_an_optimizer_built_before_wrapping_holds():
    out = _run("fsdp1_optimizer_before_wrap.py")
    plain = next(line for line in out.splitlines() if line.startswith("plain FSDP1:"))
    assert "a step moved 0 " not in plain, out
    assert "FSDP1 + TP : a step moved 0 local parameters over 4 ranks; 0 of the" in out, out


@pytest.mark.timeout(300)
def test_loss_parallel_over_an_empty_vocab_shard_raises_on_that_rank_and_the_others_wait():
    out = _run("loss_parallel_empty_vocab_shard.py")
    assert "vocab 8: " in out and "raised on rank 3 of 4; ranks 0, 1, 2 were still blocked" in out, out
    assert "index 0 is out of bounds for dimension 1 with size 0" in out, out


@pytest.mark.timeout(300)
def test_fsdp1_alone_with_an_ignored_module_in_half_precision_aborts_a_rank():
    out = _run("fsdp1_ignored_half_precision_abort.py")
    assert "float32: trains" in out, out
    assert "bfloat16: rank " in out and "was killed by SIGABRT while running" in out, out


@pytest.mark.timeout(300)
def test_log_softmax_under_loss_parallel_backpropagates_as_if_nll_loss_came_next():
    out = dict(line.split(": the logits' gradient departs by ") for line in _run("loss_parallel_log_softmax_grad.py").splitlines()
               if "departs by" in line)
    assert float(out["nll_loss"]) < 1e-12 and float(out["kl_div"]) > 0.1, out


@pytest.mark.timeout(300)
def test_fsdp2_sums_tp_partial_gradients_in_the_compute_dtype_unless_accumulated():
    out = _run("fsdp2_tp_reduce_dtype.py")
    assert "1 microbatch: the norm's gradient summed over tp in bfloat16 (reduce_dtype float32)" in out, out
    assert "2 microbatches: the norm's gradient summed over tp in float32" in out, out


@pytest.mark.timeout(300)
def test_fully_shard_over_the_spmd_mesh_scales_gradients_by_one_over_dp():
    out = _run("fsdp2_spmd_grad_scale.py")
    for dims in ("shard", "replicate"):
        assert f"dp_mesh_dims {dims}: the gradient is 0.500 of the one DTensor computes alone (dp = 2)" in out, out


@pytest.mark.timeout(300)
def test_fsdp1_hybrid_with_a_shard_group_of_one_rank_never_synchronizes_its_replicas():
    out = _run("fsdp1_hybrid_one_rank_shard_group.py")
    assert "FULL_SHARD: " in out and "the replicas agree" in out.split("FULL_SHARD: ", 1)[1].splitlines()[0], out
    assert "HYBRID_SHARD: " in out and "the replicas DISAGREE" in out.split("HYBRID_SHARD: ", 1)[1], out


@pytest.mark.timeout(300)
def test_fsdp1_no_shard_cannot_train_a_tp_model():
    out = _run("fsdp1_no_shard_with_tp.py")
    assert "FULL_SHARD: trains" in out and "SHARD_GRAD_OP: trains" in out and "NO_SHARD without TP: trains" in out, out
    assert "NO_SHARD: the forward raises Cannot writeback when the parameter shape changes" in out, out


@pytest.mark.timeout(300)
def test_hsdp_with_uneven_tp_shards_lets_a_replicated_parameters_copies_drift():
    out = _run("hsdp_uneven_tp_replicas_drift.py")
    assert "hidden 7 on (4, 1, 2): the tp copies of a replicated bias's gradient DISAGREE" in out, out
    assert all(f"{form}: the tp copies of a replicated bias's gradient agree in 0 of 30" in out
               for form in ("hidden 8 on (4, 1, 2)", "hidden 7 on (2, 2, 2)", "hidden 7 on (1, 4, 2)")), out
