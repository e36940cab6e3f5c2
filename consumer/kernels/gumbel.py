"""Two-level Gumbel-max sampling over a logits chunk in one Triton pass, bit-identical to tp_ops.

For row r and sample j, tp_ops defines (see `tp_ops.sampling_hash`, `tp_ops._local_samples`):

    hash(c) = mix64(stream_key[r, j] + c * 0x9E3779B97F4A7C15)             (mod 2**64)
    g(h)    = -log(-log(u)),  u = (2 * (h >>> 12) + 1) / 2**53               (fp64)
    z       = fp32(logit * inv_temperature)

1. blocks of SAMPLE_BLOCK global ids (cut at the shard's start): lse_b = log(sum exp(z)) in fp64,
   key_b = fp32(lse_b + g(hash(-(first id + 1)))), the largest wins, ties to the lowest block;
2. inside the winning block: key_v = z_v + fp32(g(hash(v + 1))), ties to the lowest id.

One program takes one row and up to NS samples: it streams the row once, BLOCKS sampling
blocks at a time, computing each block's fp64 mass (shared by the samples) and every sample's
block key, and keeps each sample's best block; then it draws inside each sample's block. The
work per column is one fp64 exp; the random words are V / SAMPLE_BLOCK + SAMPLE_BLOCK per
sample instead of V. Sums of exp run in another order than in PyTorch (fp64: the block keys
agree to ~1e-16, far below their fp32 rounding); everything else is the same arithmetic.

Floating-point contraction is turned off for this kernel: fusing `logit * inv + g` into one
FMA would skip the rounding of z that the reference performs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from consumer.tp_ops import SAMPLE_BLOCK, block_layout

# SplitMix64 constants as signed 64-bit words (tp_ops._signed64 of the unsigned values).
_GAMMA = tl.constexpr(-7046029254386353131)  # 0x9E3779B97F4A7C15
_MIX_M1 = tl.constexpr(-4658895280553007687)  # 0xBF58476D1CE4E5B9
_MIX_M2 = tl.constexpr(-7723592293110705685)  # 0x94D049BB133111EB
_MASK52 = tl.constexpr(0xFFFFFFFFFFFFF)
_TWO_M52 = tl.constexpr(2.0**-52)
_TWO_M53 = tl.constexpr(2.0**-53)


@dataclass
class GumbelConfig:
    """Launch shape; benchmarks may change the module's `CONFIG`."""

    blocks_per_step: int = 8  # sampling blocks streamed per iteration (power of 2)
    samples_per_program: int = 16  # samples sharing one pass over a row (power of 2)
    num_warps: int = 4


CONFIG = GumbelConfig()


@triton.jit
def _mix64(x):
    # `>>` on int64 is arithmetic; the masks make it the logical shift of the definition.
    # Multiplication wraps modulo 2**64, as the definition wants.
    x ^= (x >> 30) & 0x3FFFFFFFF
    x *= _MIX_M1
    x ^= (x >> 27) & 0x1FFFFFFFFF
    x *= _MIX_M2
    x ^= (x >> 31) & 0x1FFFFFFFF
    return x


@triton.jit
def _exp64(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # noqa: SIM108 - a constexpr branch: Triton compiles only the side taken
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def _log64(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # noqa: SIM108 - a constexpr branch: Triton compiles only the side taken
        y = tl.log(x)
    else:
        # CUDA's double-precision log, the function torch's CUDA log kernel calls.
        y = libdevice.log(x)
    return y


@triton.jit
def _gumbel64(h, INTERPRET: tl.constexpr):
    """-log(-log(u)) in fp64 for the word h: the reference's noise, bit for bit."""
    u = ((h >> 12) & _MASK52).to(tl.float64) * _TWO_M52 + _TWO_M53  # exact: (2k + 1) / 2**53
    return -_log64(-_log64(u, INTERPRET), INTERPRET)


@triton.jit
def _block_gumbel_kernel(
    logits_ptr,
    stride_r,
    inv_ptr,
    keys_ptr,
    out_key_ptr,
    out_id_ptr,
    out_z_ptr,
    valid,
    start,
    offset,
    n_blocks,
    n_samples,
    NS: tl.constexpr,
    BLOCKS: tl.constexpr,
    WIDTH: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0)
    js = tl.program_id(1) * NS + tl.arange(0, NS)
    jm = js < n_samples
    skey = tl.load(keys_ptr + row * n_samples + js, mask=jm, other=0)
    inv = tl.load(inv_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_r
    bs = tl.arange(0, BLOCKS)
    ws = tl.arange(0, WIDTH)

    best = tl.full([NS], float("-inf"), tl.float32)
    best_block = tl.zeros([NS], tl.int32)  # block 0 stands when every key is -inf
    for b0 in range(0, n_blocks, BLOCKS):
        blk = b0 + bs
        cols = blk[:, None] * WIDTH - offset + ws[None, :]  # local columns, [BLOCKS, WIDTH]
        cm = (cols >= 0) & (cols < valid)
        x = tl.load(row_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        z = tl.where(cm, x * inv, float("-inf"))
        m = tl.max(z, axis=1)
        live = m > float("-inf")
        m64 = tl.where(live, m, 0.0).to(tl.float64)
        s = tl.sum(_exp64(z.to(tl.float64) - m64[:, None], INTERPRET), axis=1)
        lse = tl.where(live, m64 + _log64(s, INTERPRET), float("-inf"))
        first = tl.maximum(blk * WIDTH - offset, 0).to(tl.int64) + start
        h = _mix64(skey[:, None] + (-(first + 1) * _GAMMA)[None, :])
        key = (lse[None, :] + _gumbel64(h, INTERPRET)).to(tl.float32)  # [NS, BLOCKS]
        key = tl.where((blk < n_blocks)[None, :], key, float("-inf"))
        step_best = tl.max(key, axis=1)
        step_arg = tl.argmax(key, axis=1, tie_break_left=True)
        # Strictly greater: an equal key in a later block loses.
        better = step_best > best
        best = tl.where(better, step_best, best)
        best_block = tl.where(better, b0 + step_arg, best_block)

    cols = best_block[:, None] * WIDTH - offset + ws[None, :]  # [NS, WIDTH]
    cm = (cols >= 0) & (cols < valid)
    x = tl.load(row_ptr + cols, mask=cm & jm[:, None], other=0.0).to(tl.float32)
    z = tl.where(cm, x * inv, float("-inf"))
    h = _mix64(skey[:, None] + (cols.to(tl.int64) + (start + 1)) * _GAMMA)
    key = z + _gumbel64(h, INTERPRET).to(tl.float32)
    arg = tl.argmax(key, axis=1, tie_break_left=True)
    at = ws[None, :] == arg[:, None]
    col = tl.sum(tl.where(at, cols, 0), axis=1)
    col = tl.minimum(tl.maximum(col, 0), valid - 1)
    win_z = tl.max(tl.where(at, z, float("-inf")), axis=1)
    out = row * n_samples + js
    tl.store(out_key_ptr + out, best, mask=jm)
    tl.store(out_id_ptr + out, col.to(tl.int64) + start, mask=jm)
    tl.store(out_z_ptr + out, win_z, mask=jm)


def _interpreting() -> bool:
    # Triton's own switch (its CPU interpreter): numpy's fp64 log stands in for libdevice there.
    return os.environ.get("TRITON_INTERPRET") == "1"


def gumbel_argmax(
    *,
    logits_RV: torch.Tensor,
    inv_temperature_R: torch.Tensor,
    keys_RN: torch.Tensor,
    start: int,
    valid: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (row, sample): the best Gumbel key over the first `valid` columns, its global id
    (`start` + column) and its tempered logit; what `tp_ops._local_samples` returns.

    logits_RV: [R, >= valid] float logits (unit column stride); inv_temperature_R: fp32 [R];
    keys_RN: int64 [R, N] stream keys (`tp_ops.stream_keys`). Requires valid >= 1.
    """
    rows, n = keys_RN.shape
    device = logits_RV.device
    key_RN = torch.empty((rows, n), dtype=torch.float32, device=device)
    id_RN = torch.empty((rows, n), dtype=torch.int64, device=device)
    z_RN = torch.empty((rows, n), dtype=torch.float32, device=device)
    if rows == 0 or n == 0:
        return key_RN, id_RN, z_RN
    if logits_RV.stride(1) != 1:
        logits_RV = logits_RV.contiguous()
    cfg = CONFIG
    ns = min(cfg.samples_per_program, triton.next_power_of_2(n))
    offset, n_blocks = block_layout(start, valid)
    grid = (rows, triton.cdiv(n, ns))
    _block_gumbel_kernel[grid](
        logits_RV,
        logits_RV.stride(0),
        inv_temperature_R.float().contiguous(),
        keys_RN.contiguous(),
        key_RN,
        id_RN,
        z_RN,
        valid,
        start,
        offset,
        n_blocks,
        n,
        NS=ns,
        BLOCKS=cfg.blocks_per_step,
        WIDTH=SAMPLE_BLOCK,
        INTERPRET=_interpreting(),
        num_warps=cfg.num_warps,
        enable_fp_fusion=False,
    )
    return key_RN, id_RN, z_RN
