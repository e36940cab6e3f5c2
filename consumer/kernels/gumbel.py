"""Gumbel-max sampling over a logits chunk in one Triton pass, bit-identical to tp_ops.

For row r, sample j and valid column v of this rank's shard, tp_ops defines (see
`tp_ops.sampling_hash`):

    h = mix64(stream_key[r, j] + (start + v + 1) * 0x9E3779B97F4A7C15)      (mod 2**64)
    u = (2 * (h >>> 12) + 1) / 2**53                                       (exact in fp64)
    key = z[r, v] - fp32(log(-log(u)))          z = fp32(logit * inv_temperature), fp64 logs

and keeps, per (r, j), the largest key, ties to the lowest id. The expensive part of the exact
key is the pair of fp64 logs. This kernel first computes an fp32 approximation of every key
(error below 1e-4, far inside the margin used) and evaluates the exact fp64 keys only for
blocks of columns whose approximate maximum comes within that margin of the best exact key
so far: the first block, blocks holding a new running maximum (about ln(V / BLOCK_V) of them
in random order) and near-ties. A block that is skipped has every exact key strictly below the
running best, so it can hold neither the winner nor a tie with it; within an evaluated block
the exact keys and the lowest-index argmax decide, exactly as the reference does.

Floating-point contraction is turned off for this kernel: fusing `logit * inv - g` into one
FMA would skip the rounding of z that the reference performs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# SplitMix64 constants as signed 64-bit words (tp_ops._signed64 of the unsigned values).
_GAMMA = tl.constexpr(-7046029254386353131)  # 0x9E3779B97F4A7C15
_MIX_M1 = tl.constexpr(-4658895280553007687)  # 0xBF58476D1CE4E5B9
_MIX_M2 = tl.constexpr(-7723592293110705685)  # 0x94D049BB133111EB
_MASK52 = tl.constexpr(0xFFFFFFFFFFFFF)
_TWO_M52 = tl.constexpr(2.0**-52)
_TWO_M53 = tl.constexpr(2.0**-53)
# A block is evaluated exactly when its approximate best key reaches best - (ABS + REL*|best|).
# The fp32 approximation errs by < 3e-5 in g plus the fp32 rounding of the key (2**-23 |key|).
_TOL_ABS = tl.constexpr(1e-3)
_TOL_REL = tl.constexpr(2.0**-16)


@dataclass
class GumbelConfig:
    """Launch shape; benchmarks may change the module's `CONFIG`."""

    block_v: int = 1024  # columns per iteration
    samples_per_program: int = 1  # samples sharing one load of a logits block (power of 2)
    num_warps: int = 4
    # Screen with unsigned 64-bit hashing, bit-built fp32 uniforms and the hardware's approximate
    # log2 (about half the instructions of the portable screen); False: the portable screen.
    fast_screen: bool = True


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
def _mix64_u(x):
    # The same function on uint64, where `>>` is the logical shift itself.
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9
    x ^= x >> 27
    x *= 0x94D049BB133111EB
    x ^= x >> 31
    return x


@triton.jit
def _unit_f32(bits23):
    # 2**-23 * bits23 exactly, for 0 <= bits23 < 2**23: the float 1.bits23 minus 1.
    return (bits23 | 0x3F800000).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def _fast_log2(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # noqa: SIM108 - a constexpr branch: Triton compiles only the side taken
        y = tl.log2(x)
    else:
        y = libdevice.fast_log2f(x)  # lg2.approx: abs error ~2**-22 on these magnitudes
    return y


@triton.jit
def _approx_g_fast(h, INTERPRET: tl.constexpr):
    """fp32 log(-log(u)) from the uint64 hash h (u = (2 * (h >> 12) + 1) / 2**53).

    u is rebuilt from bits 63..18 of h (the top 46 of its 52) as hi * 2**-23 + lo * 2**-46,
    truncated, so u is underestimated by < 2**-46: for u >= 2**-23 (hi > 0) a relative error
    < 2**-23, and g = log(-log u) errs by < 1e-5. hi == 0 (u < 2**-23, one column in 8
    million) returns -3e38, whose key (+3e38 for any finite z; -inf stays -inf, never NaN)
    sends the block to the exact evaluation. Near u = 1, 1 - u keeps its precision because
    1 - hi * 2**-23 is exact.
    """
    hi = (h >> 41).to(tl.int32)
    lo = ((h >> 18) & 0x7FFFFF).to(tl.int32)
    f_hi = _unit_f32(hi)
    f_lo = _unit_f32(lo) * 1.1920928955078125e-07  # 2**-23
    u = f_hi + f_lo
    w = (1.0 - f_hi) - f_lo
    # -log(1 - w) = w + w^2/2 + w^3/3 + ...; truncation error < w^3/4 relative for w < 0.02.
    series = w * (1.0 + w * (0.5 + w * 0.3333333333333333))
    neg_log_u = tl.where(w < 0.02, series, _fast_log2(u, INTERPRET) * -0.6931471805599453)
    g = _fast_log2(neg_log_u, INTERPRET) * 0.6931471805599453
    return tl.where(hi == 0, -3.0e38, g)


@triton.jit
def _approx_g(k52):
    """fp32 log(-log(u)) for u = (2 * k52 + 1) / 2**53, absolute error below 3e-5."""
    u = k52.to(tl.float32) * _TWO_M52 + _TWO_M53
    # 1 - u, formed from the complementary integer 2**52 - 1 - k52 so that it keeps full
    # relative precision near u = 1, where -log(u) ~ 1 - u and fp32(u) alone would lose it.
    w = (k52 ^ _MASK52).to(tl.float32) * _TWO_M52 + _TWO_M53
    # -log(1 - w) = w + w^2/2 + w^3/3 + ...; truncation error < w^3/4 relative for w < 0.02.
    neg_log_u = tl.where(w < 0.02, w * (1.0 + w * (0.5 + w * 0.3333333333333333)), -tl.log(u))
    return tl.log(neg_log_u)


@triton.jit
def _exact_g(k52, INTERPRET: tl.constexpr):
    """fp32(log(-log(u))) with both logs in fp64: the reference's noise, bit for bit."""
    u = k52.to(tl.float64) * _TWO_M52 + _TWO_M53  # exact: (2k + 1) / 2**53
    if INTERPRET:  # noqa: SIM108 - a constexpr branch: Triton compiles only the side taken
        g = tl.log(-tl.log(u))
    else:
        # CUDA's double-precision log, the function torch's CUDA log kernel calls.
        g = libdevice.log(-libdevice.log(u))
    return g.to(tl.float32)


@triton.jit
def _gumbel_max_kernel(
    logits_ptr,
    stride_r,
    inv_ptr,
    keys_ptr,
    out_key_ptr,
    out_id_ptr,
    out_z_ptr,
    valid,
    start,
    n_samples,
    NS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    INTERPRET: tl.constexpr,
    FAST: tl.constexpr,
):
    row = tl.program_id(0)
    js = tl.program_id(1) * NS + tl.arange(0, NS)
    jm = js < n_samples
    skey = tl.load(keys_ptr + row * n_samples + js, mask=jm, other=0)
    inv = tl.load(inv_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_r
    offs = tl.arange(0, BLOCK_V)

    best = tl.full([NS], float("-inf"), tl.float32)
    # Column 0 stands when every key is -inf: what torch's max returns for such a row.
    best_col = tl.zeros([NS], tl.int64)
    best_z = tl.full([NS], float("-inf"), tl.float32)
    for c0 in range(0, valid, BLOCK_V):
        cols = c0 + offs
        cm = cols < valid
        x = tl.load(row_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        z = tl.where(cm, x * inv, float("-inf"))
        if FAST:
            col_u = (cols.to(tl.int64) + (start + 1)).to(tl.uint64) * 0x9E3779B97F4A7C15
            h_u = _mix64_u(skey.to(tl.uint64, bitcast=True)[:, None] + col_u[None, :])
            approx_max = tl.max(z[None, :] - _approx_g_fast(h_u, INTERPRET), axis=1)
            k52 = (h_u >> 12).to(tl.int64, bitcast=True)
        else:
            h = _mix64(skey[:, None] + ((cols.to(tl.int64) + (start + 1)) * _GAMMA)[None, :])
            k52 = (h >> 12) & _MASK52
            approx_max = tl.max(z[None, :] - _approx_g(k52), axis=1)
        # |best| is inf while best is -inf, so the first block always qualifies.
        hot = approx_max >= best - (tl.abs(best) * _TOL_REL + _TOL_ABS)
        if tl.max(hot.to(tl.int32), axis=0) > 0:
            key = z[None, :] - _exact_g(k52, INTERPRET)
            blk_best = tl.max(key, axis=1)
            blk_col = tl.argmax(key, axis=1, tie_break_left=True)
            at_col = offs[None, :] == blk_col[:, None]
            blk_z = tl.max(tl.where(at_col, z[None, :], float("-inf")), axis=1)
            # Strictly greater: an equal key in a later block has a higher id and loses.
            better = blk_best > best
            best = tl.where(better, blk_best, best)
            best_col = tl.where(better, (c0 + blk_col).to(tl.int64), best_col)
            best_z = tl.where(better, blk_z, best_z)
    out = row * n_samples + js
    tl.store(out_key_ptr + out, best, mask=jm)
    tl.store(out_id_ptr + out, best_col + start, mask=jm)
    tl.store(out_z_ptr + out, best_z, mask=jm)


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
    grid = (rows, triton.cdiv(n, ns))
    _gumbel_max_kernel[grid](
        logits_RV,
        logits_RV.stride(0),
        inv_temperature_R.float().contiguous(),
        keys_RN.contiguous(),
        key_RN,
        id_RN,
        z_RN,
        valid,
        start,
        n,
        NS=ns,
        BLOCK_V=cfg.block_v,
        INTERPRET=_interpreting(),
        FAST=cfg.fast_screen,
        num_warps=cfg.num_warps,
        enable_fp_fusion=False,
    )
    return key_RN, id_RN, z_RN
