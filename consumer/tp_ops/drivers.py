"""The head's entry points: `head_from_logits` and `chunked_head` check a call, pick the path
of each rank's local reduction, exchange, and settle the result.

This is the one module of the head that imports both paths: the reference local reduction
(`consumer.tp_ops.local`) and the fused kernels, through `consumer.kernels.load`. The caller
picks with `fused=`: True (the default) runs the kernels where they load for the logits'
device (CUDA with Triton), and the reference path everywhere else; False runs the reference
path everywhere. Either way the same single exchange follows, so ranks on different paths
still meet in the same collectives.

Shape legend (suffixes on tensor names):
    T  rows (scored positions) of the batch
    V  columns of this rank's vocabulary shard (padded_vocab / TP)
    H  hidden size
    W  target ids per row (may be 0)
    N  samples per row (may be 0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, overload

import torch
import torch.distributed as dist

from consumer import kernels
from consumer.head_common import LocalReduction
from consumer.tp_ops.exchange import exchange
from consumer.tp_ops.layout import HeadCall, HeadOutputs, HeadRequest
from consumer.tp_ops.local import local_reduce
from consumer.tp_ops.random_source import stream_keys
from consumer.tp_ops.validation import check_inputs
from consumer.transfer import to_device

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "PendingHead", "chunked_head", "head_from_logits"]

# Row chunks are sized so one fp32 [R, V] buffer holds about this many elements; the sampling
# scratch adds 16 bytes per element (an fp32 copy in blocks, its fp32 exps and their fp64
# copies) on top of the 4-byte tempered logits.
DEFAULT_CHUNK_ELEMENTS = 1 << 25
# Default chunk of the fused CUDA kernels (consumer/kernels), which hold only the logits chunk.
_FUSED_CHUNK_ELEMENTS = 1 << 27


def _auto_chunk_rows(chunk_rows: int | None, width: int) -> int:
    if chunk_rows is None:
        return max(1, DEFAULT_CHUNK_ELEMENTS // max(width, 1))
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    return chunk_rows


@dataclass(frozen=True)
class PendingHead:
    """Head outputs the device may still be computing (`chunked_head(..., deferred=True)`).

    `out` holds the output tensors (read them only after `result()`, or in stream order on the
    device); `result()` waits for the device, checks every row, and returns `out`, or the
    outputs of the call redone on the reference path where the kernels could not finish a row.
    Raises ValueError as the call itself would have."""

    out: HeadOutputs
    _settle: Callable[[], HeadOutputs]

    def result(self) -> HeadOutputs:
        """The checked outputs (waits for the device)."""
        return self._settle()


@dataclass(frozen=True)
class _Logits:
    """Where a call's logits come from: `chunk(r0, r1)` gives rows r0..r1 of this rank's
    [rows, width] logits on `device`."""

    rows: int
    width: int
    device: torch.device
    chunk: Callable[[int, int], torch.Tensor]


def _run_chunks(call: HeadCall, logits: _Logits, *, deferred: bool) -> PendingHead:
    """Check, reduce, exchange; settled at once unless `deferred` (and TP = 1)."""
    rows, width, device, shard = logits.rows, logits.width, logits.device, call.shard
    rank, tp_size = check_inputs(call, rows=rows, width=width, device=device)
    inv_temperature_T = to_device(call.inv_temperature_T, device)
    target_ids_TW, seed_T, position_T = (
        None if t is None else to_device(t, device)
        for t in (call.target_ids_TW, call.seed_T, call.position_T)
    )
    fused = kernels.load(device) if call.fused else None
    chunk_rows = call.chunk_rows
    if fused is not None and chunk_rows is None:
        # The kernels keep no fp32 [R, V] scratch, so the default chunk can be larger.
        chunk_rows = max(1, _FUSED_CHUNK_ELEMENTS // max(width, 1))
    step = _auto_chunk_rows(chunk_rows, width)
    if target_ids_TW is None:
        target_ids_TW = torch.empty((rows, 0), dtype=torch.int64, device=device)
    w = target_ids_TW.shape[1]
    req = HeadRequest(
        shard=shard,
        tp_group=call.tp_group,
        rank=rank,
        tp_size=tp_size,
        top_k=call.top_k,
        sample_n=call.sample_n,
        want_entropy=call.want_entropy,
        comm=call.comm,
    )

    keys_TN = None
    if call.sample_n:
        assert seed_T is not None and position_T is not None  # checked above
        keys_TN = stream_keys(seed_T=seed_T, position_T=position_T, sample_n=call.sample_n)

    # Each rank reduces its shard chunk by chunk to a few numbers per row, then one exchange
    # and merge covers every row. The kernels may decline a call (then None): the reference
    # path serves it, with the same single exchange, so ranks on different paths still meet
    # in the same collectives.
    local = None
    if fused is not None:
        local = fused.local_reduce(
            logits_chunk=logits.chunk,
            rows=rows,
            chunk_rows=step,
            shard=shard,
            target_ids_TW=target_ids_TW,
            inv_temperature_T=inv_temperature_T,
            keys_TN=keys_TN,
            top_k=call.top_k,
            want_entropy=call.want_entropy,
        )
    if local is None:
        chunks = [
            local_reduce(
                req=req,
                logits_RV=logits.chunk(r0, min(rows, r0 + step)),
                target_ids_RW=target_ids_TW[r0 : r0 + step],
                inv_temperature_R=inv_temperature_T[r0 : r0 + step],
                keys_RN=None if keys_TN is None else keys_TN[r0 : r0 + step],
            )
            for r0 in range(0, rows, step) or [0]  # one empty chunk for no rows
        ]
        local = LocalReduction(
            *(torch.cat(parts) for parts in list(zip(*chunks, strict=True))[:-1])
        )
    out, bad_T, over_T = exchange(req=req, local=local, w=w)
    if over_T is None and fused is not None:
        over_T = torch.zeros(rows, dtype=torch.bool, device=device)

    def on_reference_path() -> HeadOutputs:
        reference = dataclasses.replace(call, fused=False)
        return _run_chunks(reference, logits, deferred=False).result()

    # Both checks in one host read. A row the kernels could not finish (a huge tie at the top-k
    # threshold) may sit on any rank, so the ranks agree before all of them redo the call on the
    # reference path, collectives included. Without the kernels every rank merged the same
    # gathered data, so every rank raises (or not) together.
    over = over_T.any() if over_T is not None else torch.zeros((), dtype=torch.bool, device=device)
    flags = torch.stack([bad_T.any(), over]).to(torch.int32)
    if over_T is not None and tp_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=call.tp_group)
    if not deferred or tp_size > 1:
        settled = _settled(out, bad_T, flags, None, on_reference_path)
        return PendingHead(settled, lambda: settled)
    done = None
    if device.type == "cuda":
        flags = flags.to("cpu", non_blocking=True)  # pinned: lands when `done` does
        done = torch.cuda.Event()
        done.record()
    return PendingHead(out, lambda: _settled(out, bad_T, flags, done, on_reference_path))


def _settled(
    out: HeadOutputs,
    bad_T: torch.Tensor,
    flags: torch.Tensor,
    done: torch.cuda.Event | None,
    on_reference_path: Callable[[], HeadOutputs],
) -> HeadOutputs:
    if done is not None:
        done.synchronize()
    any_bad, any_over = flags.tolist()
    if any_over:
        return on_reference_path()
    if any_bad:
        bad_rows = bad_T.nonzero().squeeze(1)
        raise ValueError(
            f"{bad_rows.numel()} rows have NaN or +inf logits, or no finite logit; first rows "
            f"{bad_rows[:8].tolist()}"
        )
    return out


@torch.no_grad()
def head_from_logits(*, logits_TV: torch.Tensor, call: HeadCall) -> HeadOutputs:
    """Teacher outputs from this rank's logits shard `logits_TV` ([T, shard.size], any float dtype).

    Every rank of `call.tp_group` must call this with the same rows and `call` except its own
    logits and shard (`HeadCall` says what each field must be). Rows are processed in chunks of
    `call.chunk_rows`, each upcast to fp32, so extra memory is O(chunk_rows x V).

    Raises ValueError on inconsistent arguments, and on rows whose logits hold NaN or +inf.
    """
    if not logits_TV.is_floating_point() or logits_TV.dim() != 2:
        raise ValueError(
            f"logits_TV must be a 2-D float tensor, got {logits_TV.dtype} {tuple(logits_TV.shape)}"
        )
    logits = _Logits(
        rows=logits_TV.shape[0],
        width=logits_TV.shape[1],
        device=logits_TV.device,
        chunk=lambda r0, r1: logits_TV[r0:r1],
    )
    return _run_chunks(call, logits, deferred=False).result()


@overload
def chunked_head(
    *,
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    call: HeadCall,
    deferred: Literal[False] = False,
) -> HeadOutputs: ...


@overload
def chunked_head(
    *, hidden_TH: torch.Tensor, weight_VH: torch.Tensor, call: HeadCall, deferred: Literal[True]
) -> PendingHead: ...


@torch.no_grad()
def chunked_head(
    *, hidden_TH: torch.Tensor, weight_VH: torch.Tensor, call: HeadCall, deferred: bool = False
) -> HeadOutputs | PendingHead:
    """Like head_from_logits, producing each chunk's logits as hidden_chunk @ weight_VH.T.

    hidden_TH: [T, H] final hidden states (replicated on the TP group); weight_VH: this rank's
    [shard.size, H] output-layer shard, same dtype. The matmul runs in that dtype and only one
    chunk of logits exists at a time, so the full [T, V] logits are never materialised.

    deferred: return a PendingHead as soon as the work is queued on the device, without
    waiting for it (at TP = 1; with a TP group the call completes first, as its checks need
    the group). The caller may queue more work before `result()`.
    """
    if hidden_TH.dim() != 2 or weight_VH.dim() != 2 or hidden_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"hidden_TH [T, H] and weight_VH [V, H] disagree: {tuple(hidden_TH.shape)} vs "
            f"{tuple(weight_VH.shape)}"
        )
    if hidden_TH.dtype != weight_VH.dtype or not hidden_TH.is_floating_point():
        raise ValueError(
            f"hidden_TH and weight_VH need one float dtype, got {hidden_TH.dtype} and "
            f"{weight_VH.dtype}"
        )
    if hidden_TH.device != weight_VH.device:
        raise ValueError(f"hidden_TH is on {hidden_TH.device}, weight_VH on {weight_VH.device}")
    weight_HV = weight_VH.t()
    logits = _Logits(
        rows=hidden_TH.shape[0],
        width=weight_VH.shape[0],
        device=hidden_TH.device,
        chunk=lambda r0, r1: hidden_TH[r0:r1] @ weight_HV,
    )
    pending = _run_chunks(call, logits, deferred=deferred)
    return pending if deferred else pending.result()
