"""A mixture-of-experts layer's output from its routed rows in expert order, in one pass.

The expert GEMMs leave one row per (token, choice) in expert order, `y[i]` for the i-th row.
A token's output is the weighted sum of its k rows:

    out[t] = sum_j weights[t k + j] * y[pos[t k + j]]

with `pos` the row each (token, choice) pair landed at, -1 where none did (a choice that went
to another rank's experts). Each program reads a token's k rows once and writes its output
once, accumulating in float32: the same bytes as the sum over k that follows a scatter to
[token, choice] order, and no scatter. Triton's CPU interpreter runs it for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from consumer.kernels.launch import Shaped, launch

BLOCK = 1024  # columns per program


@triton.jit
def _combine_kernel(
    y_ptr, pos_ptr, w_ptr, out_ptr, hidden, y_stride, out_stride,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pos_ptr + token * TOP_K + j).to(tl.int64)
        weight = tl.load(w_ptr + token * TOP_K + j).to(tl.float32)
        found = mask & (cols * 0 + row >= 0)  # as a vector (a scalar mask term does not mix)
        part = tl.load(y_ptr + row * y_stride + cols, mask=found, other=0.0)
        acc += weight * part.to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """out [T, h] = sum over j < top_k of weights[t k + j] * y[pos[t k + j]] (pos -1: none),
    for y [R, h] (rows contiguous), pos int64 [T k], weights [T k] of any float dtype; out in
    y's dtype, each sum rounded once."""
    tokens = pos.shape[0] // top_k
    out = torch.empty(tokens, y.shape[1], dtype=y.dtype, device=y.device)
    if tokens:
        _launch(y, pos, weights, out, top_k)
    return out


def _launch(y, pos, weights, out, top_k: int, *, compile_only: bool = False) -> None:
    hidden = out.shape[1]
    grid = (out.shape[0], triton.cdiv(hidden, BLOCK))
    args = (y, pos, weights, out, hidden, y.stride(0), out.stride(0))
    launch(_combine_kernel, grid, *args, TOP_K=top_k, BLOCK=BLOCK, compile_only=compile_only)


def precompile(*, hidden: int, top_k: int, dtype: torch.dtype, routing_dtype: torch.dtype) -> None:
    """Compile, without launching, the variant `combine` launches for rows of `hidden` in
    `dtype` and routing weights in `routing_dtype` (consumer/serve/precompile.py)."""
    y, out = Shaped(dtype, (1, hidden)), Shaped(dtype, (1, hidden))
    pos, weights = Shaped(torch.int64, (top_k,)), Shaped(routing_dtype, (top_k,))
    _launch(y, pos, weights, out, top_k, compile_only=True)
