"""How far a TP+DP value may be from the exact one: a bound earned by the rounded run.

Every value (gradient, parameter, optimizer state, output) has a float64 shadow: the same
single-device computation in float64, taken as exact. A float32 run of the same (the rounded run)
computation (one device, or plain DDP) has some error against it; reordering the same
float32 sums (TP splits a matmul's reduction, DP averages over ranks) moves the result by
errors of the same size. So the TP+DP run may be off the shadow by at most

    bound = SAFETY * (max|rounded - shadow| + eps(dtype) * max|shadow|) + eps(dtype) * scale

where the first eps term keeps the bound honest when the rounded run is exact by luck, and
``scale`` is the largest magnitude among all values of the same kind at the same step
(every gradient of the model at step k): a value that is zero but for rounding, whose
float32 noise comes from cancelling terms as large as its neighbours, is allowed one unit
in the last place of that scale. A value off by a relative 1e-3 is far outside the bound:
see docs/tolerance.md for the derivation and for the measurements behind SAFETY.

In half precision that bound is 32 units of the last place of a tensor's largest element:
25 % in bfloat16, where a gradient scaled by 1.05 hides. So the first step's gradients of
a half-precision case are judged as whole tensors too: their root-mean-square error
against the shadow, relative to the shadow's, may be at most

    WHOLE_SAFETY * rms(rounded - shadow) / rms(shadow) + WHOLE_FLOOR * eps(dtype)

The rounded run has the same casts (the case's dtype on one device, or plain DP with
the same option), and in the first step both runs start from the same parameters, so
only the order of half-precision sums differs; later steps start from parameters already
a rounding apart, which half precision amplifies, and keep the 32-unit bound alone.
A bound or an error that is not finite fails: an overflow on either side says nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAFETY = 32.0
HALF = (torch.bfloat16, torch.float16)
WHOLE_SAFETY = 2.0  # measured in docs/tolerance.md, "Half precision"
WHOLE_FLOOR = 4.0  # units of eps(dtype)


@dataclass(frozen=True)
class Error:
    """One compared value: its error against the shadow and the bound it must stay within;
    for a whole-tensor comparison (``whole``), its relative RMS error and that bound too."""

    max_abs: float
    max_rel: float  # max_abs relative to the largest magnitude in the shadow
    bound: float
    whole: tuple[float, float] | None = None  # (rms error / rms shadow, its bound)

    @property
    def ratio(self) -> float:
        ratios = [_ratio(self.max_abs, self.bound)] + ([_ratio(*self.whole)] if self.whole else [])
        return max(ratios)

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


def _ratio(error: float, bound: float) -> float:
    """How far past its bound an error is; a bound or an error that is not finite fails."""
    if not (math.isfinite(error) and math.isfinite(bound)):
        return math.inf
    if bound == 0.0:
        return 0.0 if error == 0.0 else math.inf
    return error / bound


def bound(rounded: torch.Tensor, shadow: torch.Tensor, dtype: torch.dtype = torch.float32,
          scale: float = 0.0) -> float:
    shadow = shadow.double()
    if shadow.numel() == 0:
        return 0.0
    eps = torch.finfo(dtype).eps
    rounded_error = (rounded.double() - shadow).abs().max().item()
    return SAFETY * (rounded_error + eps * shadow.abs().max().item()) + eps * scale


def whole_error(observed: torch.Tensor, rounded: torch.Tensor, shadow: torch.Tensor,
                dtype: torch.dtype) -> tuple[float, float]:
    """(rms(observed - shadow), its bound), both relative to rms(shadow): see above."""
    shadow = shadow.double()
    size = shadow.norm().item()
    if size == 0.0:
        return 0.0, 0.0  # nothing to scale: the max bound judges it alone
    return ((observed.double() - shadow).norm().item() / size,
            WHOLE_SAFETY * (rounded.double() - shadow).norm().item() / size + WHOLE_FLOOR * torch.finfo(dtype).eps)


def error(observed: torch.Tensor, rounded: torch.Tensor, shadow: torch.Tensor,
          dtype: torch.dtype = torch.float32, scale: float = 0.0, whole: bool = False,
          slack: torch.Tensor | None = None) -> Error:
    """``observed`` against ``shadow``, bounded by how far ``rounded`` is from it.

    ``scale``: the largest magnitude among the values of this kind at this step (see above);
    ``whole``: judge the tensor as a whole too, where ``dtype`` is a half one; ``slack``: an
    allowance per element, taken off its error first (Adam's steps on rounding noise:
    tpdp_verify.judging.verdict). Shapes must agree; the caller reports a shape mismatch
    as a failed check.
    """
    shadow = shadow.double()
    if shadow.numel() == 0:
        return Error(0.0, 0.0, 0.0)
    diff = (observed.double() - shadow).abs()
    if slack is not None:
        diff = (diff - slack.double()).clamp(min=0.0)
    max_abs = float("inf") if not torch.isfinite(diff).all() else diff.max().item()
    largest = shadow.abs().max().item()
    return Error(max_abs, max_abs / largest if largest else (0.0 if max_abs == 0 else float("inf")),
                 bound(rounded, shadow, dtype, scale),
                 whole_error(observed, rounded, shadow, dtype) if whole and dtype in HALF else None)
