"""One rank's per-chunk reduction (tp_ops.LocalReduction) from its logits, fused in Triton.

The reference path (`tp_ops._local_reduce`) materialises z = fp32(logits * inv_temperature)
as an [R, V] tensor and runs a dozen full-size passes over it (max, gather, top-k with a tie
fix, exp, scatter, sums, entropy), plus ~30 per sample. Here each pass reads the logits chunk
in its own dtype and keeps only per-row numbers:

1. (top-k only) `_group_max_kernel`: the max of z over G = BLOCK_V residue classes of the
   columns, kept as an elementwise running max (no data moves between threads). The k-th
   largest of these G maxima, t0, is a lower bound of the k-th largest z (k distinct columns
   reach it), so the top-k lies among the columns with z >= t0: with G = 2048 groups of ~75
   columns, barely more than k of a 150k vocabulary.
2. `_sums_kernel`: an online (rescaled) running max, the sum of exp(z - max) and of
   exp(z - max) * (z - max) over the columns below t0, and the columns at or above t0
   appended to a small candidate buffer through an atomic counter (they are rare, so the
   atomics cost nothing; their order is arbitrary and is fixed by step 3).
3. PyTorch on the candidates only: one sort by unique 64-bit order keys (value desc, id asc)
   gives the exact top-k and a deterministic order for the candidates outside it, whose mass
   is added back so the rest mass stays a sum of positive terms as in the reference.
4. `gumbel.gumbel_argmax` for the samples.

Candidate buffers hold CAP columns per row and split; a row with more columns at or above t0
(hundreds of columns tied at the threshold) is flagged in `overflow_R` and tp_ops redoes
the call on the reference path. Values agree with the reference to fp32 rounding (the sums run
in another order); ids (top-k and samples) agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from consumer import tp_ops
from consumer.kernels.gumbel import gumbel_argmax


@dataclass
class RowStatsConfig:
    """Launch shape; benchmarks may change the module's `CONFIG`."""

    block_v: int = 2048  # columns per iteration; also the residue classes of step 1 (>= k)
    cap: int = 256  # candidate slots per row and split
    target_programs: int = 2048  # split rows' columns until about this many programs run
    num_warps: int = 4


CONFIG = RowStatsConfig()


@triton.jit
def _group_max_kernel(
    logits_ptr,
    stride_r,
    inv_ptr,
    out_ptr,
    valid,
    span,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    inv = tl.load(inv_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_r
    offs = tl.arange(0, BLOCK_V)
    lo = split * span
    hi = tl.minimum(lo + span, valid)
    # span is a multiple of BLOCK_V, so position i of every block is column class i % BLOCK_V.
    gmax = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for c0 in range(lo, hi, BLOCK_V):
        cols = c0 + offs
        cm = cols < hi
        x = tl.load(row_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        gmax = tl.maximum(gmax, tl.where(cm, x * inv, float("-inf")))
    tl.store(out_ptr + (row * tl.num_programs(1) + split) * BLOCK_V + offs, gmax)


@triton.jit
def _sums_kernel(
    logits_ptr,
    stride_r,
    inv_ptr,
    t0_ptr,
    m_ptr,
    s_ptr,
    u_ptr,
    cz_ptr,
    cid_ptr,
    count_ptr,
    valid,
    span,
    cap,
    HAS_CAND: tl.constexpr,
    WANT_U: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    part = row * tl.num_programs(1) + split
    inv = tl.load(inv_ptr + row)
    if HAS_CAND:
        t0 = tl.load(t0_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_r
    offs = tl.arange(0, BLOCK_V)
    lo = split * span
    hi = tl.minimum(lo + span, valid)

    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    u = tl.zeros([], tl.float32)
    n_bad = tl.zeros([], tl.int32)
    for c0 in range(lo, hi, BLOCK_V):
        cols = c0 + offs
        cm = cols < hi
        x = tl.load(row_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        z = tl.where(cm, x * inv, float("-inf"))
        # NaN and +inf: the reference's max turns NaN/inf and the merge flags the row; the
        # max here ignores NaN, so they are counted and the max is poisoned at the end.
        n_bad += tl.sum((cm & ~(z < float("inf"))).to(tl.int32), axis=0)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # Sums are kept relative to the running max (0 while there is no finite one), as the
        # reference keeps them relative to the final one; rescale when the max grows.
        ref_old = tl.where(m > float("-inf"), m, 0.0)
        ref_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        # s > 0 implies a finite old max <= the new one, so exp never overflows here.
        alpha = tl.where(s > 0, tl.exp(ref_old - ref_new), 0.0)
        if HAS_CAND:
            cand = cm & (z >= t0)
            below = cm & (z < t0)
        else:
            below = cm
        y = z - ref_new
        e = tl.where(below, tl.exp(y), 0.0)
        if WANT_U:
            # exp(-inf) * -inf is NaN; such columns add nothing.
            ey = tl.where(below & (z > float("-inf")), e * y, 0.0)
            u = alpha * (u + (ref_old - ref_new) * s) + tl.sum(ey, axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
        if HAS_CAND:
            # One atomic per candidate on this (row, split)'s counter, which starts at 0: the
            # old value is the candidate's slot.
            slot = tl.atomic_add(count_ptr + part + offs * 0, 1, mask=cand)
            keep = cand & (slot < cap)
            tl.store(cz_ptr + part * cap + slot, z, mask=keep)
            tl.store(cid_ptr + part * cap + slot, cols, mask=keep)
    tl.store(m_ptr + part, tl.where(n_bad > 0, float("nan"), m))
    tl.store(s_ptr + part, s)
    tl.store(u_ptr + part, u)


def _splits(rows: int, valid: int, block_v: int) -> tuple[int, int]:
    """(splits per row, columns per split): enough programs to fill the device, each split a
    multiple of block_v columns."""
    cfg = CONFIG
    want = max(1, min(triton.cdiv(cfg.target_programs, max(rows, 1)), triton.cdiv(valid, block_v)))
    span = triton.cdiv(triton.cdiv(valid, want), block_v) * block_v
    return triton.cdiv(valid, span), span


def _combine_splits(
    m_RS: torch.Tensor, s_RS: torch.Tensor, u_RS: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split (max, sum, entropy sum) -> per-row, relative to the row's finite max."""
    m_R = m_RS.amax(dim=1)
    ref_R = torch.where(torch.isfinite(m_R), m_R, 0.0)
    ref_RS = torch.where(torch.isfinite(m_RS), m_RS, 0.0)
    live_RS = s_RS > 0
    shift_RS = torch.where(live_RS, ref_RS - ref_R[:, None], 0.0)
    w_RS = torch.where(live_RS, torch.exp(shift_RS), 0.0)
    s_R = (w_RS * s_RS).sum(dim=1)
    u_R = (w_RS * (u_RS + shift_RS * s_RS)).sum(dim=1)
    return m_R, s_R, u_R


def local_reduce(
    *,
    logits_RV: torch.Tensor,
    shard: tp_ops.VocabShard,
    target_ids_RW: torch.Tensor,
    inv_temperature_R: torch.Tensor,
    keys_RN: torch.Tensor | None,
    top_k: int,
    want_entropy: bool,
) -> tp_ops.LocalReduction | None:
    """This rank's contribution for a row chunk, as `tp_ops._local_reduce` computes it.

    Returns None for chunks the kernels do not take (a shard with fewer real columns than k
    or none at all); the caller then uses the reference path.
    """
    rows, width = logits_RV.shape
    valid = shard.valid_size
    k_local = min(top_k, width)
    if valid == 0 or valid < k_local or k_local > CONFIG.block_v:
        return None
    device = logits_RV.device
    if logits_RV.stride(1) != 1:
        logits_RV = logits_RV.contiguous()
    inv_R = inv_temperature_R.float().contiguous()

    # Targets: the reference gathers from fp32(logits * inv); the same product here.
    local_RW = target_ids_RW - shard.start
    owned_RW = (local_RW >= 0) & (local_RW < valid)
    tz_RW = logits_RV.gather(1, local_RW.clamp(0, width - 1)).float() * inv_R[:, None]
    tz_RW = torch.where(owned_RW, tz_RW, tp_ops._NEG_INF)

    if keys_RN is not None and keys_RN.shape[1]:
        skey_RN, sid_RN, sz_RN = gumbel_argmax(
            logits_RV=logits_RV, inv_temperature_R=inv_R, keys_RN=keys_RN,
            start=shard.start, valid=valid,
        )  # fmt: skip
    else:
        skey_RN = sz_RN = torch.empty((rows, 0), device=device)
        sid_RN = torch.empty((rows, 0), dtype=torch.int64, device=device)

    splits, span = _splits(rows, valid, CONFIG.block_v)
    t0_R = _threshold(logits_RV, inv_R, k_local, valid, splits, span) if k_local else None
    sums = _sums(logits_RV, inv_R, t0_R, valid, splits, span, want_entropy)
    m_R, s_R, u_R, cz_RSC, cid_RSC, count_RS = sums

    cand_val_RK = torch.full((rows, top_k), tp_ops._NEG_INF, device=device)
    cand_id_RK = torch.full((rows, top_k), tp_ops._SENTINEL_ID, dtype=torch.int64, device=device)
    overflow_R = torch.zeros(rows, dtype=torch.bool, device=device)
    if k_local:
        overflow_R = (count_RS > cz_RSC.shape[2]).any(dim=1)
        val_RK, id_RK, s_R, u_R = _select_topk(
            cz_RSC, cid_RSC, count_RS, m_R, s_R, u_R,
            k=k_local, start=shard.start, want_entropy=want_entropy,
        )  # fmt: skip
        cand_val_RK[:, :k_local] = val_RK
        cand_id_RK[:, :k_local] = id_RK

    return tp_ops.LocalReduction(
        stats_R3=torch.stack([m_R, s_R, u_R], dim=1),
        tz_RW=tz_RW,
        cand_val_RK=cand_val_RK,
        cand_id_RK=cand_id_RK,
        skey_RN=skey_RN,
        sid_RN=sid_RN,
        sz_RN=sz_RN,
        overflow_R=overflow_R,
    )


def _threshold(
    logits_RV: torch.Tensor, inv_R: torch.Tensor, k: int, valid: int, splits: int, span: int
) -> torch.Tensor:
    """Per row, t0 <= the k-th largest tempered logit (step 1)."""
    rows, block_v = logits_RV.shape[0], CONFIG.block_v
    gmax_RSG = torch.empty((rows, splits, block_v), dtype=torch.float32, device=logits_RV.device)
    _group_max_kernel[(rows, splits)](
        logits_RV, logits_RV.stride(0), inv_R, gmax_RSG, valid, span,
        BLOCK_V=block_v, num_warps=CONFIG.num_warps,
    )  # fmt: skip
    gmax_RG = gmax_RSG[:, 0] if splits == 1 else gmax_RSG.amax(dim=1)
    return gmax_RG.topk(k, dim=1, sorted=False).values.amin(dim=1).contiguous()


def _sums(
    logits_RV: torch.Tensor,
    inv_R: torch.Tensor,
    t0_R: torch.Tensor | None,
    valid: int,
    splits: int,
    span: int,
    want_entropy: bool,
) -> tuple[torch.Tensor, ...]:
    """Step 2: per row max, rest sums below t0 (all columns without t0), and the candidates
    [R, splits, cap] with their counts per split."""
    rows, device = logits_RV.shape[0], logits_RV.device
    m_RS = torch.empty((rows, splits), dtype=torch.float32, device=device)
    s_RS, u_RS = torch.empty_like(m_RS), torch.empty_like(m_RS)
    count_RS = torch.zeros((rows, splits), dtype=torch.int32, device=device)
    cap = CONFIG.cap if t0_R is not None else 1
    cz_RSC = torch.empty((rows, splits, cap), dtype=torch.float32, device=device)
    cid_RSC = torch.empty((rows, splits, cap), dtype=torch.int32, device=device)
    _sums_kernel[(rows, splits)](
        logits_RV, logits_RV.stride(0), inv_R, inv_R if t0_R is None else t0_R,
        m_RS, s_RS, u_RS, cz_RSC, cid_RSC, count_RS, valid, span, cap,
        HAS_CAND=t0_R is not None, WANT_U=want_entropy, BLOCK_V=CONFIG.block_v,
        num_warps=CONFIG.num_warps,
    )  # fmt: skip
    m_R, s_R, u_R = _combine_splits(m_RS, s_RS, u_RS)
    if not want_entropy:
        u_R = torch.zeros_like(s_R)
    return m_R, s_R, u_R, cz_RSC, cid_RSC, count_RS


def _select_topk(
    cz_RSC: torch.Tensor,
    cid_RSC: torch.Tensor,
    count_RS: torch.Tensor,
    m_R: torch.Tensor,
    s_R: torch.Tensor,
    u_R: torch.Tensor,
    *,
    k: int,
    start: int,
    want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3: the top-k (values, global ids) among the candidates, and the rest sums with the
    other candidates' mass added back."""
    neg_inf = tp_ops._NEG_INF
    cap = cz_RSC.shape[2]
    live_RSC = torch.arange(cap, device=cz_RSC.device) < count_RS[..., None]
    cz_RC = torch.where(live_RSC, cz_RSC, neg_inf).flatten(1)
    gid_RC = torch.where(live_RSC, cid_RSC.long() + start, tp_ops._SENTINEL_ID).flatten(1)
    live_RC = live_RSC.flatten(1)
    # Unique keys ordered by (value desc, id asc): the first k are the top-k with no tie fix,
    # and the sums below run in an order that does not depend on the atomics.
    _, order_RC = tp_ops._order_key(cz_RC, gid_RC).sort(dim=1, descending=True)
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
