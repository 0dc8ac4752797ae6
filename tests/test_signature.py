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
    from tpdp_verify.ranks.rank import CAUGHT_PART
    from tpdp_verify.runner.property import finding

    part = "raised:RuntimeError at torch/distributed/fsdp/fully_sharded_data_parallel.py:forward"
    raised = {r: f"Traceback ...\nRuntimeError: boom\n{CAUGHT_PART}{part}" for r in (2, 3)}
    all_raised = finding(RankFailed("raised on ranks 0-3", dict.fromkeys(range(4), raised[2]), {}, []))
    some_waited = finding(RankFailed("raised on ranks 2, 3; ranks 0, 1 were still blocked", raised, {}, [0, 1]))
    assert type(all_raised).signature == type(some_waited).signature == (part,)
    assert "still blocked" in str(some_waited)


def test_two_errors_under_one_api_are_two_parts_and_one_api():
    """Two faults raising under the same torch API (FSDP2's reduce-scatter, loss_parallel's
    gather, both inside ``backward``) are two failures to the judge (issue 42)."""
    frames = [(HARNESS, "step"), (TORCH + "_tensor.py", "backward")]
    chunk = signature._pick(frames, "RuntimeError", "_chunk_cat expects non-empty tensor")
    gather = signature._pick(frames, "RuntimeError", "index -100 is out of bounds for dimension 1 with size 4")
    assert chunk != gather
    assert signature.api(chunk) == signature.api(gather) == "raised:RuntimeError at torch/_tensor.py:backward"
    assert gather == "raised:RuntimeError at torch/_tensor.py:backward: index <n> is out of bounds for dimension <n> with size <n>"


def test_a_message_keeps_the_fault_and_drops_what_varies_by_case_and_run():
    """The same fault on two cases, or two runs, says the same: sizes, shapes, ranks, names,
    paths and addresses left out; the words that tell one fault from another kept."""
    m = signature.message
    assert m("mat1 and mat2 shapes cannot be multiplied (8x12 and 6x12)") == \
        m("mat1 and mat2 shapes cannot be multiplied (4x3 and 16x2)") == \
        "mat1 and mat2 shapes cannot be multiplied (<n> and <n>)"
    assert m("got [8, 16] but expected shape compatible with [8]") == "got [<n>] but expected shape compatible with [<n>]"
    assert m("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:45678") == \
        "[<path>] Connection closed by peer [<n>]:<n>"
    assert m("Missing key(s) in state_dict: \"layers.0.w\", \"head.b\".") == m("Missing key(s) in state_dict: \"x\".")
    assert m("object at 0x7f00aa12") == "object at <n>"
    # an announcing first line takes the next along; a long message is cut; none is nothing
    assert m("Error(s) in loading state_dict for Linear:\n\tsize mismatch for 'weight'") == \
        "Error(s) in loading state_dict for Linear: size mismatch for <name>"
    assert len(m("x " * 500)) <= signature.MESSAGE_CHARS
    assert m("") == m("\n  \n") == ""
    assert signature._pick([(HARNESS, "step")], "AssertionError", "") == "raised:AssertionError"


def test_a_rank_s_traceback_text_gives_the_part_the_exception_gives():
    """A rank's reply carries its traceback as text: the part read from it is the one the
    exception itself gives, its message (the first lines of the last exception) included."""
    import traceback

    for make in (lambda: torch.nn.Linear(2, 2).load_state_dict({"weight": torch.ones(3, 3)}),
                 lambda: torch.ones(2, 3) @ torch.ones(4, 5)):
        try:
            try:
                make()
            except RuntimeError as inner:
                raise RuntimeError("while loading:\nsee above") from inner
        except RuntimeError as exc:
            assert signature.raised_from_text(traceback.format_exc()) == signature.raised(exc)
            assert signature.raised(exc).endswith(": while loading: see above")


def test_a_harness_error_whose_message_says_at_is_not_the_code_under_test():
    """Only an API makes a raised part the code under test's: a message is never read for it."""
    from tpdp_verify.errors import RankFailed
    from tpdp_verify.runner.property import finding

    tb = f'Traceback (most recent call last):\n  File "{HARNESS}", line 1, in step\n    x\nValueError: failed at step 2\n'
    assert signature.raised_from_text(tb) == "raised:ValueError: failed at step <n>"
    assert finding(RankFailed("raised on rank 0", {0: tb}, {}, [])) is None


def test_a_peers_closed_connection_beside_a_raise_is_its_echo():
    """A rank waiting for the one that raised may meet gloo's closed connection, or be
    stopped first: timing, so the echo is left out where the raise says why."""
    raised = "raised:RuntimeError at torch/_tensor.py:backward: index <n> is out of bounds"
    echo = "raised:RuntimeError at torch/_tensor.py:backward: [<path>] Connection closed by peer [<n>]:<n>"
    assert signature.echoes_left_out([raised, echo]) == {raised}
    assert signature.echoes_left_out([echo, "hang"]) == {"hang"}
    assert signature.echoes_left_out([echo]) == {echo}  # alone, it is all that failed
    assert signature.name(raised) == signature.name("raised:RuntimeError: boom") == "RaisesRuntimeError"
