"""An exception's signature part names the API of torch the harness entered: it survives a
refactor that moves the raise into another helper, and keeps the innermost frame as a detail."""

import os

import torch

from tpdp_verify import signature

HARNESS = os.path.join(os.path.dirname(signature.__file__), "ranks", "loop.py")
STDLIB = os.path.join(os.path.dirname(os.__file__), "contextlib.py")
TORCH = signature._TORCH  # the installed torch's folder: its frames are the code under test


def part(*frames) -> str:
    return signature._pick([(f if f.startswith("/") else TORCH + f, fn) for f, fn in frames], "RuntimeError")


def test_the_part_is_where_the_harness_entered_torch_whichever_helper_raised():
    """torch 2.11 raises DDP's mesh fault in one helper, 2.13 in another: one part."""
    in_2_11 = part((HARNESS, "wrap"), ("nn/parallel/distributed.py", "__init__"),
                   ("distributed/tensor/_dispatch.py", "_try_replicate_spec_for_scalar_tensor"))
    in_2_13 = part((HARNESS, "wrap"), ("nn/parallel/distributed.py", "__init__"),
                   ("distributed/utils.py", "_sync_params_and_buffers"))
    assert in_2_11 == in_2_13 == "raised:RuntimeError at torch/nn/parallel/distributed.py:__init__"


def test_call_machinery_and_the_standard_library_name_no_api():
    assert part((HARNESS, "step"), ("nn/modules/module.py", "_wrapped_call_impl"), ("nn/modules/module.py", "_call_impl"),
                ("nn/parallel/distributed.py", "forward"), ("nn/parallel/distributed.py", "_pre_forward")) == \
        "raised:RuntimeError at torch/nn/parallel/distributed.py:forward"
    assert part((HARNESS, "whole"), (STDLIB, "__enter__"), ("distributed/fsdp/fully_sharded_data_parallel.py",
                                                            "summon_full_params"), (STDLIB, "__enter__"),
                ("distributed/fsdp/_unshard_param_utils.py", "_unshard_fsdp_state_params")) == \
        "raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:summon_full_params"
    assert part((HARNESS, "clip"), ("nn/utils/clip_grad.py", "_no_grad_wrapper"),
                ("nn/utils/clip_grad.py", "clip_grad_norm_")) == \
        "raised:RuntimeError at torch/nn/utils/clip_grad.py:clip_grad_norm_"


def test_the_innermost_run_of_torch_is_the_one_named():
    """A fixture's forward (harness) between two runs of torch: the inner run raised."""
    assert part((HARNESS, "step"), ("nn/parallel/distributed.py", "forward"), (HARNESS, "fixture_forward"),
                ("distributed/tensor/_api.py", "__torch_dispatch__"), ("distributed/tensor/_dispatch.py", "dispatch")) \
        == "raised:RuntimeError at torch/distributed/tensor/_api.py:__torch_dispatch__"
    # a C++ op raised in the harness's own frame: the last run of torch it went through
    assert part((HARNESS, "step"), ("nn/modules/module.py", "_call_impl"), (HARNESS, "fixture_forward")) == \
        "raised:RuntimeError at torch/nn/modules/module.py:_call_impl"
    assert part((HARNESS, "check")) == "raised:RuntimeError"


def test_a_tap_inside_torchs_call_is_torchs_own_frame():
    """A handler or reduction step tpdp-verify notes (ranks/taps.py) between torch's frames
    leaves the part as torch would have it: the run of torch is not cut at the tap."""
    tap = os.path.join(os.path.dirname(signature.__file__), "ranks", "taps.py")
    frames = [(HARNESS, "step"), ("_tensor.py", "backward"), ("distributed/tensor/_api.py", "__torch_dispatch__")]
    assert part(*frames, (tap, "handle"), ("distributed/tensor/parallel/loss.py", "_nll_loss_forward_handler")) == \
        part(*frames, ("distributed/tensor/parallel/loss.py", "_nll_loss_forward_handler")) == \
        "raised:RuntimeError at torch/_tensor.py:backward"


def test_a_real_exception_keeps_its_innermost_frame_as_a_detail():
    try:
        torch.optim.SGD([], lr=0.1)
    except ValueError as exc:
        torch_frames = signature._frames(exc)[1:]  # this test's own frame is not the harness's
        assert signature._pick([(HARNESS, "step"), *torch_frames], "ValueError") == \
            "raised:ValueError at torch/optim/sgd.py:__init__"
        # the caller, this file, is the user's code: named with its line, after torch's frame
        assert signature.innermost(exc).startswith(" (raised in torch/optim/optimizer.py:__init__, called from ")
        assert "test_signature.py:64 in test_a_real_exception" in signature.innermost(exc)


def test_an_exception_the_users_own_code_raises_is_located_at_their_line(tmp_path, monkeypatch):
    """A user's model raising on its own (not through torch): their file, line and function,
    never the torch call machinery around their forward."""
    (tmp_path / "their_model.py").write_text("import torch\n\n\nclass M(torch.nn.Module):\n"
                                             "    def forward(self, x):\n        raise ValueError('theirs')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    import their_model

    try:
        their_model.M()(torch.ones(1))
    except ValueError as exc:
        assert signature.innermost(exc) == " (raised at their_model.py:6 in forward)"


def test_ranks_left_waiting_for_a_rank_that_raised_do_not_change_its_signature():
    """Whether a rank reaches the raise or a collective first is timing: the same fault
    has one signature whichever way its ranks went, and the report still names the wait."""
    from tpdp_verify.errors import RankFailed
    from tpdp_verify.ranks.pool import CAUGHT_PART
    from tpdp_verify.runner.property import finding

    part = "raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:forward"
    raised = {r: f"Traceback ...\nRuntimeError: boom\n{CAUGHT_PART}{part}" for r in (2, 3)}
    all_raised = finding(RankFailed("raised on ranks 0-3", dict.fromkeys(range(4), raised[2]), {}, []))
    some_waited = finding(RankFailed("raised on ranks 2, 3; ranks 0, 1 were still blocked", raised, {}, [0, 1]))
    assert type(all_raised).signature == type(some_waited).signature == (part,)
    assert "still blocked" in str(some_waited)
