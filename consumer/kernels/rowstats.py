"""One rank's reduction (head_common.LocalReduction) from its logits, chunk by chunk, in Triton.

The reference path (`tp_ops.local.local_reduce`) materialises z = fp32(logits * inv_temperature)
as an [R, V] tensor and runs a dozen full-size passes over it (max, gather, top-k with a tie
fix, exp, scatter, sums, entropy), plus ~30 per sample. Here each logits chunk is read once
in its own dtype, and a second time only where the top-k can lie; the kernels keep per-row
results, and the PyTorch steps after them run once for all rows.

1. `_row_pass_kernel` streams each row (in a few parts, so the device fills up) in the
   sampling blocks (SAMPLE_BLOCK global ids; `head_common.block_layout`). Per block b
   it takes the max m_b, the mass s_b = sum exp(z - m_b) and, for the entropy,
   u_b = sum exp(z - m_b) * (z - m_b); it folds them into the row's max and sums (rescaled
   as the max grows) and, with top-k, stores them ([R, G] each, G ~ V / 128) along with the
   max over each residue class of the columns modulo the step's width (BLOCKS x 128
   classes, kept elementwise).
   Samples: the definition's block keys need an fp32-exact exp summed in fp64
   (`tp_ops.sampling_exp`), three times the work of the rest of the pass. So each sample
   picks its block by fast keys (the fp32 masses above, the noise's outer log in fp32),
   keeping the two best. A fast key lies within 4e-5 + 4e-7 |key| of the exact one (error
   bounds of the hardware exp and log, of both exps against exp, of fp32 sums of 128 terms
   and of the roundings), so when the best leads by more than twice that (`gumbel.margin`,
   with room to spare) it is the definition's block. Otherwise (a gap that small has a
   probability of about 2e-4 per sample) the program reads its part again for the exact
   keys. Either way the block's exact key and the draw inside it come from one more read of
   that block (`gumbel.draw_in_block`).
2. (top-k) t0, the k-th largest of the class maxima, is at most the k-th largest z
   (k distinct columns reach it), so the top-k lies among the columns >= t0: barely more
   than k of them, as the classes interleave (top ids that cluster in a few blocks still fall
   in distinct classes). Only blocks whose max reaches t0 hold such columns. The candidates
   kernel finds t0 itself (a sort of the class maxima).
3. `_candidates_kernel` reads the blocks' (m_b, s_b, u_b) a tile at a time, lists the blocks
   that reach t0 and reads their columns only: the columns >= t0 go to a small candidate
   buffer through an atomic counter (their order is fixed by step 4), the others add to the
   rest sums, to which every other block adds its (s_b, u_b), rescaled to the row's max.
4. PyTorch on the candidates only: one sort by unique 64-bit order keys (value desc, id asc)
   gives the exact top-k and a deterministic order for the candidates outside it, whose mass
   is added back so the rest mass stays a sum of positive terms as in the reference.

A row with more than `cap` candidates (hundreds of columns tied at t0) is flagged in
`overflow_R` and tp_ops' driver redoes the call on the reference path; a call with k above the
number of classes or the shard's real columns is not taken (local_reduce returns None).
Values agree with the reference to fp32 rounding (sums run in another order, with another
exp); ids (top-k and samples) agree exactly.

Shape legend (suffixes on tensor names):
    T  rows of the call;  R  rows of one chunk
    V  columns of this rank's vocabulary shard
    W  target ids per row;  K  top-k entries per row;  N  samples per row
    G  sampling blocks of the shard;  P  parts a row is streamed in (step 1)
    C  candidate slots per row (`cap`, step 3)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from consumer.head_common import (
    NEG_INF,
    SAMPLE_BLOCK,
    SENTINEL_ID,
    LocalReduction,
    VocabShard,
    block_layout,
    order_key,
)
from consumer.kernels.gumbel import (
    block_noise,
    draw_in_block,
    exact_lse,
    fast_block_noise,
    interpreting,
    load_blocks,
    margin,
)
from consumer.kernels.launch import Shaped, launch


@dataclass
class RowStatsConfig:
    """Launch shape; benchmarks may change the module's `CONFIG`."""

    blocks_per_step: int = 8  # sampling blocks streamed per iteration (power of 2)
    samples_per_program: int = 16  # samples sharing one pass over a row (power of 2)
    cap: int = 256  # candidate slots per row (at least 2 k)
    target_programs: int = 4096  # split rows into parts until about this many programs run
    # Multiplies the margin that lets a fast block choice stand (tests: inf re-reads every
    # part exactly, 0 never does). Below 1 the samples may differ from the definition.
    sample_margin: float = 1.0
    num_warps: int = 4


CONFIG = RowStatsConfig()


# Integers that follow the batch's row count or the request's sample count are not
# specialised (Triton would compile a variant for a value of 1 and for one divisible by 16):
# the variants then follow the compile-time flags alone, which the consumer's warm-up visits
# (consumer/serve/warmup.py), and no first batch of a new size compiles.
@triton.jit(do_not_specialize=["span", "n_samples"])
def _row_pass_kernel(
    logits_ptr,
    stride_r,
    inv_ptr,
    keys_ptr,
    stats_ptr,
    bm_ptr,
    bs_ptr,
    bu_ptr,
    gmax_ptr,
    skey_ptr,
    sid_ptr,
    sz_ptr,
    valid,
    start,
    offset,
    n_blocks,
    span,
    n_samples,
    margin_scale,
    NS: tl.constexpr,
    BLOCKS: tl.constexpr,
    WIDTH: tl.constexpr,
    SAMPLES: tl.constexpr,
    WANT_U: tl.constexpr,
    STORE_BLOCKS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # Program (row, split, p): blocks [split * span, + span) of the row, samples [p * NS, + NS).
    row = tl.program_id(0)
    split = tl.program_id(1)
    part = row * tl.num_programs(1) + split
    # Every sample program of a part computes the same sums and block stats, bit for bit, and
    # stores them: the same values in the same places.
    inv = tl.load(inv_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_r
    bs = tl.arange(0, BLOCKS)
    ws = tl.arange(0, WIDTH)
    if SAMPLES:
        js = tl.program_id(2) * NS + tl.arange(0, NS)
        jm = js < n_samples
        skey = tl.load(keys_ptr + row * n_samples + js, mask=jm, other=0)
        best = tl.full([NS], float("-inf"), tl.float32)  # best fast key
        second = tl.full([NS], float("-inf"), tl.float32)  # the next best
        best_block = tl.zeros([NS], tl.int32)  # block 0 stands when every key is -inf

    m_row = tl.full([], float("-inf"), tl.float32)
    if STORE_BLOCKS:
        gmax = tl.full([BLOCKS, WIDTH], float("-inf"), tl.float32)  # per residue class
    s_row = tl.zeros([], tl.float32)
    u_row = tl.zeros([], tl.float32)
    n_bad = tl.zeros([], tl.int32)
    lo = split * span
    hi = tl.minimum(lo + span, n_blocks)
    for b0 in range(lo, hi, BLOCKS):
        blk = b0 + bs
        _, cm, z = load_blocks(row_ptr, blk, blk < n_blocks, inv, offset, valid, WIDTH)
        # NaN and +inf: the reference's max turns NaN/inf and the merge flags the row; the
        # max here may ignore NaN, so they are counted and the row's max is poisoned.
        n_bad += tl.sum(tl.sum((cm & ~(z < float("inf"))).to(tl.int32), axis=1), axis=0)
        m = tl.max(z, axis=1)
        live = m > float("-inf")
        ref = tl.where(live, m, 0.0)  # sums relative to the block's max, 0 if it has none
        y = z - ref[:, None]
        e = tl.exp(y)
        s = tl.sum(e, axis=1)
        # exp(-inf) * -inf is NaN; such columns add nothing.
        if WANT_U:  # noqa: SIM108 - a constexpr branch: Triton compiles only the side taken
            u = tl.sum(tl.where(e > 0, e * y, 0.0), axis=1)
        else:
            u = tl.zeros_like(s)
        if STORE_BLOCKS:
            at = row * n_blocks + blk
            keep = (blk < n_blocks) & (blk < lo + span)
            tl.store(bm_ptr + at, m, mask=keep)
            tl.store(bs_ptr + at, s, mask=keep)
            tl.store(bu_ptr + at, u, mask=keep)
            gmax = tl.maximum(gmax, z)

        # The row's sums, relative to its running max (0 while there is no finite one).
        m_new = tl.maximum(m_row, tl.max(m, axis=0))
        ref_old = tl.where(m_row > float("-inf"), m_row, 0.0)
        ref_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        # s_row > 0 implies a finite old max <= the new one, so exp never overflows here.
        alpha = tl.where(s_row > 0, tl.exp(ref_old - ref_new), 0.0)
        w = tl.where(live, tl.exp(ref - ref_new), 0.0)
        if WANT_U:
            u_new = tl.sum(w * (u + (ref - ref_new) * s), axis=0)
            u_row = alpha * (u_row + (ref_old - ref_new) * s_row) + u_new
        s_row = alpha * s_row + tl.sum(w * s, axis=0)
        m_row = m_new

        if SAMPLES:
            # Fast keys: the block masses above (fp32, hardware exp and log) plus the noise
            # with its outer log in fp32.
            lse = tl.where(live, ref + tl.log(s), float("-inf"))
            noise = fast_block_noise(skey[:, None], blk[None, :], start, offset, WIDTH, INTERPRET)
            key = lse[None, :] + noise
            key = tl.where((blk < n_blocks)[None, :], key, float("-inf"))  # [NS, BLOCKS]
            step_best = tl.max(key, axis=1)
            step_arg = tl.argmax(key, axis=1, tie_break_left=True)
            step_second = tl.max(tl.where(bs[None, :] == step_arg[:, None], float("-inf"), key), 1)
            # Strictly greater: an equal key in a later block loses.
            better = step_best > best
            second = tl.where(better, tl.maximum(best, step_second), tl.maximum(second, step_best))
            best = tl.where(better, step_best, best)
            best_block = tl.where(better, b0 + step_arg, best_block)

    tl.store(stats_ptr + part * 3, tl.where(n_bad > 0, float("nan"), m_row))
    tl.store(stats_ptr + part * 3 + 1, s_row)
    tl.store(stats_ptr + part * 3 + 2, u_row)
    if STORE_BLOCKS:
        at = part * BLOCKS * WIDTH + bs[:, None] * WIDTH + ws[None, :]
        tl.store(gmax_ptr + at, gmax)
    if SAMPLES:
        # A fast key is within half the margin of the exact one, so a fast winner ahead by
        # more than the margin is the exact winner. Otherwise (rare) this part's blocks are
        # read again for their exact keys.
        close = jm & (best - second <= margin_scale * margin(best))
        if tl.max(close.to(tl.int32), axis=0) > 0:
            best = tl.full([NS], float("-inf"), tl.float32)
            best_block = tl.zeros([NS], tl.int32)
            for b0 in range(lo, hi, BLOCKS):
                blk = b0 + bs
                _, _, z = load_blocks(row_ptr, blk, blk < n_blocks, inv, offset, valid, WIDTH)
                lse = exact_lse(z, INTERPRET)
                noise = block_noise(skey[:, None], blk[None, :], start, offset, WIDTH, INTERPRET)
                key = (lse[None, :] + noise).to(tl.float32)
                key = tl.where((blk < n_blocks)[None, :], key, float("-inf"))
                step_best = tl.max(key, axis=1)
                step_arg = tl.argmax(key, axis=1, tie_break_left=True)
                better = step_best > best
                best = tl.where(better, step_best, best)
                best_block = tl.where(better, b0 + step_arg, best_block)
        key, col, win_z = draw_in_block(
            row_ptr, inv, skey, best_block, jm, valid, start, offset, WIDTH, INTERPRET
        )
        out = part * n_samples + js
        tl.store(skey_ptr + out, tl.where(best > float("-inf"), key, best), mask=jm)
        tl.store(sid_ptr + out, col.to(tl.int64) + start, mask=jm)
        tl.store(sz_ptr + out, win_z, mask=jm)


@triton.jit(do_not_specialize=["parts", "k", "cap"])  # as _row_pass_kernel's
def _candidates_kernel(
    logits_ptr,
    stride_r,
    inv_ptr,
    stats_ptr,
    gmax_ptr,
    bm_ptr,
    bs_ptr,
    bu_ptr,
    sel_ptr,
    cz_ptr,
    cid_ptr,
    count_ptr,
    rest_ptr,
    valid,
    offset,
    n_blocks,
    parts,
    k,
    cap,
    BLOCKS: tl.constexpr,
    WIDTH: tl.constexpr,
    TILE: tl.constexpr,
    WANT_U: tl.constexpr,
):
    row = tl.program_id(0)
    inv = tl.load(inv_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_r
    # Step 2: the row's max over its parts (sums are relative to it, or to 0 if it is not
    # finite) and t0, the k-th largest of the class maxima (max over parts as well: a class
    # is the same columns' residue in every part, so classes stay disjoint).
    m = tl.full([], float("-inf"), tl.float32)
    gmax = tl.full([BLOCKS * WIDTH], float("-inf"), tl.float32)
    xs = tl.arange(0, BLOCKS * WIDTH)
    for p in range(0, parts):
        m = tl.maximum(m, tl.load(stats_ptr + (row * parts + p) * 3))
        gmax = tl.maximum(gmax, tl.load(gmax_ptr + (row * parts + p) * BLOCKS * WIDTH + xs))
    ref = tl.where((m > float("-inf")) & (m < float("inf")), m, 0.0)
    t0 = tl.sum(tl.where(xs == k - 1, tl.sort(gmax, descending=True), 0.0), axis=0)

    # Step 3a, TILE blocks at a time: a block whose max stays below t0 adds its sums from
    # step 1, rescaled to the row's max; the others (a few in a row) are listed in sel.
    s = tl.zeros([], tl.float32)
    u = tl.zeros([], tl.float32)
    n_sel = tl.zeros([], tl.int32)
    ts = tl.arange(0, TILE)
    for b0 in range(0, n_blocks, TILE):
        blk = b0 + ts
        at = row * n_blocks + blk
        inside = blk < n_blocks
        bm = tl.load(bm_ptr + at, mask=inside, other=float("-inf"))
        bsum = tl.load(bs_ptr + at, mask=inside, other=0.0)
        reach = inside & (bm >= t0)
        keep = ~reach & (bsum > 0)
        shift = tl.where(keep, bm - ref, 0.0)
        w = tl.where(keep, tl.exp(shift), 0.0)
        s += tl.sum(w * bsum, axis=0)
        if WANT_U:
            bu = tl.load(bu_ptr + at, mask=inside, other=0.0)
            u += tl.sum(w * (bu + shift * bsum), axis=0)
        slot = n_sel + tl.cumsum(reach.to(tl.int32), axis=0) - 1
        tl.store(sel_ptr + row * n_blocks + slot, blk, mask=reach)
        n_sel += tl.sum(reach.to(tl.int32), axis=0)
    tl.debug_barrier()  # the list is read back by other threads of this program

    # Step 3b: the listed blocks, column by column.
    bs = tl.arange(0, BLOCKS)
    for i0 in range(0, n_sel, BLOCKS):
        i = i0 + bs
        im = i < n_sel
        blk = tl.load(sel_ptr + row * n_blocks + i, mask=im, other=0)
        cols, cm, z = load_blocks(row_ptr, blk, im, inv, offset, valid, WIDTH)
        cand = cm & (z >= t0)
        below = cm & (z < t0)
        y = z - ref
        e = tl.where(below, tl.exp(y), 0.0)
        s += tl.sum(tl.sum(e, axis=1), axis=0)
        if WANT_U:
            ey = tl.where(below & (z > float("-inf")), e * y, 0.0)
            u += tl.sum(tl.sum(ey, axis=1), axis=0)
        # One atomic per candidate on the row's counter, which starts at 0: the old value is
        # the candidate's slot.
        slot = tl.atomic_add(count_ptr + row + cols * 0, 1, mask=cand)
        fits = cand & (slot < cap)
        tl.store(cz_ptr + row * cap + slot, z, mask=fits)
        tl.store(cid_ptr + row * cap + slot, cols, mask=fits)
    tl.store(rest_ptr + row * 2, s)
    tl.store(rest_ptr + row * 2 + 1, u)


def samples_per_program(n: int) -> int:
    """Samples one step-1 program draws for a call with `n` samples (1 without samples): the
    compile-time `NS`, so calls whose counts give the same value share a kernel variant."""
    return min(CONFIG.samples_per_program, triton.next_power_of_2(n)) if n else 1


@dataclass(frozen=True)
class _Layout:
    """How step 1 covers a shard's rows: parts per row, blocks per part, sample programs."""

    offset: int  # head_common.block_layout
    n_blocks: int
    span: int  # blocks per part, whole steps
    parts: int
    ns: int  # samples per program
    per_row: int  # sample programs per part
    classes: int  # residue classes of step 1

    @staticmethod
    def of(start: int, valid: int, chunk_rows: int, n: int) -> _Layout:
        cfg = CONFIG
        offset, n_blocks = block_layout(start, valid)
        ns = samples_per_program(n)
        per_row = triton.cdiv(n, ns) if n else 1
        steps = triton.cdiv(n_blocks, cfg.blocks_per_step)
        want = max(1, min(triton.cdiv(cfg.target_programs, max(chunk_rows * per_row, 1)), steps))
        span = triton.cdiv(steps, want) * cfg.blocks_per_step
        classes = cfg.blocks_per_step * SAMPLE_BLOCK
        return _Layout(offset, n_blocks, span, triton.cdiv(n_blocks, span), ns, per_row, classes)


def _row_pass(
    logits_RV: torch.Tensor,
    inv_R: torch.Tensor,
    keys_RN: torch.Tensor | None,
    lay: _Layout,
    *,
    start: int,
    valid: int,
    want_entropy: bool,
    out: dict[str, torch.Tensor],
    compile_only: bool = False,
) -> None:
    """Step 1 over a chunk's rows into `out`: stats [R, P, 3], samples skey/sid/sz [R, P, N]
    and, with "bm" present, the block stats bm/bs/bu [R, G] and class maxima gmax [R, P, X]."""
    rows = logits_RV.shape[0]
    n = 0 if keys_RN is None else keys_RN.shape[1]
    stats = out["stats"]
    store_blocks = "bm" in out
    blocks = [out[key] if store_blocks else stats for key in ("bm", "bs", "bu", "gmax")]
    samples = [out[key] if n else stats for key in ("skey", "sid", "sz")]
    cfg = CONFIG
    # Kernel arguments one role to a line (tensors, layout, compile-time flags): kept by fmt: skip.
    launch(
        _row_pass_kernel, (rows, lay.parts, lay.per_row),
        logits_RV, logits_RV.stride(0), inv_R,
        stats if keys_RN is None or not n else keys_RN,  # unused tensors: any pointer
        stats, *blocks, *samples,
        valid, start, lay.offset, lay.n_blocks, lay.span, n, cfg.sample_margin,
        NS=lay.ns, BLOCKS=cfg.blocks_per_step, WIDTH=SAMPLE_BLOCK,
        SAMPLES=n > 0, WANT_U=want_entropy, STORE_BLOCKS=store_blocks,
        INTERPRET=interpreting(), num_warps=cfg.num_warps,
        # The samples' arithmetic must round as the reference does (see gumbel).
        enable_fp_fusion=n == 0, compile_only=compile_only,
    )  # fmt: skip


def _candidates(
    logits_RV: torch.Tensor,
    inv_R: torch.Tensor,
    part: dict[str, torch.Tensor],
    sel_RG: torch.Tensor,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    lay: _Layout,
    *,
    valid: int,
    k: int,
    cap: int,
    want_entropy: bool,
    compile_only: bool = False,
) -> None:
    """Step 3 over a chunk's rows: candidates cz/cid, their count and the rest sums `outs`."""
    rows = logits_RV.shape[0]
    # Arguments one role to a line, as the row pass: kept by fmt: skip.
    launch(
        _candidates_kernel, (rows,),
        logits_RV, logits_RV.stride(0), inv_R, part["stats"], part["gmax"],
        part["bm"], part["bs"], part["bu"], sel_RG, *outs,
        valid, lay.offset, lay.n_blocks, lay.parts, k, cap,
        BLOCKS=CONFIG.blocks_per_step, WIDTH=SAMPLE_BLOCK, TILE=1024,
        WANT_U=want_entropy, num_warps=CONFIG.num_warps, compile_only=compile_only,
    )  # fmt: skip


def precompile(
    *, shard: VocabShard, dtype: torch.dtype, n: int, top_k: int, want_entropy: bool
) -> bool:
    """Compile, without launching, the kernels `local_reduce` launches for a call on `shard`
    with `dtype` logits, `n` samples, top-`top_k` and the entropy or not
    (consumer/serve/precompile.py); False for a call `local_reduce` does not take."""
    width, valid = shard.size, shard.valid_size
    k = min(top_k, width)
    lay = _Layout.of(shard.start, valid, 1, n)
    if valid == 0 or valid < k or k > lay.classes:
        return False
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    # Shaped stands in for each tensor: typed Any, as the wrappers' tensors are duck-typed here.
    out: dict[str, Any] = {"stats": Shaped(f32, (1, lay.parts, 3))}
    out |= {
        key: Shaped(f32 if key != "sid" else i64, (1, lay.parts, n))
        for key in ("skey", "sid", "sz")
    }
    if k:
        out |= {key: Shaped(f32, (1, lay.n_blocks)) for key in ("bm", "bs", "bu")}
        out["gmax"] = Shaped(f32, (1, lay.parts, lay.classes))
    logits: Any = Shaped(dtype, (1, width))
    inv: Any = Shaped(f32, (1,))
    keys: Any = Shaped(i64, (1, n)) if n else None
    _row_pass(logits, inv, keys, lay, start=shard.start, valid=valid, want_entropy=want_entropy,
              out=out, compile_only=True)  # fmt: skip
    if k:
        cap = max(CONFIG.cap, 2 * k)
        outs: Any = (
            Shaped(f32, (1, cap)),
            Shaped(i32, (1, cap)),
            Shaped(i32, (1,)),
            Shaped(f32, (1, 2)),
        )
        sel: Any = Shaped(i32, (1, lay.n_blocks))
        _candidates(logits, inv, out, sel, outs, lay, valid=valid,
                    k=k, cap=cap, want_entropy=want_entropy, compile_only=True)  # fmt: skip
    return True


def _merge_parts(
    out: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: stats [R, 3] and the samples (key, id, z) [R, N] from the parts of step 1,
    merged as tensor-parallel shards are: sums rescaled to the row's max, each sample from
    the part with the best key (ties to the lower id, so to the lower block, as defined)."""
    stats_RP3, skey_RPN, sid_RPN, sz_RPN = (out[k] for k in ("stats", "skey", "sid", "sz"))
    if stats_RP3.shape[1] == 1:
        return stats_RP3[:, 0], skey_RPN[:, 0], sid_RPN[:, 0], sz_RPN[:, 0]
    m_RP, s_RP, u_RP = stats_RP3.unbind(dim=2)
    m_R = m_RP.amax(dim=1)  # NaN from a part with NaN or +inf stays
    ref_R = torch.where(torch.isfinite(m_R), m_R, 0.0)
    ref_RP = torch.where(torch.isfinite(m_RP), m_RP, 0.0)
    live_RP = s_RP > 0
    shift_RP = torch.where(live_RP, ref_RP - ref_R[:, None], 0.0)
    w_RP = torch.where(live_RP, torch.exp(shift_RP), 0.0)
    s_R = (w_RP * s_RP).sum(dim=1)
    u_R = (w_RP * (u_RP + shift_RP * s_RP)).sum(dim=1)
    best_R1N = order_key(skey_RPN, sid_RPN).argmax(dim=1, keepdim=True)
    skey_RN, sid_RN, sz_RN = (t.gather(1, best_R1N).squeeze(1) for t in (skey_RPN, sid_RPN, sz_RPN))
    return torch.stack([m_R, s_R, u_R], dim=1), skey_RN, sid_RN, sz_RN


def _step1_buffers(
    rows: int, lay: _Layout, n: int, device: torch.device
) -> dict[str, torch.Tensor]:
    def f32(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=device)

    return {
        "stats": f32(rows, lay.parts, 3),
        "skey": f32(rows, lay.parts, n),
        "sid": torch.empty((rows, lay.parts, n), dtype=torch.int64, device=device),
        "sz": f32(rows, lay.parts, n),
    }


def gumbel_argmax(
    *,
    logits_RV: torch.Tensor,
    inv_temperature_R: torch.Tensor,
    keys_RN: torch.Tensor,
    start: int,
    valid: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (row, sample): the best Gumbel key over the first `valid` columns, its global id
    (`start` + column) and its tempered logit; what `tp_ops.local.local_samples` returns.

    logits_RV: [R, >= valid] float logits; inv_temperature_R: [R]; keys_RN: int64 [R, N]
    stream keys (`tp_ops.stream_keys`). Requires valid >= 1.
    """
    rows, n = keys_RN.shape
    if logits_RV.stride(1) != 1:
        logits_RV = logits_RV.contiguous()
    lay = _Layout.of(start, valid, rows, n)
    out = _step1_buffers(rows, lay, n, logits_RV.device)
    if rows:
        _row_pass(
            logits_RV,
            inv_temperature_R.float().contiguous(),
            keys_RN.contiguous(),
            lay,
            start=start,
            valid=valid,
            want_entropy=False,
            out=out,
        )
    _, skey_RN, sid_RN, sz_RN = _merge_parts(out)
    return skey_RN, sid_RN, sz_RN


def local_reduce(
    *,
    logits_chunk: Callable[[int, int], torch.Tensor],
    rows: int,
    chunk_rows: int,
    shard: VocabShard,
    target_ids_TW: torch.Tensor,
    inv_temperature_T: torch.Tensor,
    keys_TN: torch.Tensor | None,
    top_k: int,
    want_entropy: bool,
) -> LocalReduction | None:
    """This rank's contribution for all `rows`, as `tp_ops.local.local_reduce` computes it for a
    chunk. The logits come in row chunks of `chunk_rows` from `logits_chunk(r0, r1)` (each
    [r1 - r0, shard.size]); the kernels keep per-row results only, so the PyTorch work that
    follows them runs once for all rows.

    Returns None for calls the kernels do not take (a shard with fewer real columns than k
    or none at all, or k above the residue classes of step 1); the caller then uses the
    reference path.
    """
    width, valid = shard.size, shard.valid_size
    k = min(top_k, width)
    n = 0 if keys_TN is None else keys_TN.shape[1]
    lay = _Layout.of(shard.start, valid, min(chunk_rows, rows), n)
    if rows == 0 or valid == 0 or valid < k or k > lay.classes:
        return None
    device = inv_temperature_T.device
    inv_T = inv_temperature_T.float().contiguous()
    keys = None if keys_TN is None or not n else keys_TN.contiguous()
    out = _step1_buffers(rows, lay, n, device)
    w = target_ids_TW.shape[1]
    tz_TW = torch.empty((rows, w), dtype=torch.float32, device=device)
    if k:
        cap = max(CONFIG.cap, 2 * k)
        cz_TC = torch.empty((rows, cap), dtype=torch.float32, device=device)
        cid_TC = torch.empty((rows, cap), dtype=torch.int32, device=device)
        count_T = torch.zeros(rows, dtype=torch.int32, device=device)
        rest_T2 = torch.empty((rows, 2), dtype=torch.float32, device=device)
        step_rows = min(chunk_rows, rows)
        scratch = {
            key: torch.empty(shape, dtype=torch.float32, device=device)
            for key, shape in (
                ("bm", (step_rows, lay.n_blocks)),
                ("bs", (step_rows, lay.n_blocks)),
                ("bu", (step_rows, lay.n_blocks)),
                ("gmax", (step_rows, lay.parts, lay.classes)),
            )
        }
        sel_RG = torch.empty((step_rows, lay.n_blocks), dtype=torch.int32, device=device)

    for r0 in range(0, rows, chunk_rows):
        r1 = min(rows, r0 + chunk_rows)
        logits_RV = logits_chunk(r0, r1)
        if logits_RV.stride(1) != 1:
            logits_RV = logits_RV.contiguous()
        # Targets: the reference gathers from fp32(logits * inv); the same product here.
        local_RW = target_ids_TW[r0:r1] - shard.start
        owned_RW = (local_RW >= 0) & (local_RW < valid)
        tz_RW = logits_RV.gather(1, local_RW.clamp(0, width - 1)).float() * inv_T[r0:r1, None]
        tz_TW[r0:r1] = torch.where(owned_RW, tz_RW, NEG_INF)
        part = {key: t[r0:r1] for key, t in out.items()}
        if k:
            part.update((key, t[: r1 - r0]) for key, t in scratch.items())
        _row_pass(
            logits_RV,
            inv_T[r0:r1],
            None if keys is None else keys[r0:r1],
            lay,
            start=shard.start,
            valid=valid,
            want_entropy=want_entropy,
            out=part,
        )
        if k:
            _candidates(
                logits_RV, inv_T[r0:r1], part, sel_RG,
                (cz_TC[r0:r1], cid_TC[r0:r1], count_T[r0:r1], rest_T2[r0:r1]),
                lay, valid=valid, k=k, cap=cap, want_entropy=want_entropy,
            )  # fmt: skip
        del logits_RV  # before the next chunk's logits exist: one chunk at a time

    stats_T3, skey_TN, sid_TN, sz_TN = _merge_parts(out)
    cand_val_TK = torch.full((rows, top_k), NEG_INF, device=device)
    cand_id_TK = torch.full((rows, top_k), SENTINEL_ID, dtype=torch.int64, device=device)
    overflow_T = torch.zeros(rows, dtype=torch.bool, device=device)
    if k:
        m_T = stats_T3[:, 0]
        s_T = rest_T2[:, 0]
        u_T = rest_T2[:, 1] if want_entropy else torch.zeros_like(s_T)
        val_TK, id_TK, s_T, u_T = _select_topk(
            cz_TC,
            cid_TC,
            count_T,
            m_T,
            s_T,
            u_T,
            k=k,
            start=shard.start,
            want_entropy=want_entropy,
        )
        cand_val_TK[:, :k] = val_TK
        cand_id_TK[:, :k] = id_TK
        stats_T3 = torch.stack([m_T, s_T, u_T], dim=1)
        overflow_T = count_T > cap
    return LocalReduction(
        stats_R3=stats_T3,
        tz_RW=tz_TW,
        cand_val_RK=cand_val_TK,
        cand_id_RK=cand_id_TK,
        skey_RN=skey_TN,
        sid_RN=sid_TN,
        sz_RN=sz_TN,
        overflow_R=overflow_T,
    )


def _select_topk(
    cz_RC: torch.Tensor,
    cid_RC: torch.Tensor,
    count_R: torch.Tensor,
    m_R: torch.Tensor,
    s_R: torch.Tensor,
    u_R: torch.Tensor,
    *,
    k: int,
    start: int,
    want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 4: the top-k (values, global ids) among the candidates, and the rest sums with the
    other candidates' mass added back."""
    neg_inf = NEG_INF
    live_RC = torch.arange(cz_RC.shape[1], device=cz_RC.device) < count_R[:, None]
    cz_RC = torch.where(live_RC, cz_RC, neg_inf)
    gid_RC = torch.where(live_RC, cid_RC.long() + start, SENTINEL_ID)
    # Unique keys ordered by (value desc, id asc): the first k are the top-k with no tie fix,
    # and the sums below run in an order that does not depend on the atomics.
    _, order_RC = order_key(cz_RC, gid_RC).sort(dim=1, descending=True)
    cz_RC, gid_RC, live_RC = (t.gather(1, order_RC) for t in (cz_RC, gid_RC, live_RC))
    rest_RC = live_RC.clone()
    rest_RC[:, :k] = False
    ref_R = torch.where(torch.isfinite(m_R), m_R, 0.0)
    y_RC = cz_RC - ref_R[:, None]
    e_RC = torch.where(rest_RC, torch.exp(y_RC), 0.0)
    s_R = s_R + e_RC.sum(dim=1)
    if want_entropy:
        u_R = u_R + torch.where(rest_RC & (cz_RC > neg_inf), e_RC * y_RC, 0.0).sum(dim=1)
    return cz_RC[:, :k], gid_RC[:, :k], s_R, u_R
