"""torchtitan's own parallelize as its users run it (tpdp_verify.integrations.torchtitan,
issue 48): its Llama 3 in small, sharded by the sharding its config declares
(``Module.parallelize``), under its whole ``parallelize_llama`` (its FSDP2, whose divide
factor 1.0 sums gradients, with its trainer's loss over the step's global count of valid
tokens) and under tpdp-verify's DP entry points, and under its full_dtensor backend; its
complex RoPE cache kept complex; DDP's refusal of its DTensor buffers named as torch's fault
33. Needs the torchtitan extra (`make test` installs it)."""

import subprocess
import sys

import pytest

pytest.importorskip("torchtitan", reason="the torchtitan extra: pip install -c constraints.txt -e .[torchtitan]")

import titan_models  # noqa: E402

from tpdp_verify import UsageError, verify_plan  # noqa: E402
from tpdp_verify.integrations import torchtitan as tt  # noqa: E402

ROPE = "layers.0.attention.rope.cache"


@pytest.fixture
def pool(tpdp_pools):
    return tpdp_pools.get(2)


@pytest.fixture
def pool4(tpdp_pools):
    return tpdp_pools.get(4)


def own(model_fn=tt.llama3, **kw):
    """torchtitan's whole parallelize_llama, its loss each rank's share of the step's."""
    kw = {"loss_fn": tt.loss, "loss_share": True, "steps": 2, "parallelize_fn": tt.parallelize_llama,
          "dp_alone_fn": tt.dp_alone} | kw
    return verify_plan(model_fn, dp="own", input_fn=tt.tokens, **kw)


def test_parallelize_llama_trains_like_one_device_and_like_its_fsdp_alone(pool4):
    report = own(mesh=(2, 2), pool=pool4)
    assert report.status == "pass", str(report)
    lines = {x.check: x for x in report.lines}
    assert lines["plan keys resolve"].compared == 17  # wqkv, wo, w1, w2, w3 a block, the embedding, norms, head
    assert "wrapped DP itself (fully_shard)" in lines["plan keys resolve"].detail
    assert lines["gradients vs plain DDP"].compared > 0 and lines["gradients vs one device"].failed == 0
    # the step's loss is the dp groups' shares summed, judged against one device's mean
    losses = [r for r in report.one_device.rows if r.what == "loss"]
    assert len(losses) == 2 and all(r.err.ok for r in losses)
    # the complex RoPE cache, as torchtitan holds it, compared on every step; complex on the ranks,
    # since a buffer of another kind of dtype fails the buffers check
    assert {r.name for r in report.one_device.rows if r.what == "buffer"} >= {ROPE}


@pytest.mark.parametrize("mesh", [(2, 2), (2, 1, 2)], ids=["fsdp", "hsdp"])
def test_the_full_dtensor_backend_trains_like_one_device_its_batch_split_on_its_own_mesh(pool4, mesh):
    """torchtitan's full_dtensor backend: every parameter a DTensor on its dense mesh, its FSDP2
    given that mesh (dp_mesh_dims); the batch is split on that mesh, another object than the
    harness's (placed on the harness's, the loss raises: "different meshes"), on each dp dim of
    more than one rank (a dp_shard of one replicates, as its parallelize_inputs places it, which
    its embedding checks); its loss over the global batch is the step's whole."""
    report = own(tt.llama3_full_dtensor, parallelize_fn=tt.parallelize_llama_full_dtensor,
                 dp_alone_fn=tt.dp_alone_full_dtensor, loss_share=False, mesh=mesh, pool=pool4, steps=1)
    assert report.status == "pass", str(report)
    lines = {x.check: x for x in report.lines}
    assert "fully_shard(dp_mesh_dims=" in lines["plan keys resolve"].detail
    assert lines["forward output"].compared > 0 and lines["gradients vs plain DDP"].compared > 0


def test_parallelize_llama_over_a_3d_mesh_trains_its_hsdp_like_one_device(pool4):
    """The harness's (dp_replicate, dp_shard, tp) mesh becomes torchtitan's ParallelDims with
    dp_replicate 2, and its parallelize_llama shards over the 2-D DP mesh (HSDP): the
    replicas agree and train as one device. (2, 2, 2) passes too, measured by hand (8 ranks)."""
    report = own(mesh=(2, 1, 2), pool=pool4)
    assert report.status == "pass", str(report)
    lines = {x.check: x for x in report.lines}
    assert lines["DP replicas equal"].compared > 0 and lines["gradients vs plain DDP"].compared > 0


def test_a_loss_that_averages_under_a_dp_that_sums_diverges(pool4):
    """torchtitan's FSDP2 sums gradients (divide factor 1.0): a per-batch mean loss under it
    doubles every gradient at dp 2; the trainer's loss without loss_share halves the loss."""
    doubled = own(mesh=(2, 2), pool=pool4, loss_fn=tt.mean_loss, loss_share=False, steps=1)
    assert doubled.status == "diverges" and not {x.check: x for x in doubled.lines}["gradients vs one device"].ok
    halved = own(mesh=(2, 2), pool=pool4, loss_share=False, steps=1)
    assert halved.status == "diverges" and [r.err.ok for r in halved.one_device.rows if r.what == "loss"] == [False]


def test_torchtitans_tp_under_tpdp_verifys_fsdp2_and_ddp(pool):
    fsdp2 = verify_plan(tt.llama3, parallelize_fn=tt.parallelize, dp="fsdp2", mesh=(1, 2), input_fn=tt.tokens,
                        loss_fn=tt.mean_loss, steps=2, pool=pool)
    assert fsdp2.status == "pass", str(fsdp2)
    ddp = verify_plan(tt.llama3, parallelize_fn=tt.parallelize, dp="ddp", mesh=(1, 2), input_fn=tt.tokens,
                      loss_fn=tt.mean_loss, steps=1, pool=pool, baseline="torch==2.13.0")
    assert ddp.status == "known", str(ddp)  # torch's DDP transform meets the DTensor RoPE cache
    assert [f.number for f in ddp.named().faults] == [33] and not ddp.named().unexplained, str(ddp)


def test_a_slip_in_the_config_declared_sharding_is_caught(pool):
    report = verify_plan(titan_models.llama3_ffn_without_sp, parallelize_fn=tt.parallelize, dp="fsdp2", mesh=(1, 2),
                         input_fn=tt.tokens, loss_fn=tt.mean_loss, steps=1, pool=pool)
    assert report.status == "diverges", str(report)


def test_loss_share_needs_a_dp_that_sums():
    with pytest.raises(UsageError, match="loss_share"):
        verify_plan(tt.llama3, parallelize_fn=tt.parallelize, dp="fsdp2", input_fn=tt.tokens, loss_fn=tt.loss,
                    loss_share=True)


@pytest.mark.timeout(600)
def test_from_the_shell_as_a_stack(tmp_path):
    """``--stack torchtitan``: its parallelize_llama, its FSDP2 alone for the plain-DP run, the
    loss each rank's share; the replay line is the command as given."""
    titan = "tpdp_verify.integrations.torchtitan"
    args = [sys.executable, "-m", "tpdp_verify", "plan", f"{titan}:llama3", "--input", f"{titan}:tokens",
            "--loss", f"{titan}:loss", "--stack", "torchtitan", "--mesh", "1x2", "--steps", "1"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert run.returncode == 0 and ", dp=own, 1 step, float32: PASS" in run.stdout, run.stdout + run.stderr
    assert "gradients vs plain DDP" in run.stdout and "Traceback" not in run.stdout + run.stderr
    assert f"replay: tpdp-verify {' '.join(args[3:])}" in run.stdout
