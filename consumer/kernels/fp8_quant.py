"""Activations to FP8 per token and 128-channel group, in one Triton kernel (CUDA).

`consumer/forward/fp8_gemm.py` quantizes the input of every FP8 linear this way before
cuBLAS's block-scaled GEMM. In PyTorch ops that is a float copy, an abs, a max, a division, a
cast, then a transposed copy of the scales and zero padding of the tokens: seven passes and
launches per linear. This kernel reads each [tokens x 128] tile once and writes the FP8 values
and the float32 scales straight into the layout the GEMM reads: tokens padded to a multiple of
16 with zeros, scales outer-dim-major (stored [G, T_pad], handed over as its [T_pad, G]
transpose). The arithmetic is `quantize_activations`'s: scale = max(|x|, 1e-12) / 448 per
group, q = x / scale rounded to the nearest float8_e4m3fn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from consumer.kernels.launch import Shaped, launch

GROUP = 128
TOKEN_ALIGN = 16  # cuBLAS's FP8 row alignment
_BLOCK_T = 32  # tokens per program


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    tokens,
    tokens_padded,
    k,
    stride_x,
    fp8_max: tl.constexpr,
    tiny: tl.constexpr,
    block_t: tl.constexpr,
    group: tl.constexpr,
):
    rows = tl.program_id(0) * block_t + tl.arange(0, block_t)
    g = tl.program_id(1)
    cols = g * group + tl.arange(0, group)
    live = rows < tokens
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=live[:, None], other=0.0)
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), tiny) / fp8_max
    q = tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv)
    in_pad = rows < tokens_padded
    tl.store(q_ptr + rows[:, None] * k + cols[None, :], q, mask=in_pad[:, None])
    tl.store(s_ptr + g * tokens_padded + rows, scale, mask=in_pad)


def quantize_activations_padded(x_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [T_pad, K], float32 scales [T_pad, G] outer-dim-major) for a CUDA
    tensor x [T, K] (any float dtype, rows may be strided); T_pad = T rounded up to 16, the
    padding rows zero. K must be a multiple of 128."""
    t, k = x_TK.shape
    if k % GROUP:
        raise ValueError(f"FP8 activations need a multiple of {GROUP} channels, got {k}")
    if x_TK.stride(1) != 1:
        x_TK = x_TK.contiguous()
    tp = -(-t // TOKEN_ALIGN) * TOKEN_ALIGN
    q = torch.empty(tp, k, dtype=torch.float8_e4m3fn, device=x_TK.device)
    s = torch.empty(k // GROUP, tp, dtype=torch.float32, device=x_TK.device)
    _launch(x_TK, q, s, t, tp)
    return q, s.t()


def _launch(x_TK, q, s, t: int, tp: int, *, compile_only: bool = False) -> None:
    k = x_TK.shape[1]
    grid = (triton.cdiv(tp, _BLOCK_T), k // GROUP)
    args = (x_TK, q, s, t, tp, k, x_TK.stride(0))
    launch(
        _quantize_kernel,
        grid,
        *args,
        fp8_max=448.0,
        tiny=1e-12,
        block_t=_BLOCK_T,
        group=GROUP,
        compile_only=compile_only,
    )


def precompile(*, k: int, tokens: int, dtype: torch.dtype) -> None:
    """Compile, without launching, the variant `quantize_activations_padded` launches on a
    contiguous [tokens, k] input of `dtype` (the token count matters only as Triton sorts
    integers: 1, a multiple of 16, other) (consumer/serve/precompile.py)."""
    tp = -(-tokens // TOKEN_ALIGN) * TOKEN_ALIGN
    x = Shaped(dtype, (tokens, k))
    q = Shaped(torch.float8_e4m3fn, (tp, k))
    s = Shaped(torch.float32, (k // GROUP, tp))
    _launch(x, q, s, tokens, tp, compile_only=True)
