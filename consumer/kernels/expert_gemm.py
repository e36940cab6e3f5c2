"""A mixture-of-experts layer's expert FFNs as two grouped GEMMs in Triton, fused with the
steps around them (CUDA; Triton's CPU interpreter runs them for the tests).

`consumer/forward/moe_gemm.py` computes, for rows sorted by expert (`counts[e]` rows of local
expert e, in order):

    h[i]       = silu(x[rows[i]] @ gate_e^T) * (x[rows[i]] @ up_e^T)          (first GEMM)
    out[dst[i]] = weight[dst[i]] * (h[i] @ down_e^T)                          (second GEMM)

Unfused, that is a gather of the tokens' rows (top-k copies of the activations), a GEMM that
writes [rows, 2f], a SwiGLU pass, a second GEMM, a multiply by the routing weights and a
scatter back to [token, choice] order: four extra passes over k times the activations. Here
the first GEMM reads the token rows through `rows` and applies SwiGLU to its two
accumulators before it stores; the second multiplies by the routing weight and stores each
row at `dst`. Numerics are the unfused path's: each GEMM's result is rounded to the
activations' dtype before SwiGLU or the weight multiply, as the separate kernels would.

FP8 (block-quantized checkpoints: e4m3 weights with one float32 scale per 128 x 128 block):
the activations come quantized per token and 128-channel group, each 128-deep step of the
product is scaled by its activation and weight scales, and the first GEMM quantizes its
SwiGLU output the same way (per row and 128 columns) for the second.

Scheduling without a host sync: every expert's rows are cut into tiles of BM rows; a program
finds its expert from the running tile count (`schedule`'s table, cumulative sums on the
device) and exits when it lies past the last tile. The grid is sized for the worst case,
cdiv(R, BM) + E row tiles. With a tail launch, each expert's last part of at most BM' < BM
rows runs in a second launch of BM'-row tiles, which pads fewer rows. Programs are ordered
in groups of GROUP_M row tiles (consecutive experts) that sweep all column tiles together,
so an expert's weights are read from HBM about once.

`Tiles.tma`: the weights (every expert's rows as one matrix) and the second GEMM's sorted
rows are read through tensor descriptors (Hopper's TMA unit) instead of pointer loads; the
first GEMM's gathered rows always take pointer loads (Hopper's TMA does not gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import triton
import triton.language as tl

from consumer.kernels.launch import Shaped, launch

FP8_MAX = 448.0
QUANT_GROUP = 128  # FP8: channels per activation scale, rows and columns per weight block
_TINY = 1e-12
_ROUND = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True)
class Tiles:
    """A launch's tile shape: BM rows, BN columns (per half for the gate/up GEMM), BK deep."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    group_m: int = 8
    warps: int = 8
    stages: int = 3
    tma: bool = False  # the weights (and the second GEMM's rows) through Hopper's TMA unit


# Chosen by `bench/gpu_moe.py --gemm-only --sweep` on an H200 at DeepSeek-V3's expert shape
# (docs/benchmarks.md): 444 TFLOP/s in bf16. Since 2026-12-06 the bf16 gate/up GEMM reads its
# weights through TMA with 4 stages: both GEMMs 2.2-3.4 % faster than by pointer with 3
# stages, three sweeps on one H200 (`--sweep --tma-only`). FP8 (BK = 128, one scale block):
# 64 rows, 4 warps and 2 stages (80 KiB of shared memory, so two programs share an SM and one
# scales its partial products while the other multiplies), down through TMA: both GEMMs 537-542
# TFLOP/s on an H100 (2026-12-07), against 460 with 4 stages by pointer and 459-464 for bf16.
BF16_TILES = Tiles(bm=128, bn=128, bk=64, warps=8, stages=4, tma=True)
FP8_TILES = Tiles(bm=64, bn=128, bk=128, warps=4, stages=2)
# The second GEMM (no SwiGLU: one accumulator, so wider tiles fit) has its own; `--sweep`
# times each GEMM's candidates with the other GEMM at its default. On an H100 at DeepSeek-V3's
# shape 128 x 256 tiles with 4 stages for the second GEMM took both GEMMs from 429 to 465
# TFLOP/s (256 x 128: 413; 128 x 128 with 4 stages: 423).
BF16_DOWN_TILES = Tiles(bm=128, bn=256, bk=64, warps=8, stages=4)
FP8_DOWN_TILES = Tiles(bm=64, bn=128, bk=128, warps=4, stages=4, tma=True)
# Each expert's last part of at most this many rows in a launch of its own (`schedule`), or
# None: every row in the tiles above. Off: 64-row tails for either bf16 GEMM gained nothing on
# an H100 at DeepSeek-V3's shape (24.3-24.8 ms against 24.2, 2026-12-07).
BF16_TAIL_TILES: Tiles | None = None
BF16_DOWN_TAIL_TILES: Tiles | None = None
FP8_TAIL_TILES: Tiles | None = None
FP8_DOWN_TAIL_TILES: Tiles | None = None


@triton.jit
def _operand(ptrs, desc, row, step, left, depth, BK: tl.constexpr, TMA: tl.constexpr,
             EVEN_K: tl.constexpr, RIGHT: tl.constexpr):  # fmt: skip
    """One BK-deep step of a GEMM operand: through its tensor descriptor from `row` (TMA; past
    the depth reads zeros), else through its pointers, masked past the depth unless EVEN_K.
    RIGHT: the [BK, N] layout of tl.dot's right operand (stored [N, K])."""
    if TMA:
        tile = desc.load([row, step * BK])
        if RIGHT:
            tile = tile.T
    elif EVEN_K:
        tile = tl.load(ptrs)
    elif RIGHT:
        tile = tl.load(ptrs, mask=depth[:, None] < left, other=0.0)
    else:
        tile = tl.load(ptrs, mask=depth[None, :] < left, other=0.0)
    return tile


@triton.jit
def _block(offset, first_col, cols, BK: tl.constexpr, TILE_SCALE: tl.constexpr):
    """The weight-scale block row of the tile's columns from `offset` (the up half's rows):
    one for the tile (TILE_SCALE: its columns lie in one block) or one a column."""
    return (offset + first_col) // BK if TILE_SCALE else (offset + cols) // BK


@triton.jit
def _scaled(product, a_s, b_s, TILE_SCALE: tl.constexpr):
    """An FP8 step's partial product [BM, BN] times its activation scales [BM] and weight
    scales: one for the tile (TILE_SCALE: one multiply an element, the scales' product taken
    per row first) or one a column [BN]."""
    return product * (a_s * b_s)[:, None] if TILE_SCALE else product * a_s[:, None] * b_s[None, :]


@triton.jit(do_not_specialize=["max_m_tiles", "n_rows_a", "n_rows_b"])  # row counts: one variant
def _expert_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    a_rows_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    c_scale_ptr,
    c_rows_ptr,
    weight_ptr,
    table_ptr,
    n_out,
    k,
    max_m_tiles,
    n_rows_a,
    n_rows_b,
    stride_am,
    stride_as_m,
    stride_as_k,
    stride_be,
    stride_bn,
    stride_bs_e,
    stride_bs_n,
    stride_bs_k,
    stride_cm,
    stride_cs_m,
    stride_cs_k,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    SCATTER: tl.constexpr,
    FP8: tl.constexpr,
    TILE_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    TMA_A: tl.constexpr,
    TMA_B: tl.constexpr,
    ROUND: tl.constexpr,
    fp8_max: tl.constexpr,
    tiny: tl.constexpr,
):
    # grouped order: GROUP_M row tiles sweep every column tile together
    pid = tl.program_id(0)
    n_tiles_n = tl.cdiv(n_out, BN)
    per_group = GROUP_M * n_tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(max_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    # the expert of this row tile: how many experts' tiles end at or before it (`schedule`'s
    # table: each expert's first row, end row and running tile count, E of each)
    experts = tl.arange(0, E_POW2)
    ends = tl.load(table_ptr + 2 * E + experts, mask=experts < E, other=2147483647)
    e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
    if e >= E:
        return
    tiles_before = tl.load(table_ptr + 2 * E + e - 1, mask=e > 0, other=0)
    row_lo = tl.load(table_ptr + e) + (pid_m - tiles_before) * BM
    row_hi = tl.load(table_ptr + E + e)

    rows = row_lo + tl.arange(0, BM)
    live = rows < row_hi
    if GATHER:
        src = tl.load(a_rows_ptr + rows, mask=live, other=0).to(tl.int64)
    else:
        src = tl.where(live, rows, 0).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    cols_in = cols < n_out
    b_cols = tl.where(cols_in, cols, 0).to(tl.int64)  # in range, so the loads need no mask
    depth = tl.arange(0, BK)
    e64 = e.to(tl.int64)

    a_ptrs = a_ptr + src[:, None] * stride_am + depth[None, :]
    b_ptrs = b_ptr + e64 * stride_be + b_cols[None, :] * stride_bn + depth[:, None]
    a_desc = a_ptr  # (unused unless TMA_A)
    b_desc = b_ptr
    b_row = 0
    if TMA_A:  # sorted rows, read as one block (rows past the expert's are loaded, not stored)
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[n_rows_a, k], strides=[stride_am, 1], block_shape=[BM, BK]
        )
    if TMA_B:  # every expert's rows as one [E * n_rows_b, k] matrix; past k reads zeros
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[E * n_rows_b, k], strides=[stride_bn, 1], block_shape=[BN, BK]
        )
        b_row = e * n_rows_b + pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)  # SWIGLU: the up half's columns
    up_offset = n_out * stride_bn
    if FP8:
        as_ptrs = a_scale_ptr + src * stride_as_m
        bs_expert = b_scale_ptr + e64 * stride_bs_e
        bs_ptrs = bs_expert + _block(0, pid_n * BN, b_cols, BK, TILE_SCALE) * stride_bs_n
        bs_up_ptrs = bs_expert + _block(n_out, pid_n * BN, b_cols, BK, TILE_SCALE) * stride_bs_n
    for step in range(0, tl.cdiv(k, BK)):
        left = k - step * BK
        a = _operand(a_ptrs, a_desc, row_lo, step, left, depth, BK, TMA_A, EVEN_K, False)
        b = _operand(b_ptrs, b_desc, b_row, step, left, depth, BK, TMA_B, EVEN_K, True)
        if FP8:
            a_s = tl.load(as_ptrs + step * stride_as_k)
            acc += _scaled(tl.dot(a, b), a_s, tl.load(bs_ptrs + step * stride_bs_k), TILE_SCALE)
        else:
            acc = tl.dot(a, b, acc)
        if SWIGLU:
            b_up = _operand(
                b_ptrs + up_offset, b_desc, b_row + n_out, step, left, depth, BK, TMA_B, EVEN_K,
                True,
            )  # fmt: skip
            if FP8:
                b_s_up = tl.load(bs_up_ptrs + step * stride_bs_k)
                acc_up += _scaled(tl.dot(a, b_up), a_s, b_s_up, TILE_SCALE)
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BK
        b_ptrs += BK

    out_ty = c_ptr.dtype.element_ty
    if SWIGLU:
        # each product rounded to the activations' dtype first, as the unfused GEMM stores it
        # (FP8: to bf16, the dtype of FP8 checkpoints' activations, then quantized below)
        gate = acc.to(ROUND).to(tl.float32)
        up = acc_up.to(ROUND).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    else:
        y = acc
    dst = rows.to(tl.int64)
    if SCATTER:
        dst = tl.load(c_rows_ptr + rows, mask=live, other=0).to(tl.int64)
        w = tl.load(weight_ptr + dst, mask=live, other=0.0).to(tl.float32)
        y = y.to(out_ty).to(tl.float32) * w[:, None]
    keep = live[:, None] & cols_in[None, :]
    c_ptrs = c_ptr + dst[:, None] * stride_cm + cols[None, :]
    if FP8 and SWIGLU:  # quantize h per row and BN (= 128) columns for the second GEMM
        y = y.to(ROUND).to(tl.float32)
        y = tl.where(cols_in[None, :], y, 0.0)
        scale = tl.maximum(tl.max(tl.abs(y), axis=1), tiny) / fp8_max
        tl.store(c_ptrs, tl.math.div_rn(y, scale[:, None]).to(out_ty), mask=keep)
        tl.store(c_scale_ptr + dst * stride_cs_m + pid_n * stride_cs_k, scale, mask=live)
    else:
        tl.store(c_ptrs, y.to(out_ty), mask=keep)


def _tma_ready(t: Any) -> bool:
    """Whether TMA can read `t` ([rows, K] or [E, rows, K], K contiguous) as one 2-D matrix:
    rows in one run of memory and their stride, like the address, a multiple of 16 bytes."""
    size = t.dtype.itemsize
    stride = t.stride()
    flat = len(stride) == 2 or stride[0] == t.shape[-2] * stride[1]
    return flat and stride[-1] == 1 and (stride[-2] * size) % 16 == 0 and t.data_ptr() % 16 == 0


@cache
def _tma_unit() -> bool:
    """Whether this machine's GPU has a TMA unit (Hopper on; measured there only). Triton's
    CPU interpreter emulates the descriptors, so the tests run both ways without a GPU."""
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability()[0] >= 9


def _workspace(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the tensor descriptors a TMA launch builds on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@dataclass(frozen=True)
class Launch:
    """One launch of a GEMM over the sorted rows: its tiles, `table` int32 [3 E] (each
    expert's first row, the row its tiles end at, and the running count of its tiles: the
    kernel finds a program's expert there) and `max_m_tiles`, a bound on the row tiles known
    without a host sync (the grid)."""

    tiles: Tiles
    table: Any
    max_m_tiles: int


def schedule(
    counts: torch.Tensor, rows: int, tiles: Tiles, tail: Tiles | None = None
) -> list[Launch]:
    """The launches of a GEMM over `rows` rows sorted by expert, `counts` [E] of each: one on
    `tiles`, or with `tail` (fewer rows a tile) two: each expert's rows in `tiles`' tiles but
    a last part of at most `tail.bm` rows, which goes in one `tail` tile (at BM = 128 and 512
    rows an expert, the padding falls from about 11 % to 6 %). Nothing is read back."""
    counts = counts.to(torch.int32)
    experts = counts.numel()
    first = torch.zeros(experts, dtype=torch.int32, device=counts.device)
    torch.cumsum(counts[:-1], 0, out=first[1:])
    bm = tiles.bm
    if tail is None:
        n = torch.div(counts + (bm - 1), bm, rounding_mode="floor")
        table = torch.cat((first, first + counts, torch.cumsum(n, 0, dtype=torch.int32)))
        return [Launch(tiles, table, triton.cdiv(rows, bm) + experts)]
    if not 0 < tail.bm < bm:
        raise ValueError(f"a tail launch takes fewer rows a tile than {bm}, not {tail.bm}")
    full = torch.div(counts, bm, rounding_mode="floor")
    left = counts - full * bm
    main = full + (left > tail.bm).to(torch.int32)
    in_tail = ((left > 0) & (left <= tail.bm)).to(torch.int32)
    main_end = first + torch.minimum(counts, main * bm)
    return [
        Launch(tiles, torch.cat((first, main_end, torch.cumsum(main, 0, dtype=torch.int32))),
               triton.cdiv(rows, bm) + experts),
        Launch(tail, torch.cat((first + full * bm, first + counts,
                                torch.cumsum(in_tail, 0, dtype=torch.int32))), experts),
    ]  # fmt: skip


def _launch(
    a,
    a_scale,
    a_rows,
    b,
    b_scale,
    c,
    c_scale,
    c_rows,
    weight,
    plan: Launch,
    *,
    n_out: int,
    k: int,
    swiglu: bool,
    act_dtype: torch.dtype,
    compile_only: bool = False,
) -> None:
    experts = b.shape[0]
    fp8 = a_scale is not None
    tiles, max_m_tiles = plan.tiles, plan.max_m_tiles
    if fp8 and (tiles.bk != QUANT_GROUP or (swiglu and tiles.bn != QUANT_GROUP)):
        raise ValueError(f"FP8 expert GEMMs take BK (and BN for gate/up) = {QUANT_GROUP}")
    grid = (max_m_tiles * triton.cdiv(n_out, tiles.bn),)
    tma = tiles.tma and _tma_unit()
    tma_b = tma and _tma_ready(b)
    tma_a = tma and a_rows is None and _tma_ready(a)
    if tma_a or tma_b:
        triton.set_allocator(_workspace)  # the descriptors' global scratch (a context variable)
    dummy_i = plan.table
    args = (
        a,
        a_scale if fp8 else a,
        a_rows if a_rows is not None else dummy_i,
        b,
        b_scale if fp8 else b,
        c,
        c_scale if c_scale is not None else c,
        c_rows if c_rows is not None else dummy_i,
        weight if weight is not None else c,
        plan.table,
        n_out,
        k,
        max_m_tiles,
        a.shape[0],
        b.shape[1],
        a.stride(0),
        *(a_scale.stride() if fp8 else (0, 0)),
        b.stride(0),
        b.stride(1),
        *(b_scale.stride() if fp8 else (0, 0, 0)),
        c.stride(0),
        *(c_scale.stride() if c_scale is not None else (0, 0)),
    )
    launch(
        _expert_gemm_kernel,
        grid,
        *args,
        E=experts,
        E_POW2=triton.next_power_of_2(experts),
        BM=tiles.bm,
        BN=tiles.bn,
        BK=tiles.bk,
        GROUP_M=tiles.group_m,
        GATHER=a_rows is not None,
        SWIGLU=swiglu,
        SCATTER=c_rows is not None,
        FP8=fp8,
        # FP8: BN divides the weights' 128-wide blocks and the up half starts on a block
        TILE_SCALE=fp8 and QUANT_GROUP % tiles.bn == 0 and n_out % QUANT_GROUP == 0,
        EVEN_K=k % tiles.bk == 0,
        TMA_A=tma_a,
        TMA_B=tma_b,
        ROUND=_ROUND[act_dtype],
        fp8_max=FP8_MAX,
        tiny=_TINY,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
        compile_only=compile_only,
    )


def gate_up(
    x: torch.Tensor,
    rows: torch.Tensor,
    fc1: torch.Tensor,
    counts: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    fc1_scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    tiles: Tiles | None = None,
    tail: Tiles | None | str = "default",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [R, f] = silu(x[rows] @ gate^T) * (x[rows] @ up^T) per expert, for rows sorted by
    expert (`counts` [E] of each), fc1 [E, 2f, K] = [gate; up] rows. FP8 (`x_scale` [T,
    K/128], `fc1_scale` [E, 2f/128, K/128]): h comes back as float8_e4m3fn with its scales
    [R, f/128]; else h is in x's dtype and the scale None. `dtype`: the activations' dtype
    the products are rounded to (default x's; FP8: bf16). `tiles`, `tail`: `schedule`'s
    (defaults: the module's constants for the dtype; tail None: one launch)."""
    r, (two_f, k) = rows.shape[0], fc1.shape[1:]
    f = two_f // 2
    fp8 = x_scale is not None
    dtype = dtype or (torch.bfloat16 if fp8 else x.dtype)
    tiles = tiles or (FP8_TILES if fp8 else BF16_TILES)
    if isinstance(tail, str):  # "default"
        tail = FP8_TAIL_TILES if fp8 else BF16_TAIL_TILES
    if fp8:
        h = torch.empty(r, f, dtype=torch.float8_e4m3fn, device=x.device)
        h_scale = torch.empty(r, triton.cdiv(f, QUANT_GROUP), dtype=torch.float32, device=x.device)
    else:
        h, h_scale = torch.empty(r, f, dtype=x.dtype, device=x.device), None
    for plan in schedule(counts, r, tiles, tail) if r else ():
        _launch(
            x, x_scale, rows, fc1, fc1_scale, h, h_scale, None, None, plan,
            n_out=f, k=k, swiglu=True, act_dtype=dtype,
        )  # fmt: skip
    return h, h_scale


def down(
    h: torch.Tensor,
    fc2: torch.Tensor,
    counts: torch.Tensor,
    dst: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    *,
    h_scale: torch.Tensor | None = None,
    fc2_scale: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    tail: Tiles | None | str = "default",
) -> None:
    """out[dst[i]] = weights[dst[i]] * (h[i] @ down_e^T) for the rows i sorted by expert
    (`counts` [E] of each), fc2 [E, N, f]; rows of `out` no dst names are left as they are.
    `tiles`, `tail`: as `gate_up`'s."""
    r, (n, f) = h.shape[0], fc2.shape[1:]
    fp8 = h_scale is not None
    tiles = tiles or (FP8_DOWN_TILES if fp8 else BF16_DOWN_TILES)
    if isinstance(tail, str):  # "default"
        tail = FP8_DOWN_TAIL_TILES if fp8 else BF16_DOWN_TAIL_TILES
    for plan in schedule(counts, r, tiles, tail) if r else ():
        _launch(
            h, h_scale, None, fc2, fc2_scale, out, None, dst, weights, plan,
            n_out=n, k=f, swiglu=False, act_dtype=out.dtype,
        )  # fmt: skip


def precompile(
    *,
    experts: int,
    hidden: int,
    ffn: int,
    dtype: torch.dtype,
    fp8: bool,
    routing_dtype: torch.dtype,
    gemms: str = "both",
) -> None:
    """Compile, without launching, both GEMMs' variants (`gemms` "both"), or gate/up's alone
    ("gate_up": where quack-kernels' down GEMM serves), for `experts` local experts of FFN
    `ffn` at `hidden`, activations in `dtype`, weights in FP8 (`fp8`) or `dtype`, routing
    weights in `routing_dtype` (consumer/serve/precompile.py)."""
    if gemms not in ("both", "gate_up"):
        raise ValueError(f"gemms must be 'both' or 'gate_up', got {gemms!r}")
    if fp8:
        up_tiles, down_tiles = (FP8_TILES, FP8_TAIL_TILES), (FP8_DOWN_TILES, FP8_DOWN_TAIL_TILES)
    else:
        up_tiles = (BF16_TILES, BF16_TAIL_TILES)
        down_tiles = (BF16_DOWN_TILES, BF16_DOWN_TAIL_TILES)
    act = torch.float8_e4m3fn if fp8 else dtype
    weight_dtype = act
    g = triton.cdiv
    table = Shaped(torch.int32, (3 * experts,))
    rows = Shaped(torch.int64, (1,))
    x = Shaped(act, (1, hidden))
    # the activations' scales come outer-dim-major, [T_pad, G] with strides (1, T_pad)
    x_s = Shaped(torch.float32, (16, g(hidden, QUANT_GROUP)), (1, 16)) if fp8 else None
    w1 = Shaped(weight_dtype, (experts, 2 * ffn, hidden))
    w1_s = Shaped(torch.float32, (experts, g(2 * ffn, 128), g(hidden, 128))) if fp8 else None
    h = Shaped(act, (1, ffn))
    h_s = Shaped(torch.float32, (1, g(ffn, QUANT_GROUP))) if fp8 else None
    w2 = Shaped(weight_dtype, (experts, hidden, ffn))
    w2_s = Shaped(torch.float32, (experts, g(hidden, 128), g(ffn, 128))) if fp8 else None
    out = Shaped(dtype, (1, hidden))
    weights = Shaped(routing_dtype, (1,))
    common: dict[str, Any] = {"act_dtype": dtype, "compile_only": True}
    for tiles in filter(None, up_tiles):
        _launch(x, x_s, rows, w1, w1_s, h, h_s, None, None, Launch(tiles, table, 1 + experts),
                n_out=ffn, k=hidden, swiglu=True, **common)  # fmt: skip
    for tiles in filter(None, down_tiles if gemms == "both" else ()):
        _launch(h, h_s, None, w2, w2_s, out, None, rows, weights,
                Launch(tiles, table, 1 + experts), n_out=hidden, k=ffn, swiglu=False,
                **common)  # fmt: skip
