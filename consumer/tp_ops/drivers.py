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
from consumer.head_common import LocalReduction, VocabShard
from consumer.tp_ops.exchange import exchange
from consumer.tp_ops.layout import CommStats, HeadOutputs, HeadRequest
from consumer.tp_ops.local import local_reduce
from consumer.tp_ops.random_source import stream_keys
from consumer.tp_ops.validation import check_inputs, group_layout, to_device

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
class _HeadCall:
    """The inputs of one head call, as `head_from_logits` / `chunked_head` received them."""

    rows: int
    width: int
    device: torch.device
    logits_chunk: Callable[[int, int], torch.Tensor]
    shard: VocabShard
    tp_group: dist.ProcessGroup | None
    target_ids_TW: torch.Tensor | None
    inv_temperature_T: torch.Tensor
    top_k: int
    sample_n: int
    seed_T: torch.Tensor | None
    position_T: torch.Tensor | None
    want_entropy: bool
    chunk_rows: int | None
    comm: CommStats | None
    fused: bool


def _run_chunks(call: _HeadCall, *, deferred: bool) -> PendingHead:
    """Check, reduce, exchange; settled at once unless `deferred` (and TP = 1)."""
    rows, width, device, shard = call.rows, call.width, call.device, call.shard
    rank, tp_size = group_layout(call.tp_group)
    check_inputs(
        rows=rows,
        width=width,
        device=device,
        shard=shard,
        rank=rank,
        tp_size=tp_size,
        target_ids_TW=call.target_ids_TW,
        inv_temperature_T=call.inv_temperature_T,
        top_k=call.top_k,
        sample_n=call.sample_n,
        seed_T=call.seed_T,
        position_T=call.position_T,
    )
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
            logits_chunk=call.logits_chunk,
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
                logits_RV=call.logits_chunk(r0, min(rows, r0 + step)),
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
        return _run_chunks(dataclasses.replace(call, fused=False), deferred=False).result()

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
def head_from_logits(
    *,
    logits_TV: torch.Tensor,
    shard: VocabShard,
    tp_group: dist.ProcessGroup | None,
    target_ids_TW: torch.Tensor | None,
    inv_temperature_T: torch.Tensor,
    top_k: int,
    sample_n: int,
    seed_T: torch.Tensor | None,
    position_T: torch.Tensor | None,
    want_entropy: bool,
    chunk_rows: int | None = None,
    comm: CommStats | None = None,
    fused: bool = True,
) -> HeadOutputs:
    """Teacher outputs from this rank's logits shard `logits_TV` ([T, shard.size], any float dtype).

    Every rank of `tp_group` (None: TP = 1) must call this with the same rows and arguments except
    its own logits. Rows are processed in chunks of `chunk_rows` (default: about
    DEFAULT_CHUNK_ELEMENTS / V), each upcast to fp32, so extra memory is O(chunk_rows x V).

    target_ids_TW: int64 [T, W] global ids in [0, vocab_size), or None for W = 0.
    inv_temperature_T: fp32 [T], 1 / temperature per row (see validate_temperature).
    top_k: K <= vocab_size; the top-K ids by descending probability, ties to the lowest id.
    sample_n: N; seed_T, position_T (int64 [T]) key the samples (see sampling_hash).
    want_entropy: also return the entropy of the tempered distribution.
    comm: optional CommStats that records the collectives.
    fused: run the local reduction through the fused kernels where they load for the logits'
    device (CUDA with Triton: `consumer.kernels.load`); False: the reference path everywhere.
    The per-row inputs may live on the logits' device or on the CPU. On the CPU their values
    are checked without a device sync and then copied over asynchronously, so a caller that
    keeps them on the host lets the device run ahead.

    Raises ValueError on inconsistent arguments, and on rows whose logits hold NaN or +inf.
    """
    if not logits_TV.is_floating_point() or logits_TV.dim() != 2:
        raise ValueError(
            f"logits_TV must be a 2-D float tensor, got {logits_TV.dtype} {tuple(logits_TV.shape)}"
        )
    call = _HeadCall(
        rows=logits_TV.shape[0],
        width=logits_TV.shape[1],
        device=logits_TV.device,
        logits_chunk=lambda r0, r1: logits_TV[r0:r1],
        shard=shard,
        tp_group=tp_group,
        target_ids_TW=target_ids_TW,
        inv_temperature_T=inv_temperature_T,
        top_k=top_k,
        sample_n=sample_n,
        seed_T=seed_T,
        position_T=position_T,
        want_entropy=want_entropy,
        chunk_rows=chunk_rows,
        comm=comm,
        fused=fused,
    )
    return _run_chunks(call, deferred=False).result()


@overload
def chunked_head(
    *,
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    shard: VocabShard,
    tp_group: dist.ProcessGroup | None,
    target_ids_TW: torch.Tensor | None,
    inv_temperature_T: torch.Tensor,
    top_k: int,
    sample_n: int,
    seed_T: torch.Tensor | None,
    position_T: torch.Tensor | None,
    want_entropy: bool,
    chunk_rows: int | None = None,
    comm: CommStats | None = None,
    deferred: Literal[False] = False,
    fused: bool = True,
) -> HeadOutputs: ...


@overload
def chunked_head(
    *,
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    shard: VocabShard,
    tp_group: dist.ProcessGroup | None,
    target_ids_TW: torch.Tensor | None,
    inv_temperature_T: torch.Tensor,
    top_k: int,
    sample_n: int,
    seed_T: torch.Tensor | None,
    position_T: torch.Tensor | None,
    want_entropy: bool,
    chunk_rows: int | None = None,
    comm: CommStats | None = None,
    deferred: Literal[True],
    fused: bool = True,
) -> PendingHead: ...


@torch.no_grad()
def chunked_head(
    *,
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    shard: VocabShard,
    tp_group: dist.ProcessGroup | None,
    target_ids_TW: torch.Tensor | None,
    inv_temperature_T: torch.Tensor,
    top_k: int,
    sample_n: int,
    seed_T: torch.Tensor | None,
    position_T: torch.Tensor | None,
    want_entropy: bool,
    chunk_rows: int | None = None,
    comm: CommStats | None = None,
    deferred: bool = False,
    fused: bool = True,
) -> HeadOutputs | PendingHead:
    """Like head_from_logits, producing each chunk's logits as hidden_chunk @ weight_VH.T.

    hidden_TH: [T, H] final hidden states (replicated on the TP group); weight_VH: this rank's
    [shard.size, H] output-layer shard, same dtype. The matmul runs in that dtype and only one
    chunk of logits exists at a time, so the full [T, V] logits are never materialised.

    deferred: return a PendingHead as soon as the work is queued on the device, without
    waiting for it (at TP = 1; with a TP group the call completes first, as its checks need
    the group). The caller may queue more work before `result()`.
    fused: as in head_from_logits.
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
    call = _HeadCall(
        rows=hidden_TH.shape[0],
        width=weight_VH.shape[0],
        device=hidden_TH.device,
        logits_chunk=lambda r0, r1: hidden_TH[r0:r1] @ weight_HV,
        shard=shard,
        tp_group=tp_group,
        target_ids_TW=target_ids_TW,
        inv_temperature_T=inv_temperature_T,
        top_k=top_k,
        sample_n=sample_n,
        seed_T=seed_T,
        position_T=position_T,
        want_entropy=want_entropy,
        chunk_rows=chunk_rows,
        comm=comm,
        fused=fused,
    )
    pending = _run_chunks(call, deferred=deferred)
    return pending if deferred else pending.result()
