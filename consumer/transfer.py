"""Host-to-device copies that do not wait for the device: the forward's token ids and
positions, and the head's per-row inputs, go over with `to_device`.

A leaf: imports torch only, so the reference head (`consumer/tp_ops/`), the forward
(`scoring.py`, `attention.py`, `graphs.py`) and the kernels may all use it.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from the host to CUDA through pinned memory, so the copy does not wait
    for work already queued on the device (a plain `.to` would sync)."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
