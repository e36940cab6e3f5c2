"""Triton helpers for the two-level Gumbel-max samples, bit-identical to the reference.

For row r and sample j, the reference path defines (see `tp_ops.sampling_hash` and
`consumer.tp_ops.local.local_samples`):

    hash(c) = mix64(stream_key[r, j] + c * 0x9E3779B97F4A7C15)             (mod 2**64)
    g(h)    = -log(-log(u)),  u = (2 * (h >>> 12) + 1) / 2**53               (fp64)
    z       = fp32(logit * inv_temperature)
    E(y)    = tp_ops.sampling_exp(y), fp32 multiplies and adds only

1. blocks of SAMPLE_BLOCK global ids (cut at the shard's start): lse_b = m_b + log(sum of
   fp64(E(z - m_b))) in fp64, key_b = fp32(lse_b + g(hash(-(first id + 1)))), the largest
   wins, ties to the lowest block;
2. inside the winning block: key_v = z_v + fp32(g(hash(v + 1))), ties to the lowest id.

`consumer.kernels.rowstats` streams each row once, finds each sample's block with fast keys
and checks the choice is the definition's (see there); `exact_lse` and `block_noise` give
the exact keys, and `draw_in_block` the exact key of a sample's block and the draw inside it.
fp64 sums run in another order than in PyTorch (the block keys agree to ~1e-16, far below
their fp32 rounding); everything else is the same arithmetic, so kernels that use these
helpers must turn floating-point contraction off (`enable_fp_fusion=False`): fusing
`logit * inv + g` into one FMA would skip the rounding of z that the reference performs.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

from consumer.head_common import (
    EXP2_COEFFS,
    EXP2_FLOOR,
    LOG2E_F32,
    MIX64_M1,
    MIX64_M2,
    SPLITMIX_GAMMA,
    signed64,
)

# SplitMix64 constants as signed 64-bit words (Triton's int64 constants are signed).
_GAMMA = tl.constexpr(signed64(SPLITMIX_GAMMA))
_MIX_M1 = tl.constexpr(signed64(MIX64_M1))
_MIX_M2 = tl.constexpr(signed64(MIX64_M2))
_MASK52 = tl.constexpr(0xFFFFFFFFFFFFF)
_TWO_M52 = tl.constexpr(2.0**-52)
_TWO_M53 = tl.constexpr(2.0**-53)
# tp_ops.sampling_exp's constants (all exact in fp32).
_C0, _C1, _C2, _C3, _C4, _C5 = (tl.constexpr(c) for c in EXP2_COEFFS)
_LOG2E = tl.constexpr(LOG2E_F32)
_EXP2_FLOOR = tl.constexpr(EXP2_FLOOR)


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (numpy's fp64 log stands in for
    libdevice's there)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


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
def log64(x, INTERPRET: tl.constexpr):
    """fp64 log: CUDA's double-precision log, the function torch's CUDA log kernel calls."""
    if INTERPRET:  # noqa: SIM108 - a constexpr branch: Triton compiles only the side taken
        y = tl.log(x)
    else:
        y = libdevice.log(x)
    return y


@triton.jit
def _uniform64(h):
    """u = (2 * (h >>> 12) + 1) / 2**53 in fp64, exact, for the word h."""
    return ((h >> 12) & _MASK52).to(tl.float64) * _TWO_M52 + _TWO_M53


@triton.jit
def _gumbel64(h, INTERPRET: tl.constexpr):
    """-log(-log(u)) in fp64 for the word h: the reference's noise, bit for bit."""
    return -log64(-log64(_uniform64(h), INTERPRET), INTERPRET)


@triton.jit
def sampling_exp(y):
    """tp_ops.sampling_exp, the same fp32 operations in the same order (no contraction)."""
    t = y * _LOG2E
    tc = tl.maximum(t, _EXP2_FLOOR - 1.0)
    n = tl.floor(tc)
    f = tc - n
    p = _C0 * f + _C1
    p = p * f + _C2
    p = p * f + _C3
    p = p * f + _C4
    p = p * f + _C5
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)  # 2**n, exact
    return tl.where(t >= _EXP2_FLOOR, p * scale, 0.0)


@triton.jit
def _block_word(skey, blk, start, offset, WIDTH: tl.constexpr):
    """hash(-(first id + 1)) for stream keys skey and blocks blk (broadcast)."""
    first = tl.maximum(blk * WIDTH - offset, 0).to(tl.int64) + start
    return _mix64(skey + (-(first + 1) * _GAMMA))


@triton.jit
def block_noise(skey, blk, start, offset, WIDTH: tl.constexpr, INTERPRET: tl.constexpr):
    """g(hash(-(first id + 1))) in fp64 for stream keys skey and blocks blk (broadcast)."""
    return _gumbel64(_block_word(skey, blk, start, offset, WIDTH), INTERPRET)


@triton.jit
def fast_block_noise(skey, blk, start, offset, WIDTH: tl.constexpr, INTERPRET: tl.constexpr):
    """block_noise to within 1e-5 in fp32: the inner log in fp64 (u may lie within 2**-53 of
    1), the outer one (of a number in [1e-16, 37]) by the hardware in fp32."""
    u = _uniform64(_block_word(skey, blk, start, offset, WIDTH))
    return -tl.log((-log64(u, INTERPRET)).to(tl.float32))


@triton.jit
def load_blocks(row_ptr, blk, used, inv, offset, valid, WIDTH: tl.constexpr):
    """For blocks blk [N] of a row (used: the entries to read): their local columns
    [N, WIDTH], which of them to count (used, and among the shard's real columns) and their
    tempered logits fp32(logit * inv), -inf where not counted."""
    cols = blk[:, None] * WIDTH - offset + tl.arange(0, WIDTH)[None, :]
    cm = used[:, None] & (cols >= 0) & (cols < valid)
    x = tl.load(row_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    return cols, cm, tl.where(cm, x * inv, float("-inf"))


@triton.jit
def exact_lse(z, INTERPRET: tl.constexpr):
    """The definition's block mass lse_b in fp64 for blocks of tempered logits z [N, WIDTH]
    (-inf for a block with no finite logit): sampling_exp terms summed in fp64."""
    m = tl.max(z, axis=1)
    live = m > float("-inf")
    ref = tl.where(live, m, 0.0)
    e = sampling_exp(z - ref[:, None])
    s = tl.sum(e.to(tl.float64), axis=1)
    return tl.where(live, ref.to(tl.float64) + log64(s, INTERPRET), float("-inf"))


@triton.jit
def margin(best):
    """How far apart the two best fast block keys must be for the fast winner to be the
    definition's (see rowstats): twice the largest gap between a fast key and the exact one,
    with room to spare."""
    return 1e-4 + (tl.abs(best) + 64.0) * 9.5367431640625e-07  # 2**-20


@triton.jit
def draw_in_block(
    row_ptr,
    inv,
    skey,
    best_block,
    live,
    valid,
    start,
    offset,
    WIDTH: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Step 2 for samples [NS] (live: the real ones) whose blocks are best_block: the block's
    exact key (step 1), the local column drawn and its tempered logit."""
    ws = tl.arange(0, WIDTH)
    cols, _, z = load_blocks(row_ptr, best_block, live, inv, offset, valid, WIDTH)
    noise = block_noise(skey, best_block, start, offset, WIDTH, INTERPRET)
    block_key = (exact_lse(z, INTERPRET) + noise).to(tl.float32)
    h = _mix64(skey[:, None] + (cols.to(tl.int64) + (start + 1)) * _GAMMA)
    key = z + _gumbel64(h, INTERPRET).to(tl.float32)
    arg = tl.argmax(key, axis=1, tie_break_left=True)
    at = ws[None, :] == arg[:, None]
    col = tl.sum(tl.where(at, cols, 0), axis=1)
    col = tl.minimum(tl.maximum(col, 0), valid - 1)
    win_z = tl.max(tl.where(at, z, float("-inf")), axis=1)
    return block_key, col, win_z
