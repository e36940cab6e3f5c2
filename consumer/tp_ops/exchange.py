"""The exchange: every rank's `LocalReduction` gathered in one all_gather of 32-bit words per
row, and merged into the same `HeadOutputs` on every rank. Works the same whichever path
(reference or fused) produced the local reductions.

Shape legend (suffixes on tensor names):
    R  rows of one call
    W  target ids per row (may be 0)
    K  top-k entries per row (may be 0)
    N  samples per row (may be 0)
    P  tensor-parallel ranks
    C  merge candidates per row, P * K
    D  32-bit words one rank contributes per row to the gather, 3 + W + 2K + 3N
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from consumer.head_common import NEG_INF, LocalReduction, order_key
from consumer.tp_ops.layout import HeadOutputs, HeadRequest

__all__ = ["exchange"]


def _as_words(x_RX: torch.Tensor) -> torch.Tensor:
    # fp32 travels as its bit pattern and ids as int32: ids are never cast to float.
    if x_RX.dtype == torch.float32:
        return x_RX.contiguous().view(torch.int32)
    return x_RX.to(torch.int32)


def exchange(
    *, req: HeadRequest, local: LocalReduction, w: int
) -> tuple[HeadOutputs, torch.Tensor, torch.Tensor | None]:
    """Every rank's LocalReduction gathered and merged: the outputs, a [R] mask of rows whose
    logits were unusable, and (fused kernels only) a [R] mask of rows the kernels could not
    finish exactly. `w`: target ids per row."""
    payload_RD = torch.cat(
        [
            _as_words(local.stats_R3),
            _as_words(local.tz_RW),
            _as_words(local.cand_val_RK),
            _as_words(local.cand_id_RK),
            _as_words(local.skey_RN),
            _as_words(local.sid_RN),
            _as_words(local.sz_RN),
        ],
        dim=1,
    )
    gathered_PRD = _all_gather_rows(payload_RD, req)
    out, bad_R = _merge(req, gathered_PRD, w)
    return out, bad_R, local.overflow_R


def _all_gather_rows(payload_RD: torch.Tensor, req: HeadRequest) -> torch.Tensor:
    if req.tp_size == 1:
        return payload_RD[None]
    rows, words = payload_RD.shape
    # The concatenated [P * R, D] form is the one every backend accepts.
    out_PRD = torch.empty(
        (req.tp_size * rows, words), dtype=payload_RD.dtype, device=payload_RD.device
    )
    _gather_single(out_PRD, payload_RD.contiguous(), group=req.tp_group)
    if req.comm is not None:
        nbytes = payload_RD.numel() * payload_RD.element_size()
        req.comm.record(kind="all_gather", sent=nbytes, received=nbytes * req.tp_size)
    return out_PRD.view(req.tp_size, rows, words)


# all_gather_single replaces all_gather_into_tensor in newer torch; same contract.
_gather_single: Callable[..., object] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)


def _merge(
    req: HeadRequest, gathered_PRD: torch.Tensor, w: int
) -> tuple[HeadOutputs, torch.Tensor]:
    k, n = req.top_k, req.sample_n
    offsets = [0, 3, 3 + w, 3 + w + k, 3 + w + 2 * k, 3 + w + 2 * k + n, 3 + w + 2 * k + 2 * n]
    offsets.append(offsets[-1] + n)

    def field_(i: int, as_float: bool) -> torch.Tensor:
        words = gathered_PRD[..., offsets[i] : offsets[i + 1]].contiguous()
        return words.view(torch.float32) if as_float else words.to(torch.int64)

    stats_PR3 = field_(0, True)
    m_PR, s_rest_PR, u_rest_PR = stats_PR3.unbind(dim=2)
    tz_RW = field_(1, True).amax(dim=0)
    cand_val_RC = field_(2, True).permute(1, 0, 2).flatten(1)
    cand_id_RC = field_(3, False).permute(1, 0, 2).flatten(1)
    skey_PRN, sid_PRN, sz_PRN = field_(4, True), field_(5, False), field_(6, True)

    big_m_R = m_PR.amax(dim=0)
    live_PR = s_rest_PR > 0
    w_PR = torch.where(live_PR, torch.exp(m_PR - big_m_R), 0.0)
    rest_R = (w_PR * s_rest_PR).sum(dim=0)

    e_RC = torch.where(cand_val_RC > NEG_INF, torch.exp(cand_val_RC - big_m_R[:, None]), 0.0)
    if k:
        _, top_pos_RK = torch.topk(order_key(cand_val_RC, cand_id_RC), k, dim=1)
        in_top_RC = torch.zeros_like(e_RC, dtype=torch.bool).scatter_(1, top_pos_RK, True)
        rest_R = rest_R + torch.where(in_top_RC, 0.0, e_RC).sum(dim=1)
        sum_R = rest_R + torch.where(in_top_RC, e_RC, 0.0).sum(dim=1)
        topk_ids_RK = cand_id_RC.gather(1, top_pos_RK)
        topk_val_RK = cand_val_RC.gather(1, top_pos_RK)
    else:
        sum_R = rest_R
        topk_ids_RK = cand_id_RC[:, :0]
        topk_val_RK = cand_val_RC[:, :0]
    lse_R = big_m_R + torch.log(sum_R)
    bad_R = ~torch.isfinite(lse_R)

    entropy_R = None
    if req.want_entropy:
        shift_PR = torch.where(live_PR, m_PR - big_m_R, 0.0)
        acc_R = (w_PR * (u_rest_PR + shift_PR * s_rest_PR)).sum(dim=0)
        acc_R = acc_R + torch.where(e_RC > 0, e_RC * (cand_val_RC - big_m_R[:, None]), 0.0).sum(
            dim=1
        )
        # H = -sum p log p with p = e / S and log p = (z - M) - log S.
        entropy_R = torch.log(sum_R) - acc_R / sum_R
        bad_R |= ~torch.isfinite(entropy_R)

    if n:
        best_P_RN = order_key(skey_PRN, sid_PRN).argmax(dim=0, keepdim=True)
        sample_ids_RN = sid_PRN.gather(0, best_P_RN).squeeze(0)
        sample_z_RN = sz_PRN.gather(0, best_P_RN).squeeze(0)
    else:
        sample_ids_RN = sid_PRN[0]
        sample_z_RN = sz_PRN[0]

    out = HeadOutputs(
        target_logprobs_TW=tz_RW - lse_R[:, None],
        topk_ids_TK=topk_ids_RK,
        topk_logprobs_TK=topk_val_RK - lse_R[:, None],
        topk_rest_logprob_T=torch.log(rest_R) - torch.log(sum_R),
        sample_ids_TN=sample_ids_RN,
        sample_logprobs_TN=sample_z_RN - lse_R[:, None],
        entropy_T=entropy_R,
    )
    return out, bad_R
