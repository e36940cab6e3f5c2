"""The reference (PyTorch) local reduction: what one rank contributes per row of a chunk,
from its logits shard, before the exchange (`consumer.tp_ops.exchange`). It is the definition
of every output; the fused kernels (`consumer/kernels/`) compute the same `LocalReduction`
without an fp32 [R, V] copy. Runs on any device; the CPU path.

Shape legend (suffixes on tensor names):
    R  rows of one chunk
    V  columns of this rank's vocabulary shard (padded_vocab / TP)
    W  target ids per row (may be 0)
    K  top-k entries per row (may be 0)
    N  samples per row (may be 0)
    G  sampling blocks of a shard (SAMPLE_BLOCK columns each, see `sampling_hash`)
    B  columns of one sampling block
    F  rows whose top-k cut a tie
"""

from __future__ import annotations

import torch

from consumer.head_common import (
    EXP2_COEFFS,
    EXP2_FLOOR,
    LOG2E_F32,
    NEG_INF,
    SAMPLE_BLOCK,
    SENTINEL_ID,
    LocalReduction,
    VocabShard,
    block_layout,
)
from consumer.tp_ops.layout import HeadRequest
from consumer.tp_ops.random_source import GAMMA_S, gumbel_noise_

__all__ = ["local_reduce", "local_samples", "sampling_exp"]


def _local_topk(z_RV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row by (value desc, column asc): a set that does not depend on the kernel."""
    vals_RK, idx_RK = torch.topk(z_RV, k, dim=1, largest=True, sorted=True)
    kth_R1 = vals_RK[:, -1:]
    n_sel_R = (vals_RK == kth_R1).sum(1)
    n_all_R = (z_RV == kth_R1).sum(1)
    fix_R = n_all_R > n_sel_R
    # torch.topk picks arbitrary members of a tie at the k-th value; swap in the lowest columns.
    if bool(fix_R.any()):
        rows_F = fix_R.nonzero().squeeze(1)
        width = z_RV.shape[1]
        cols_V = torch.arange(width, device=z_RV.device)
        tied_FV = torch.where(z_RV[rows_F] == kth_R1[rows_F], cols_V, width)
        tied_FK = torch.topk(tied_FV, k, dim=1, largest=False, sorted=True).values
        n_greater_F1 = k - n_sel_R[rows_F, None]
        slot_K = torch.arange(k, device=z_RV.device)
        src_FK = (slot_K[None, :] - n_greater_F1).clamp(min=0)
        idx_RK[rows_F] = torch.where(
            slot_K[None, :] >= n_greater_F1, tied_FK.gather(1, src_FK), idx_RK[rows_F]
        )
    return vals_RK, idx_RK


def sampling_exp(y: torch.Tensor) -> torch.Tensor:
    """E(y) ~ exp(y) for fp32 y <= 0 (relative error below 2e-7 + 8e-8 |y|; NaN and -inf
    give 0), from fp32 multiplies and adds only, each rounded once, so every device and
    library that rounds fp32 operations to nearest computes the same bits (the fused CUDA
    kernel does: `consumer/kernels`):

        t = fp32(y * log2e32);  n = floor(max(t, -93));  f = max(t, -93) - n
        E(y) = p(f) * 2**n  where t >= -92, else 0

    with p the polynomial of `head_common.EXP2_COEFFS` evaluated by Horner's rule (multiply,
    then add). The block masses of the samples use it (`sampling_hash`). It is cheaper on the
    GPU than the fp64 exp it replaced, and unlike a library's fp32 exp (a hardware
    approximation on CUDA, another on the CPU) it gives the same bits everywhere, so samples
    stay identical across devices.
    """
    t = y * torch.tensor(LOG2E_F32, dtype=torch.float32, device=y.device)
    tc = t.clamp(min=EXP2_FLOOR - 1)
    n = tc.floor()
    f = tc - n
    p = torch.full_like(f, EXP2_COEFFS[0])
    for c in EXP2_COEFFS[1:]:
        p = p.mul_(f).add_(c)
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2**n, exact
    return torch.where(t >= EXP2_FLOOR, p.mul_(scale), 0.0)


def local_samples(
    *, z_RV: torch.Tensor, keys_RN: torch.Tensor, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (row, sample): the winning block's key on this shard, the global id drawn inside
    that block and its tempered logit (the definition in `sampling_hash`), from the tempered
    fp32 logits `z_RV` (padding columns -inf) and the stream keys (`stream_keys`)."""
    rows, sample_n = keys_RN.shape
    valid = shard.valid_size
    device = z_RV.device
    key_RN = torch.full((rows, sample_n), NEG_INF, device=device)
    id_RN = torch.full((rows, sample_n), SENTINEL_ID, dtype=torch.int64, device=device)
    zwin_RN = torch.full((rows, sample_n), NEG_INF, device=device)
    if valid == 0:
        return key_RN, id_RN, zwin_RN
    width = SAMPLE_BLOCK
    offset, blocks = block_layout(shard.start, valid)
    z_RGB = torch.full((rows, blocks * width), NEG_INF, device=device)
    z_RGB[:, offset : offset + valid] = z_RV[:, :valid]
    z_RGB = z_RGB.view(rows, blocks, width)

    # Block masses, each relative to its own max (0 for a block with no finite logit): fp32
    # terms of sampling_exp, summed and logged in fp64.
    m_RG = z_RGB.amax(dim=2)
    live_RG = m_RG > NEG_INF
    m_RG = torch.where(live_RG, m_RG, 0.0)
    e_RGB = sampling_exp(z_RGB - m_RG[:, :, None])
    lse_RG = e_RGB.double().sum(dim=2).log_().add_(m_RG.double())
    lse_RG = torch.where(live_RG, lse_RG, NEG_INF)
    del e_RGB

    local_G = (torch.arange(blocks, device=device) * width - offset).clamp_(min=0)
    bgamma_G = (-(local_G + shard.start + 1)).mul_(GAMMA_S)  # counter -(first id + 1)
    local_B = torch.arange(width, device=device)
    for j in range(sample_n):
        stream_R1 = keys_RN[:, j : j + 1]
        bkey_RG = (lse_RG + gumbel_noise_(stream_R1 + bgamma_G)).float()
        # argmax returns the first maximal block: the lowest on ties.
        best_R = bkey_RG.argmax(dim=1)
        col_RB = best_R[:, None] * width - offset + local_B[None, :]
        inside_RB = (col_RB >= 0) & (col_RB < valid)
        col_RB.clamp_(0, valid - 1)
        zb_RB = torch.where(inside_RB, z_RV.gather(1, col_RB), NEG_INF)
        words_RB = stream_R1 + (col_RB + shard.start + 1).mul_(GAMMA_S)
        # The single fp64 -> fp32 rounding of the noise, then the fp32 sum.
        ekey_RB = zb_RB + gumbel_noise_(words_RB).float()
        at_R = ekey_RB.argmax(dim=1, keepdim=True)
        key_RN[:, j] = bkey_RG.gather(1, best_R[:, None]).squeeze(1)
        id_RN[:, j] = col_RB.gather(1, at_R).squeeze(1) + shard.start
        zwin_RN[:, j] = zb_RB.gather(1, at_R).squeeze(1)
    return key_RN, id_RN, zwin_RN


def local_reduce(
    *,
    req: HeadRequest,
    logits_RV: torch.Tensor,
    target_ids_RW: torch.Tensor,
    inv_temperature_R: torch.Tensor,
    keys_RN: torch.Tensor | None,
) -> LocalReduction:
    """The reference local reduction of one row chunk of this rank's logits (any float dtype),
    with its rows' targets, reciprocal temperatures and stream keys (None when N = 0)."""
    shard, k, n = req.shard, req.top_k, req.sample_n
    rows, width = logits_RV.shape
    device = logits_RV.device
    valid = shard.valid_size

    # One fused multiply upcasts any float dtype to fp32 and applies the temperature.
    z_RV = torch.empty((rows, width), dtype=torch.float32, device=device)
    torch.mul(logits_RV, inv_temperature_R.float()[:, None], out=z_RV)
    if valid < width:
        z_RV[:, valid:] = NEG_INF
    m_R = z_RV.amax(dim=1)

    local_RW = target_ids_RW - shard.start
    owned_RW = (local_RW >= 0) & (local_RW < valid)
    tz_RW = z_RV.gather(1, local_RW.clamp(0, width - 1))
    # -inf from non-owners lets a max over ranks pick the owner's value.
    tz_RW = torch.where(owned_RW, tz_RW, NEG_INF)

    cand_val_RK = torch.full((rows, k), NEG_INF, device=device)
    cand_id_RK = torch.full((rows, k), SENTINEL_ID, dtype=torch.int64, device=device)
    local_idx = None
    if k:
        k_local = min(k, width)
        vals, local_idx = _local_topk(z_RV, k_local)
        cand_val_RK[:, :k_local] = vals
        cand_id_RK[:, :k_local] = local_idx + shard.start

    if n:
        assert keys_RN is not None  # the caller derives them whenever n > 0
        skey_RN, sid_RN, sz_RN = local_samples(z_RV=z_RV, keys_RN=keys_RN, shard=shard)
    else:
        skey_RN = sz_RN = torch.empty((rows, 0), device=device)
        sid_RN = torch.empty((rows, 0), dtype=torch.int64, device=device)

    # Sums relative to the local max; a shard with no finite logit uses 0 so -inf - -inf never
    # occurs (its sum is then 0 and the merge ignores it).
    m_safe_R = torch.where(torch.isfinite(m_R), m_R, 0.0)
    y_RV = z_RV.sub_(m_safe_R[:, None])
    e_RV = torch.exp(y_RV) if req.want_entropy else y_RV.exp_()
    # The local top-k candidates travel to every rank, which adds their mass back itself: the
    # mass outside the global top-k is then a sum of positive terms, never a difference.
    if local_idx is not None:
        e_RV.scatter_(1, local_idx, 0.0)
    s_rest_R = e_RV.sum(dim=1)
    if req.want_entropy:
        # nansum: exp(-inf) * -inf = 0 * -inf is NaN for masked or -inf columns that add 0.
        u_rest_R = torch.nansum(e_RV.mul_(y_RV), dim=1)
    else:
        u_rest_R = torch.zeros_like(s_rest_R)
    del z_RV, y_RV, e_RV

    stats_R3 = torch.stack([m_R, s_rest_R, u_rest_R], dim=1)
    return LocalReduction(stats_R3, tz_RW, cand_val_RK, cand_id_RK, skey_RN, sid_RN, sz_RN)
