"""Per-row temperatures, checked and turned into the reciprocals the head multiplies by.

Shape legend: T  rows (scored positions) of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["validate_temperature"]


def validate_temperature(*, temperature_T: torch.Tensor | Sequence[float] | float) -> torch.Tensor:
    """Check per-row temperatures and return their reciprocals as fp32 `inv_temperature_T` (CPU).

    Raises ValueError naming the first offending row when a temperature is <= 0, NaN or inf, or
    so small that its reciprocal overflows fp32.
    """
    temps = torch.as_tensor(temperature_T, dtype=torch.float64).detach().cpu().reshape(-1)
    bad = ~torch.isfinite(temps) | (temps <= 0)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"temperature must be a finite number > 0 (not <= 0, NaN or inf); row {row} has "
            f"{float(temps[row])}"
        )
    inv = (1.0 / temps).to(torch.float32)
    if not bool(torch.isfinite(inv).all()):
        row = int((~torch.isfinite(inv)).nonzero()[0, 0])
        raise ValueError(
            f"temperature {float(temps[row])} at row {row} is too small: 1/temperature "
            "overflows float32"
        )
    return inv
