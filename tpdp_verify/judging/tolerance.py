"""How far a TP+DP value may be from the exact one: a bound earned by a baseline run.

Every value (gradient, parameter, optimizer state, output) has a float64 shadow: the same
single-device computation in float64, taken as exact. A float32 baseline run of the same
computation (one device, or plain DDP) has some error against it; reordering the same
float32 sums (TP splits a matmul's reduction, DP averages over ranks) moves the result by
errors of the same size. So the TP+DP run may be off the shadow by at most

    bound = SAFETY * (max|baseline - shadow| + eps(dtype) * max|shadow|) + eps(dtype) * scale

where the first eps term keeps the bound honest when the baseline is exact by luck, and
``scale`` is the largest magnitude among all values of the same kind at the same step
(every gradient of the model at step k): a value that is zero but for rounding, whose
float32 noise comes from cancelling terms as large as its neighbours, is allowed one unit
in the last place of that scale. A value off by a relative 1e-3 is far outside the bound:
see docs/tolerance.md for the derivation and for the measurements behind SAFETY.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAFETY = 32.0


@dataclass(frozen=True)
class Error:
    """One compared value: its error against the shadow and the bound it must stay within."""

    max_abs: float
    max_rel: float  # max_abs relative to the largest magnitude in the shadow
    bound: float

    @property
    def ratio(self) -> float:
        if self.bound == 0.0:
            return 0.0 if self.max_abs == 0.0 else float("inf")
        return self.max_abs / self.bound

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


def bound(baseline: torch.Tensor, shadow: torch.Tensor, dtype: torch.dtype = torch.float32,
          scale: float = 0.0) -> float:
    shadow = shadow.double()
    if shadow.numel() == 0:
        return 0.0
    eps = torch.finfo(dtype).eps
    baseline_error = (baseline.double() - shadow).abs().max().item()
    return SAFETY * (baseline_error + eps * shadow.abs().max().item()) + eps * scale


def error(observed: torch.Tensor, baseline: torch.Tensor, shadow: torch.Tensor,
          dtype: torch.dtype = torch.float32, scale: float = 0.0) -> Error:
    """``observed`` against ``shadow``, bounded by how far ``baseline`` is from it.

    ``scale``: the largest magnitude among the values of this kind at this step (see above).
    Shapes must agree; the caller reports a shape mismatch as a failed check.
    """
    shadow = shadow.double()
    if shadow.numel() == 0:
        return Error(0.0, 0.0, 0.0)
    diff = (observed.double() - shadow).abs()
    max_abs = float("inf") if not torch.isfinite(diff).all() else diff.max().item()
    largest = shadow.abs().max().item()
    return Error(max_abs, max_abs / largest if largest else (0.0 if max_abs == 0 else float("inf")),
                 bound(baseline, shadow, dtype, scale))
