"""Per-row temperatures, checked and turned into the reciprocals the head multiplies by.

The rule is the requests' own (`shared.messages.inverse_temperature`: finite, > 0, and a
finite float32 reciprocal), so the head accepts exactly the temperatures submit accepted.

Shape legend: T  rows (scored positions) of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.messages import inverse_temperature

__all__ = ["validate_temperature"]


def validate_temperature(*, temperature_T: torch.Tensor | Sequence[float] | float) -> torch.Tensor:
    """Check per-row temperatures and return their reciprocals as fp32 `inv_temperature_T` (CPU).

    Raises ValueError naming the first offending row when a temperature is <= 0, NaN or inf, or
    so small that its reciprocal overflows fp32.
    """
    temps = torch.as_tensor(temperature_T, dtype=torch.float64).detach().cpu().reshape(-1)
    inv = []
    for row, t in enumerate(temps.tolist()):
        try:
            inv.append(inverse_temperature(t))
        except ValueError as exc:
            raise ValueError(f"row {row}: {exc}") from None
    return torch.tensor(inv, dtype=torch.float32)
