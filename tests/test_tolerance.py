"""The tolerance model on its own: a reordered float32 computation stays within the bound
its baseline earns, a value off by a relative 1e-3 does not, and the edge cases (exact
baselines, empty and non-finite values) say what they should.

The same two claims are measured on real TP+DP runs by bench/bench_tolerance.py
(docs/tolerance.md)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpdp_verify.judging.tolerance import SAFETY, bound, error

SETTINGS = settings(max_examples=200, derandomize=True, database=None, deadline=None)


def _matmuls(side: int = 1):
    """Draws of a matmul's sizes (rows and columns at least ``side``), its seed and TP's chunks."""
    return given(seed=st.integers(0, 2**16), rows=st.integers(side, 8), inner=st.integers(1, 64),
                 cols=st.integers(side, 8), chunks=st.integers(1, 8))


def _matmul_three_ways(seed: int, rows: int, inner: int, cols: int, chunks: int):
    """y = x @ w in float64 (the shadow), in float32 at once (the baseline), and in float32
    as tensor parallelism computes it: the inner dimension split in ``chunks`` partial
    products, summed afterwards (RowwiseParallel's all-reduce)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=gen, dtype=torch.float64)
    w = torch.randn(inner, cols, generator=gen, dtype=torch.float64)
    shadow = x @ w
    baseline = x.float() @ w.float()
    parts = [a.float() @ b.float() for a, b in zip(x.chunk(chunks, 1), w.chunk(chunks, 0))]
    return sum(parts[1:], parts[0]), baseline, shadow


@SETTINGS
@_matmuls()
def test_a_reordered_float32_sum_stays_within_the_bound(seed, rows, inner, cols, chunks):
    observed, baseline, shadow = _matmul_three_ways(seed, rows, inner, cols, chunks)
    err = error(observed, baseline, shadow)
    assert err.ok, err


@pytest.mark.parametrize("factor", [1 + 1e-3, 1 - 1e-3])
@SETTINGS
@_matmuls()
def test_a_value_scaled_by_one_part_in_a_thousand_is_caught(factor, seed, rows, inner, cols, chunks):
    observed, baseline, shadow = _matmul_three_ways(seed, rows, inner, cols, chunks)
    err = error(observed * factor, baseline, shadow)
    assert not err.ok and err.ratio > 10, err


def test_an_exact_baseline_still_earns_a_bound_of_a_few_ulps():
    shadow = torch.tensor([1.0, -4.0], dtype=torch.float64)
    assert bound(shadow.float(), shadow) == pytest.approx(SAFETY * torch.finfo(torch.float32).eps * 4.0)
    assert error(shadow.float() * (1 + 1e-6), shadow.float(), shadow).ok
    assert not error(shadow.float() * (1 + 1e-5), shadow.float(), shadow).ok


def test_the_bound_follows_the_dtype_of_the_run():
    shadow = torch.tensor([1.0], dtype=torch.float64)
    assert bound(shadow, shadow, torch.bfloat16) / bound(shadow, shadow, torch.float32) == \
        pytest.approx(torch.finfo(torch.bfloat16).eps / torch.finfo(torch.float32).eps)


def test_non_finite_and_empty_values():
    shadow = torch.ones(3, dtype=torch.float64)
    nan = error(torch.tensor([1.0, float("nan"), 1.0]), shadow.float(), shadow)
    assert not nan.ok and nan.ratio == float("inf")
    empty = error(torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.float64))
    assert empty.ok and empty.max_abs == 0.0
    zero = error(torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert zero.ok and zero.bound == 0.0
    assert not error(torch.tensor([0.0, 1e-30]), torch.zeros(2), torch.zeros(2, dtype=torch.float64)).ok


def test_rounding_noise_around_zero_earns_one_ulp_of_the_scale_of_its_kind():
    """A gradient that is zero but for rounding (wq and wk when every token of a sample is
    the same: llama_lm with vocab 2) against a baseline that cancelled exactly by luck."""
    shadow = torch.zeros(3, dtype=torch.float64)
    noise = torch.tensor([1e-9, -1e-9, 0.0])
    assert not error(noise, shadow.float(), shadow).ok
    assert error(noise, shadow.float(), shadow, scale=0.3).ok


def test_the_scale_leaves_a_small_value_scaled_by_one_part_in_a_thousand_caught():
    shadow = torch.full((3,), 3e-4, dtype=torch.float64)  # a thousandth of the scale
    assert not error(shadow.float() * (1 + 1e-3), shadow.float(), shadow, scale=0.3).ok


def test_a_bound_that_is_not_finite_fails():
    """An overflow in the baseline gives an infinite bound, which would pass anything."""
    shadow = torch.ones(3, dtype=torch.float64)
    overflowed = torch.tensor([1.0, float("inf"), 1.0])
    assert bound(overflowed, shadow) == float("inf")
    assert not error(shadow.float(), overflowed, shadow).ok
    assert not error(shadow.bfloat16(), overflowed.bfloat16(), shadow, torch.bfloat16, whole=True).ok


HALF = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])


def _matmul_in(dtype: torch.dtype, seed: int, rows: int, inner: int, cols: int, chunks: int):
    """As _matmul_three_ways, in a half dtype: the baseline on one device in that dtype,
    TP's partial products each rounded to it and summed in it."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=gen, dtype=torch.float64)
    w = torch.randn(inner, cols, generator=gen, dtype=torch.float64)
    parts = [a.to(dtype) @ b.to(dtype) for a, b in zip(x.chunk(chunks, 1), w.chunk(chunks, 0))]
    return sum(parts[1:], parts[0]), x.to(dtype) @ w.to(dtype), x @ w


@HALF
@SETTINGS
@_matmuls()
def test_a_reordered_half_precision_sum_stays_within_both_bounds(dtype, seed, rows, inner, cols, chunks):
    observed, baseline, shadow = _matmul_in(dtype, seed, rows, inner, cols, chunks)
    err = error(observed, baseline, shadow, dtype, whole=True)
    assert err.whole is not None and err.ok, err


@HALF
@SETTINGS
@_matmuls(side=2)
def test_a_half_precision_value_scaled_by_five_percent_is_caught_as_a_whole(dtype, seed, rows, inner, cols, chunks):
    """The 32-unit bound lets a 5% scaling through in bfloat16; the whole-tensor one does not."""
    observed, baseline, shadow = _matmul_in(dtype, seed, rows, inner, cols, chunks)
    scaled = observed.double() * 1.05
    assert not error(scaled, baseline, shadow, dtype, whole=True).ok
    if dtype == torch.bfloat16:
        assert error(scaled, baseline, shadow, dtype).ok  # what the max bound alone lets through


def test_the_whole_tensor_comparison_is_for_half_precision_only():
    shadow = torch.ones(3, dtype=torch.float64)
    assert error(shadow.float(), shadow.float(), shadow, torch.float32, whole=True).whole is None


def test_a_slack_is_taken_off_its_element_only():
    """Adam's step on a gradient that is rounding noise moves an element by lr either way
    (verdict._adam_slack allows it 2 lr a step); the other elements keep their bound."""
    shadow = torch.tensor([1.0, 0.0], dtype=torch.float64)
    slack = torch.tensor([0.0, 0.02])
    stepped_the_other_way = torch.tensor([1.0, 0.02])
    assert not error(stepped_the_other_way, shadow.float(), shadow).ok
    assert error(stepped_the_other_way, shadow.float(), shadow, slack=slack).ok
    assert not error(stepped_the_other_way * torch.tensor([1.001, 1.0]), shadow.float(), shadow, slack=slack).ok


def test_a_complex_buffer_made_real_is_a_failed_check_and_one_kept_is_compared():
    """A RoPE cache's complex rotations are judged as they are: made real (its imaginary part
    dropped, as Module.to(float32) does) is a failed check; kept, its real and imaginary parts
    are compared within the bound (issue 49)."""
    from tpdp_verify.judging.verdict import Verdict, _values

    turned = torch.polar(torch.ones(3), torch.tensor([0.5, 1.0, 2.0]))
    shadow = {"rotation": turned.to(torch.complex128)}
    made_real, kept, off = Verdict(), Verdict(), Verdict()
    _values("buffer", 1, {"rotation": turned.real}, {"rotation": turned}, shadow, made_real, torch.float32)
    _values("buffer", 1, {"rotation": turned}, {"rotation": turned}, shadow, kept, torch.float32)
    _values("buffer", 1, {"rotation": turned.conj().resolve_conj()}, {"rotation": turned}, shadow, off, torch.float32)
    assert [c.name for c in made_real.checks if not c.ok] == ["buffer keeps its kind of dtype"]
    assert all(c.ok for c in kept.checks) and len(kept.rows) == 1 and kept.rows[0].err.ok
    assert not off.rows[0].err.ok  # the imaginary part is compared


def test_a_model_in_a_dtype_keeps_its_complex_and_integer_buffers():
    import copy

    from tpdp_verify.fixtures import ZOO, Size
    from tpdp_verify.ranks.loop import in_dtype

    built = ZOO["buffers"].build(Size())
    for dtype, rotations in ((torch.float32, torch.complex64), (torch.float64, torch.complex128),
                             (torch.bfloat16, torch.complex64)):
        model = in_dtype(copy.deepcopy(built), dtype)
        assert (model.scale.dtype, model.rotation.dtype, model.steps.dtype) == (dtype, rotations, torch.long)
        torch.testing.assert_close(model.rotation.imag.double(), built.rotation.imag.double(),
                                   atol=1e-7, rtol=0)
