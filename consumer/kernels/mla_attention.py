"""Causal attention over a pack of documents for latent attention (MLA) decompressed for
prefill, forward only, in Triton (CUDA; Triton's CPU interpreter runs it for the tests).

DeepSeek-V3's latent attention, once its keys and values are decompressed, is ordinary
multi-head attention with 128 heads whose q/k head size (192: 64 rotary dims, then 128
"nope" dims) differs from v's (128). torch's varlen FlashAttention-2 needs one head size, so
the consumer pads v to 192 and throws a third of the output away. This kernel takes v at its
own width and splits the 192-dim q.k product into two power-of-two dots (128 + 64; generally
D1, the largest power of two <= d_qk, and D2 = d_qk - D1, itself a power of two or 0).

The work list (`plan`) holds one row per query tile: BM consecutive query rows of one
document, as (the document's first row in the pack, the tile's first row within the
document, the document's length). For each of its rows a program computes

    out[i] = sum_j softmax_j(scale * q[i] . k[j]) v[j]   over the keys j <= i of its document

with an online (streaming) softmax over key blocks of BN rows: a running row max m and sum l
in float32, each block's scores exponentiated with exp2 (scale * log2(e) folded into one
multiply), the accumulator rescaled when the max grows, p rounded to the inputs' dtype for
the p @ v product, float32 accumulation throughout, and one division at the end.

The causal mask costs only where it is needed. A tile starting at row r0 of its document
sees keys [0, r0 + BM) at most; keys [0, r0) lie before every one of its rows (BM is a
multiple of BN), so that loop loads and multiplies without any mask. Only the BM / BN key
blocks on the diagonal, [r0, min(r0 + BM, length)), are masked (key <= query, key inside the
document); keys past the diagonal are never visited. Rows past the document's end (the last
tile's padding) read zeros, compute harmlessly and are not stored.

Schedule: a 1-D grid of n_tiles x heads programs. `plan` sorts the tiles by cost (the keys
their last row sees), most expensive first, so the long tiles start early and the short
ones fill the tail (longest-processing-time-first). Programs are taken in groups of
`head_group` heads: a group runs all its tiles (in that order, its heads side by side for
each tile) before the next group starts. The programs in flight at any time then read the
keys and values of few heads, which L2 keeps (a pack of 16384 rows is 10.5 MB of k and v per
head at 192 + 128 dims, against 50 MB of L2 on an H100), so each key block comes from HBM
about once however many query tiles of its document read it; with heads innermost instead,
a wave would touch every head's keys once and reuse none of them.

Offsets of rows are computed in int64 (rows x heads x head size can pass 2**31).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from consumer.kernels.launch import Shaped, launch

LOG2_E = 1.4426950408889634
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MIN_DOT = 16  # the smallest dot dimension compiled Triton takes for 16-bit operands


@dataclass(frozen=True)
class Config:
    """A launch's shape: BM query rows per program (the tile `plan` cuts documents into),
    BN key rows per step (BM a multiple of BN, both powers of two), the warps per program,
    the software-pipelining depth of the key loops, and how many heads a group of programs
    runs side by side (see the module doc)."""

    block_m: int = 128
    block_n: int = 64
    warps: int = 8
    stages: int = 2
    head_group: int = 1


# The default for Hopper (H100/H200) at DeepSeek-V3's 128 heads of 192/128 dims, chosen by
# `bench/mla_attention.py --sweep` on an H100 (packs of 16k rows, documents of 512-4096
# tokens): 436 useful TFLOP/s, 1.80x the varlen flash call with v padded; 4 stages 423, 2
# stages 328, 64 x 64 tiles with 4 warps 398, 128 x 128 blocks with 2 stages 392 (more stages
# do not fit in shared memory; docs/benchmarks.md, MoE run 7). Per program: a q tile
# of 48 KB (bf16), each pipelined key step 24 KB of k and 16 KB of v; two 64-row warpgroups
# share the 128-row tile.
HOPPER_CONFIG = Config(block_m=128, block_n=64, warps=8, stages=3, head_group=1)
# float32 inputs (tests): exact IEEE dots, far more registers and shared memory per element
FP32_CONFIG = Config(block_m=64, block_n=32, warps=4, stages=1, head_group=1)


def split_qk_dim(d_qk: int) -> tuple[int, int]:
    """(D1, D2): the q/k head size as one power-of-two dot (D2 = 0) or two, D1 the largest
    power of two <= d_qk and D2 = d_qk - D1 a power of two (192 -> 128 + 64). ValueError for
    any other size (e.g. 160 = 128 + 32 is fine, 224 = 128 + 96 is not)."""
    if d_qk < 1:
        raise ValueError(f"q/k head size {d_qk}: must be positive")
    d1 = 1 << (d_qk.bit_length() - 1)
    d2 = d_qk - d1
    if d2 & (d2 - 1):
        raise ValueError(
            f"q/k head size {d_qk} is not a power of two or the sum of two ({d1} + {d2}): "
            "mla_attention splits q.k into at most two power-of-two dots"
        )
    return d1, d2


def plan(lengths: list[int], block_m: int | None = None) -> torch.Tensor:
    """The query tiles of a pack of documents of these `lengths` (in pack order), as a CPU
    int32 tensor [n_tiles, 3] of (the document's first row in the pack, the tile's first row
    within the document, the document's length): one row per `block_m` query rows of each
    document, the last one partial. Sorted most expensive first (by the number of keys the
    tile's last row sees; ties in pack order), for load balance. Empty documents contribute
    nothing. Built once per pack on the host and moved to the device with the batch;
    `block_m` must be the launch's `Config.block_m` (default HOPPER_CONFIG's)."""
    block_m = HOPPER_CONFIG.block_m if block_m is None else block_m
    if block_m < 1:
        raise ValueError(f"block_m {block_m}: must be positive")
    rows: list[tuple[int, int, int]] = []
    start = 0
    for n in lengths:
        if n < 0:
            raise ValueError(f"document length {n}: must be >= 0")
        rows.extend((start, m, n) for m in range(0, n, block_m))
        start += n
    if start >= 2**31:
        raise ValueError(f"{start} rows in a pack: the tiles hold int32 row numbers")
    rows.sort(key=lambda r: -(r[1] + min(block_m, r[2] - r[1])))  # stable: ties in order
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 3)


@triton.jit
def _attend(
    acc,
    l_i,
    m_i,
    q1,
    q2,
    k_base,
    v_base,
    start,
    stop,
    rows,
    doc_len,
    stride_kt,
    stride_vt,
    qk_scale,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BN: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program's key blocks [start, stop) in steps of BN, folded into (acc, l_i, m_i).
    MASKED: the diagonal blocks (keys past the document's end not loaded, key <= query);
    else blocks that lie wholly before every query row and inside the document."""
    n = tl.arange(0, BN)
    keys = start + n
    k1_ptrs = k_base + keys[:, None].to(tl.int64) * stride_kt + tl.arange(0, D1)[None, :]
    if D2 > 0:
        k2_ptrs = k_base + keys[:, None].to(tl.int64) * stride_kt + D1 + tl.arange(0, D2)[None, :]
    v_ptrs = v_base + keys[:, None].to(tl.int64) * stride_vt + tl.arange(0, DV)[None, :]
    for first in range(start, stop, BN):
        if MASKED:
            inside = (first + n)[:, None] < doc_len
            k1 = tl.load(k1_ptrs, mask=inside, other=0.0)
            s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
            if D2 > 0:
                k2 = tl.load(k2_ptrs, mask=inside, other=0.0)
                s = tl.dot(q2, tl.trans(k2), s, input_precision=PRECISION)
            v = tl.load(v_ptrs, mask=inside, other=0.0)
            # every row sees key `start` (<= all its rows): m stays finite, no 0 * inf
            s = tl.where((first + n)[None, :] <= rows[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            k1 = tl.load(k1_ptrs)
            s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
            if D2 > 0:
                k2 = tl.load(k2_ptrs)
                s = tl.dot(q2, tl.trans(k2), s, input_precision=PRECISION)
            v = tl.load(v_ptrs)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
        k1_ptrs += BN * stride_kt
        if D2 > 0:
            k2_ptrs += BN * stride_kt
        v_ptrs += BN * stride_vt
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["n_tiles"])  # it follows the pack's documents
def _mla_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    tiles_ptr,
    n_tiles,
    heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # head-blocked order: a group of HEAD_GROUP heads takes all tiles, its heads innermost
    pid = tl.program_id(0)
    first_h = (pid // (HEAD_GROUP * n_tiles)) * HEAD_GROUP
    size_h = tl.minimum(heads - first_h, HEAD_GROUP)
    local = pid - first_h * n_tiles
    tile = local // size_h
    h = (first_h + local % size_h).to(tl.int64)

    doc_start = tl.load(tiles_ptr + tile * 3).to(tl.int64)
    m_start = tl.load(tiles_ptr + tile * 3 + 1)
    doc_len = tl.load(tiles_ptr + tile * 3 + 2)

    rows = m_start + tl.arange(0, BM)  # within the document
    live = rows < doc_len
    q_rows = q_ptr + (doc_start + rows.to(tl.int64))[:, None] * stride_qt + h * stride_qh
    q1 = tl.load(q_rows + tl.arange(0, D1)[None, :], mask=live[:, None], other=0.0)
    if D2 > 0:
        q2 = tl.load(q_rows + D1 + tl.arange(0, D2)[None, :], mask=live[:, None], other=0.0)
    else:
        q2 = q1  # unused
    k_base = k_ptr + doc_start * stride_kt + h * stride_kh
    v_base = v_ptr + doc_start * stride_vt + h * stride_vh

    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, DV), dtype=tl.float32)
    # keys before the tile: no mask; then the diagonal blocks, masked; nothing after
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q1, q2, k_base, v_base, 0, m_start, rows, doc_len,
        stride_kt, stride_vt, qk_scale, D1, D2, DV, BN, False, PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q1, q2, k_base, v_base, m_start, tl.minimum(m_start + BM, doc_len),
        rows, doc_len, stride_kt, stride_vt, qk_scale, D1, D2, DV, BN, True, PRECISION,
    )  # fmt: skip

    out = acc / l_i[:, None]
    o_rows = o_ptr + (doc_start + rows.to(tl.int64))[:, None] * stride_ot + h * stride_oh
    tl.store(o_rows + tl.arange(0, DV)[None, :], out.to(o_ptr.dtype.element_ty), mask=live[:, None])


def _check_dims(d_qk: int, d_v: int, config: Config, *, gpu: bool) -> tuple[int, int]:
    """(D1, D2) of the q/k head size, after checking the head sizes and `config` (ValueError)."""
    d1, d2 = split_qk_dim(d_qk)
    if d_v < 1 or d_v & (d_v - 1):
        raise ValueError(f"v head size {d_v}: must be a power of two")
    bm, bn = config.block_m, config.block_n
    if bm < 1 or bn < 1 or bm & (bm - 1) or bn & (bn - 1) or bn > bm or config.head_group < 1:
        raise ValueError(f"{config}: block_m and block_n powers of two, block_n <= block_m")
    if gpu and min(d1, d2 or d1, d_v, bm, bn) < _MIN_DOT:
        raise ValueError(
            f"head sizes {d1} + {d2} / {d_v} and blocks {bm} x {bn}: each dot dimension must "
            f"be at least {_MIN_DOT} on a GPU"
        )
    return d1, d2


def supports(d_qk: int, d_v: int, dtype: torch.dtype) -> bool:
    """Whether the compiled kernel takes these head sizes and dtype at HOPPER_CONFIG (16-bit
    only: float32 is for the interpreted tests)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        _check_dims(d_qk, d_v, HOPPER_CONFIG, gpu=True)
    except ValueError:
        return False
    return True


def _check_tensors(q, k, v, out, tiles) -> None:
    """What the kernel assumes of its operands (ValueError)."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q and k "
            "[rows, heads, d_qk] and v [rows, heads, d_v]"
        )
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: one of {_DTYPES} for all")
    if out.shape != v.shape or out.dtype != q.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: expected {tuple(v.shape)} {q.dtype}")
    if any(t.stride(-1) != 1 for t in (q, k, v, out)):
        raise ValueError("q, k, v and out need a contiguous last dim (rows, heads: any stride)")
    if tiles.dtype != torch.int32 or tiles.dim() != 2 or tuple(tiles.stride()) != (3, 1):
        raise ValueError(f"tiles: expected plan(...)'s contiguous int32 [n, 3], got {tiles}")
    if any(t.device != q.device for t in (k, v, out, tiles)):
        raise ValueError(f"q, k, v, out and tiles on several devices (q on {q.device})")


def _launch(q, k, v, out, tiles, *, scale, config: Config, d1, d2, compile_only=False) -> None:
    n_tiles, heads = tiles.shape[0], q.shape[1]
    launch(
        _mla_attention_kernel,
        (n_tiles * heads,),
        q,
        k,
        v,
        out,
        tiles,
        n_tiles,
        heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        scale * LOG2_E,
        D1=d1,
        D2=d2,
        DV=v.shape[-1],
        BM=config.block_m,
        BN=config.block_n,
        HEAD_GROUP=config.head_group,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # (16-bit: not used)
        num_warps=config.warps,
        num_stages=config.stages,
        compile_only=compile_only,
    )


def mla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tiles: torch.Tensor,
    *,
    scale: float,
    config: Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each document of a pack: out [T, H, d_v] in q's dtype, row i
    of a document the softmax(scale * q_i . k_j)-weighted sum of v_j over the document's
    keys j <= i.

    q and k [T, H, d_qk], v [T, H, d_v], all bf16, fp16 or float32 (float32: exact IEEE dots,
    for tests; slow), on one device; the last dim contiguous, rows and heads at any stride.
    d_qk a power of two or the sum of two (192 = 128 + 64), d_v a power of two (ValueError
    otherwise; on a GPU every part at least 16). `tiles`: `plan(lengths, config.block_m)` on
    q's device, its documents' rows covering q's in pack order; rows no tile covers are not
    written. `scale` > 0 (usually d_qk ** -0.5, times YaRN's mscale squared for DeepSeek).
    `config`: default HOPPER_CONFIG (FP32_CONFIG for float32). `out`: where to write (shape
    and dtype as above, last dim contiguous), else a new tensor."""
    if config is None:
        config = FP32_CONFIG if q.dtype == torch.float32 else HOPPER_CONFIG
    if out is None:
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    _check_tensors(q, k, v, out, tiles)
    d1, d2 = _check_dims(q.shape[-1], v.shape[-1], config, gpu=q.is_cuda)
    if not scale > 0:
        raise ValueError(f"scale {scale}: must be positive")
    if tiles.shape[0] and q.shape[1]:
        _launch(q, k, v, out, tiles, scale=scale, config=config, d1=d1, d2=d2)
    return out


def precompile(
    *,
    heads: int,
    qk_dim: int,
    v_dim: int,
    dtype: torch.dtype,
    config: Config | None = None,
) -> None:
    """Compile, without launching, the variant `mla_attention` launches for `heads` heads of
    q/k size `qk_dim` and v size `v_dim` in `dtype`, with `config` (default as
    `mla_attention`'s), q, k, v and out contiguous [T, H, d] (consumer/serve/precompile.py's
    way; a view of v padded to qk_dim, as the varlen path holds it, has strides of the same
    kind and meets the same variant)."""
    config = config or (FP32_CONFIG if dtype == torch.float32 else HOPPER_CONFIG)
    d1, d2 = _check_dims(qk_dim, v_dim, config, gpu=True)
    q = Shaped(dtype, (1, heads, qk_dim))
    v = Shaped(dtype, (1, heads, v_dim))
    tiles = Shaped(torch.int32, (1, 3))
    _launch(q, q, v, v, tiles, scale=qk_dim**-0.5, config=config, d1=d1, d2=d2,
            compile_only=True)  # fmt: skip
