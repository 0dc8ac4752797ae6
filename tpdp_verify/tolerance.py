"""How far a TP+DP value may be from the exact one: a bound earned by a baseline run.

Every value (gradient, parameter, optimizer state, output) has a float64 shadow: the same
single-device computation in float64, taken as exact. A float32 baseline run of the same
computation (one device, or plain DDP) has some error against it; reordering the same
float32 sums (TP splits a matmul's reduction, DP averages over ranks) moves the result by
errors of the same size. So the TP+DP run may be off the shadow by at most

    bound = SAFETY * (max|baseline - shadow| + eps(dtype) * max|shadow|)

where the eps term keeps the bound honest when the baseline is exact by luck. A value off
by a relative 1e-3 is far outside it: see docs/tolerance.md for the derivation and for
the measurements behind SAFETY.
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


def bound(baseline: torch.Tensor, shadow: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    shadow = shadow.double()
    if shadow.numel() == 0:
        return 0.0
    baseline_error = (baseline.double() - shadow).abs().max().item()
    return SAFETY * (baseline_error + torch.finfo(dtype).eps * shadow.abs().max().item())


def error(observed: torch.Tensor, baseline: torch.Tensor, shadow: torch.Tensor,
          dtype: torch.dtype = torch.float32) -> Error:
    """``observed`` against ``shadow``, bounded by how far ``baseline`` is from it.

    Shapes must agree; the caller reports a shape mismatch as a failed check.
    """
    shadow = shadow.double()
    if shadow.numel() == 0:
        return Error(0.0, 0.0, 0.0)
    diff = (observed.double() - shadow).abs()
    max_abs = float("inf") if not torch.isfinite(diff).all() else diff.max().item()
    scale = shadow.abs().max().item()
    return Error(max_abs, max_abs / scale if scale else (0.0 if max_abs == 0 else float("inf")),
                 bound(baseline, shadow, dtype))
