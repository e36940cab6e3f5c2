"""Rotary position embedding in one pass per tensor: out = x rotated by its row's angles.

megatron's unfused RoPE recomputes cos and sin of the angles for q and for k in every layer,
rounds each product to bf16, and ends with a concatenation that copies the whole tensor:
about a dozen elementwise kernels per layer. Here the angles' cos and sin are gathered once
per forward (`TeacherGPTModel._preprocess`), and each of q and k is rotated by one kernel
that reads it once (any row and head strides, as megatron's qkv split leaves them) and writes
a contiguous [rows, heads, dim] tensor, which is what SDPA's flash kernels want anyway.
Arithmetic in fp32, rounded once to the input dtype. Non-interleaved (rotate-half) layout:
the first half of each head's dimensions pairs with the second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from consumer.kernels.launch import Shaped, launch


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    heads,
    x_row_stride,
    x_head_stride,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_P2)
    dmask = d < HALF
    mask = (h[:, None] < heads) & dmask[None, :]
    c = tl.load(cos_ptr + row * HALF + d, mask=dmask, other=0.0)[None, :]
    s = tl.load(sin_ptr + row * HALF + d, mask=dmask, other=0.0)[None, :]
    src = x_ptr + row * x_row_stride + h[:, None] * x_head_stride + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + row * heads * (2 * HALF) + h[:, None] * (2 * HALF) + d[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * c - x2 * s).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, dim] (last dim contiguous) rotated by cos, sin [rows, dim / 2] fp32."""
    rows, heads, dim = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((rows, heads, dim), dtype=x.dtype, device=x.device)
    _launch(x, cos, sin, out)
    return out


def _launch(x, cos, sin, out, *, compile_only: bool = False) -> None:
    rows, heads, dim = x.shape
    half = dim // 2
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // triton.next_power_of_2(half)))
    grid = (rows, triton.cdiv(heads, block_h))
    launch(
        _rope_kernel,
        grid,
        x,
        cos,
        sin,
        out,
        heads,
        x.stride(0),
        x.stride(1),
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        BLOCK_H=block_h,
        compile_only=compile_only,
    )


def precompile(*, heads: int, dim: int, dtype: torch.dtype) -> None:
    """Compile, without launching, the variant `rope` launches on a [rows, heads, dim] tensor
    of `dtype` with contiguous heads (consumer/serve/precompile.py)."""
    x = Shaped(dtype, (1, heads, dim))
    angles = Shaped(torch.float32, (1, dim // 2))
    _launch(x, angles, angles, x, compile_only=True)
