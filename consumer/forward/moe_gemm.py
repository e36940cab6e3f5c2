"""The expert GEMMs of a mixture-of-experts layer: SwiGLU FFNs of many experts over their tokens.

Rows arrive sorted by expert, `counts[e]` rows for local expert e. On CUDA the grouped GEMM
torch provides (`torch.nn.functional.grouped_mm`, or `torch._grouped_mm` in older releases) runs
every expert in one kernel per projection, without a host sync on the counts; it is used only
where a feature test on the device passes (dtype, architecture). Elsewhere a loop over experts
computes the same thing with one pair of matmuls per expert that has rows. SwiGLU is the fused
kernel the dense MLP uses on CUDA (consumer/kernels/swiglu.py), PyTorch elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn import functional as F

from consumer import kernels


def _grouped_mm_fn() -> Callable[..., torch.Tensor] | None:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn if callable(fn) else None


@functools.cache
def grouped_available(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether the grouped GEMM runs (and agrees with a loop) on this device and dtype."""
    fn = _grouped_mm_fn()
    if fn is None or device_type != "cuda":
        return False
    device = (
        torch.device(device_type)
        if device_index is None
        else torch.device(device_type, device_index)
    )
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(48, 64, device=device, dtype=dtype, generator=gen)
        w = torch.randn(3, 32, 64, device=device, dtype=dtype, generator=gen)
        counts = torch.tensor([16, 0, 32], device=device)
        got = _grouped(fn, x, w, counts)
        want = _looped(x, w, counts)
        return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _grouped(fn, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [T, k] by experts' w [E, n, k] -> [T, n], rows of expert e at its offsets."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return fn(x, w.transpose(-2, -1), offs=offs)


def _looped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start : start + n] = x[start : start + n] @ w[e].T
        start += n
    return out


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` [T, k] (sorted by expert, counts[e] rows each) times their expert's
    `w` [E, n, k] transposed: [T, n]."""
    fn = _grouped_mm_fn()
    if (
        fn is not None
        and x.is_cuda
        and x.shape[0] > 0
        and grouped_available(x.device.type, x.device.index, x.dtype)
    ):
        return _grouped(fn, x.contiguous(), w, counts)
    return _looped(x, w, counts)


def swiglu_experts(
    x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """SwiGLU FFN of each expert over its rows: fc1 [E, 2f, h] = [gate; up], fc2 [E, h, f];
    x [T, h] sorted by expert with counts[e] rows each; returns [T, h]."""
    return expert_matmul(swiglu(expert_matmul(x, fc1, counts)), fc2, counts)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up]: the fused kernel on CUDA (consumer/kernels)."""
    fused = kernels.load(h.device)
    if fused is not None and h.shape[0] > 0:
        return fused.swiglu(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up
