"""Core attention for prefill-only teachers: torch scaled_dot_product_attention, no [s, s] mask.

megatron-core's local DotProductAttention materialises a [b, heads, s, s] score tensor and a mask;
this module plugs into the same slot of a megatron layer spec (`SelfAttentionSubmodules.
core_attention`) and calls SDPA with `is_causal=True` instead, so flash / memory-efficient kernels
run on the GPU and nothing quadratic is allocated on the CPU beyond what SDPA itself needs.

Packed batches arrive in megatron's `thd` layout with `TreeBounds`. A plain document attends
causally to itself only; adjacent documents of one length (the usual packed batch) go through
SDPA as one batch, viewed [documents, length, heads, dim] without a copy.

In batches with shared prompts (`consumer/forward/prefix.py`) a response segment attends to its
prompt's rows and causally to itself. Per response that is one SDPA call with keys = prompt ++
response and a lower-right-aligned causal mask of shape [r, p + r]
(`torch.nn.attention.bias.causal_lower_right`): query i of the response sees every prompt key
and response keys 0..i. On CUDA that mask is never materialised (flash / memory-efficient
kernels take it as a flag); elsewhere SDPA gets the [r, p + r] boolean mask, never a
[total, total] one. The prompt's keys are concatenated per response rather than attended
separately and merged, because SDPA does not return the log-sum-exp a merge would need.

On CUDA in 16-bit, the whole pack is instead ONE variable-length flash-attention call per layer
(`torch.nn.attention.varlen.varlen_attn`) over per-segment cumulative lengths: a document's keys
are its own rows, a response's keys are its prompt's rows gathered before its own (causal
alignment is bottom-right, as above). Its cost does not depend on whether a batch's lengths were
seen before: the per-length SDPA calls above made cuDNN build a new plan for every length it
had not met (1.7 ms of host time per call, 196 calls for one 16k-token batch of new lengths on
an H200), which on real traffic, where lengths never repeat, cost more than the forward itself.
The SDPA path that remains (CPU, fp32, a torch without varlen attention) never dispatches to
cuDNN for the same reason.

One exception: each document of LONG_DOCUMENT rows or more in a pack of plain documents
(long-tailed traffic; a document longer than the token budget is a pack of its own) goes
through SDPA's cuDNN kernel, its length padded up to a multiple of LONG_BUCKET so that cuDNN
plans for few lengths (rows padded at the end of a causal sequence change no earlier row); the
documents between two long ones take one varlen call (`long_document_pieces`). A long
document's attention grows with the square of its length, so it is most of such a pack's, and
cuDNN ran it 2.2x faster than the varlen flash kernel on an H200 (589-625 against 246-276
TFLOP/s at 4k-30k tokens, q/k 192 and v 128 dims; the flash call's v padded to 192,
docs/benchmarks.md). Latent attention hands v padded to 192 for the flash kernel and names its
own width (`SdpaCoreAttention.value_dim`), at which cuDNN takes it. It is used where a probe
on the device agrees with the varlen path (`cudnn_long_documents`), never while a CUDA graph
records, and left for the rest of the run if cuDNN raises. Packs with a shared prompt keep the
one varlen call. cuDNN's ragged kernel (one call over a pack's cumulative lengths) is not used
for the other packs: it ran at 0.06-0.18x of the flash call on an H100 (bench/attention_kernels.py).

Latent attention (DeepSeek-V3: q/k 192 dims, v 128) takes a Triton kernel of its own for the
packs of plain documents that do not go to cuDNN (consumer/kernels/mla_attention.py): v at its
own width (the flash call multiplies by 64 dims of padding zeros), the 192-dim q.k product as
two dots. 1.8x the flash call on an H100 on packs of 512-4096-token documents (436 against
243 useful TFLOP/s; docs/benchmarks.md). Its work list of query tiles is built once per
forward on the host (`TreeBounds.mla_tiles`). If the kernel raises (a GPU it does not compile
for), the flash call serves for the rest of the run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import structlog
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from consumer import kernels
from consumer.tp_ops import to_device

log = structlog.get_logger("teacherq.consumer")


@dataclass
class TreeBounds(PackedSeqParams):
    """thd packing of segments, where a segment may also see an earlier one (its shared prompt)
    in full. Plain packed documents are segments that see nothing else.

    `segments` holds host integers (start, end, context_start, context_end) over packed rows;
    an empty context means plain causal attention within the segment. Rotary embeddings come
    from the forward's explicit position ids (positions restart in each document and continue
    from the prompt in each response), not from the row index within a segment:
    `TeacherGPTModel` gathers the rotary table at those ids once per forward, and `cu_seqlens`
    spans the whole pack as one sequence so that megatron applies row t's angles to row t
    whatever its segment.

    `cu_seqlens` stay on the host (megatron reads them with `.tolist()`, a device sync each
    time on a device tensor).

    `rope` is set by `TeacherGPTModel` for its forward: the cos and sin [rows, rot_dim / 2]
    (fp32) of every packed row's rotary angles. The model then hands megatron no rotary
    embedding, and `SdpaCoreAttention` rotates q and k itself (see `apply_rope`).
    """

    segments: tuple[tuple[int, int, int, int], ...] = ()
    rope: tuple[Tensor, Tensor] | None = field(default=None, compare=False, repr=False)
    varlen: VarlenLayout | None = field(default=None, compare=False, repr=False)
    pieces: tuple[Piece, ...] | None = field(default=None, compare=False, repr=False)
    mla_tiles: Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_segments(
        cls, segments: tuple[tuple[int, int, int, int], ...], *, max_position: int
    ) -> TreeBounds:
        """thd parameters for packed segments; `max_position` is the largest position id."""
        total = segments[-1][1]
        cu = torch.tensor([0, total], dtype=torch.int32)
        return cls(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            # Also the length of megatron's own rotary table, which the model replaces.
            max_seqlen_q=max_position + 1,
            max_seqlen_kv=max_position + 1,
            segments=segments,
        )

    @classmethod
    def documents(cls, lengths: list[int] | tuple[int, ...]) -> TreeBounds:
        """Documents of the given lengths back to back, each attending causally to itself
        (the forward's position ids must restart at 0 in each)."""
        segments, start = [], 0
        for n in lengths:
            segments.append((start, start + n, start, start))
            start += n
        return cls.from_segments(tuple(segments), max_position=max(lengths) - 1)


@dataclass(frozen=True)
class VarlenLayout:
    """One variable-length attention call over a pack: per segment, its query rows and its keys
    (context rows, then its own). Built once per forward on the host, used by every layer.

    `cu_q` / `cu_k` [segments + 1] int32 on the device; `kv_rows` [sum of key counts] int64 on
    the device, the packed row of each key, or None when every segment's keys are its own rows
    (no shared prompt: the keys are the pack as it is)."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    kv_rows: Tensor | None

    @classmethod
    def of(cls, segments: tuple[tuple[int, int, int, int], ...], device: torch.device):
        """The layout of packed `segments` (contiguous, in row order) on `device`."""
        a = segment_arrays(segments)
        to = to_device
        return cls(
            cu_q=to(torch.from_numpy(a.cu_q), device),
            cu_k=to(torch.from_numpy(a.cu_k), device),
            max_q=int(a.q_len.max()),
            max_k=int(a.k_len.max()),
            kv_rows=None if a.kv_rows is None else to(torch.from_numpy(a.kv_rows), device),
        )


@dataclass(frozen=True)
class Piece:
    """Contiguous rows [start, end) of a pack attended by one call: one long document through
    cuDNN (`layout` None), or the documents between long ones in one varlen call over
    `layout` (its cumulative lengths counted from `start`)."""

    start: int
    end: int
    layout: VarlenLayout | None


def long_document_pieces(
    segments: tuple[tuple[int, int, int, int], ...], device: torch.device
) -> tuple[Piece, ...]:
    """A pack of plain documents cut into pieces (see `Piece`) at each document of
    LONG_DOCUMENT rows or more; () when it holds none, or a segment with a context (a shared
    prompt's responses read rows outside their own)."""
    if any(c0 != c1 for _, _, c0, c1 in segments):
        return ()
    if all(end - start < LONG_DOCUMENT for start, end, _, _ in segments):
        return ()
    pieces: list[Piece] = []
    short: list[tuple[int, int, int, int]] = []

    def close_short() -> None:
        if short:
            first = short[0][0]
            shifted = tuple((a - first, b - first, a - first, a - first) for a, b, _, _ in short)
            pieces.append(Piece(first, short[-1][1], VarlenLayout.of(shifted, device)))
            short.clear()

    for segment in segments:
        start, end = segment[0], segment[1]
        if end - start >= LONG_DOCUMENT:
            close_short()
            pieces.append(Piece(start, end, None))
        else:
            short.append(segment)
    close_short()
    return tuple(pieces)


@dataclass(frozen=True)
class SegmentArrays:
    """Host arrays of a varlen call over packed segments: per segment its query and key counts
    and their cumulative sums (int32, as flash attention takes them), and the packed row of
    every key (int64, None when every segment's keys are its own rows)."""

    q_len: np.ndarray
    k_len: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    kv_rows: np.ndarray | None


def segment_arrays(segments: tuple[tuple[int, int, int, int], ...]) -> SegmentArrays:
    """Query and key bookkeeping of packed `segments` (see `SegmentArrays`)."""
    q_len = np.array([end - start for start, end, _, _ in segments], dtype=np.int64)
    ctx_len = np.array([c1 - c0 for _, _, c0, c1 in segments], dtype=np.int64)
    k_len = q_len + ctx_len
    kv_rows = None
    if ctx_len.any():
        kv_rows = np.concatenate(
            [np.r_[c0:c1, start:end] for start, end, c0, c1 in segments]
        ).astype(np.int64)
    return SegmentArrays(
        q_len=q_len,
        k_len=k_len,
        cu_q=np.concatenate(([0], np.cumsum(q_len))).astype(np.int32),
        cu_k=np.concatenate(([0], np.cumsum(k_len))).astype(np.int32),
        kv_rows=kv_rows,
    )


@cache
def varlen_attention() -> Callable[..., Tensor] | None:
    """torch's variable-length flash attention as `f(q, k, v, cu_q, cu_k, max_q, max_k, *,
    scale)` with causal (bottom-right) masking and grouped query heads, or None where this
    torch has none. Its keyword for causal masking changed across releases (`is_causal` in
    some, `window_size=(-1, 0)` in others): both are accepted here."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    fixed: dict = {}
    if "is_causal" in params:
        fixed["is_causal"] = True
    elif "window_size" in params:
        fixed["window_size"] = (-1, 0)
    else:
        return None
    if "enable_gqa" in params:
        fixed["enable_gqa"] = True

    def call(q, k, v, cu_q, cu_k, max_q, max_k, *, scale):
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **fixed)

    return call


def uses_varlen(query: Tensor) -> bool:
    """Whether a pack of these queries goes through one varlen flash-attention call (CUDA,
    16-bit, head dim flash supports, a torch that has the op)."""
    return varlen_supported(query.device, query.dtype, query.shape[-1])


def varlen_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention of this device, dtype and head dim runs as one varlen call per layer."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim <= 256
        and head_dim % 8 == 0
        and varlen_attention() is not None
    )


LONG_DOCUMENT = 4096  # rows from which a one-document pack takes the cuDNN path
LONG_BUCKET = 1024  # its length is padded up to a multiple of this
_CUDNN_FAILED: list[str] = []  # set by a cuDNN call that raised: varlen for the rest of the run
_LATENT_FAILED: list[str] = []  # set by the latent attention kernel raising: varlen from then on


@cache
def cudnn_long_documents(device: torch.device, dtype: torch.dtype, dq: int, dv: int) -> bool:
    """Whether SDPA's cuDNN kernel runs causal attention of one long document with these head
    sizes on `device` and agrees with the varlen flash kernel (checked once)."""
    attend = varlen_attention()
    if device.type != "cuda" or attend is None or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    rows, heads = LONG_BUCKET + 77, 2
    q, k = (torch.randn(rows, heads, dq, generator=gen, device=device, dtype=dtype) for _ in "qk")
    v = torch.randn(rows, heads, dv, generator=gen, device=device, dtype=dtype)
    try:
        got = _cudnn_causal(q, k, v, scale=None)
    except RuntimeError:  # no cuDNN attention for these sizes in this build
        return False
    if dv != dq:  # the varlen kernel takes one head size: pad v for the reference
        v = nn.functional.pad(v, (0, dq - dv))
    cu = torch.tensor([0, rows], dtype=torch.int32, device=device)
    want = attend(q, k, v, cu, cu, rows, rows, scale=None)[..., :dv].reshape(rows, -1)
    return bool(torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2))


def _cudnn_causal(
    query: Tensor, key: Tensor, value: Tensor, *, scale, backend=SDPBackend.CUDNN_ATTENTION
) -> Tensor:
    """Causal attention of one document [s, heads, d] through SDPA's cuDNN kernel (`backend`:
    another, for the CPU test of the padding), the length padded to a multiple of
    LONG_BUCKET: [s, heads x d_v]."""
    s = query.shape[0]
    pad = -s % LONG_BUCKET
    q, k, v = (
        nn.functional.pad(t, (0, 0, 0, 0, 0, pad)).permute(1, 0, 2)[None]
        for t in (query, key, value)
    )
    with sdpa_kernel([backend]):
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out[0, :, :s].transpose(0, 1).reshape(s, -1)


# SDPA backends for the per-run path: cuDNN builds a plan per new sequence length (see the
# module doc), so it is left out; flash, memory-efficient and math kernels plan nothing.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_runs(
    segments: tuple[tuple[int, int, int, int], ...],
) -> list[tuple[int, int, int, int, int]]:
    """The SDPA calls a pack needs: (start, end, documents, context_start, context_end).

    Adjacent context-free segments of one length form one run (`documents` of them, attended
    as a batch); a segment with a context is a run of its own with `documents` = 0."""
    runs: list[tuple[int, int, int, int, int]] = []
    for start, end, c0, c1 in segments:
        if c0 != c1:
            runs.append((start, end, 0, c0, c1))
            continue
        if runs:
            r0, r1, docs, _, _ = runs[-1]
            if docs and r1 == start and (r1 - r0) // docs == end - start:
                runs[-1] = (r0, end, docs + 1, r0, r0)
                continue
        runs.append((start, end, 1, start, start))
    return runs


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [rows, heads, dim] rotated by its rows' angles, cos and sin [rows, rot / 2] fp32
    (rotate-half layout over the first `rot` dims, the rest passed through). One fused kernel
    on CUDA (consumer/kernels/rope.py); elsewhere megatron's arithmetic in x's dtype."""
    rot = 2 * cos.shape[-1]
    fused = kernels.load(x.device)
    if fused is not None and rot == x.shape[-1]:
        return fused.rope(x, cos, sin)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., rot:]), dim=-1)


class SdpaCoreAttention(nn.Module):
    """Causal attention through SDPA; drop-in for megatron's core_attention submodule."""

    def __init__(
        self, *, config, softmax_scale=None, value_dim: int | None = None, **_unused
    ) -> None:  # megatron builder kwargs
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        # v's own head size where the caller hands it zero-padded to q's (latent attention,
        # for the varlen kernel): the cuDNN path attends at this width, and the output of a
        # pack cut into pieces is [rows, heads x value_dim]
        self.value_dim = value_dim

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        /,
        *,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SdpaCoreAttention does not support attention_bias")
        if isinstance(packed_seq_params, TreeBounds):
            if packed_seq_params.rope is not None:
                cos, sin = packed_seq_params.rope
                query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
            return self.attend_rotated(query, key, value, packed_seq_params)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            raise ValueError("thd batches need TreeBounds (segments on the host)")
        # sbhd: [s, b, heads, dim] -> [b, heads, s, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def attend_rotated(self, query: Tensor, key: Tensor, value: Tensor, bounds: TreeBounds):
        """Attention of a packed batch whose q and k are rotated already ([tokens, heads, d]):
        one varlen flash call where it runs, else SDPA per run of documents."""
        if uses_varlen(query):
            return self._forward_varlen(query, key, value, bounds)
        return self._forward_tree(query, key, value, bounds.segments)

    def _forward_varlen(self, query: Tensor, key: Tensor, value: Tensor, bounds: TreeBounds):
        # thd: [tokens, heads, dim]; one flash call for the whole pack, whatever its lengths.
        if bounds.varlen is None:  # the first layer of this forward builds it for the rest
            bounds.varlen = VarlenLayout.of(bounds.segments, query.device)
        lay = bounds.varlen
        if self._long_documents(query, key, self.value_dim or value.shape[-1], bounds):
            try:
                return self.attend_pieces(query, key, value, bounds.pieces or ())
            except RuntimeError as exc:  # a length the probe did not meet: flash from now on
                _CUDNN_FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                log.warning("attention.cudnn_off", rows=query.shape[0], error=_CUDNN_FAILED[0])
        if lay.kv_rows is None and self._latent_kernel_serves(query, key, bounds):
            try:
                return self._attend_latent(query, key, value, bounds)
            except Exception as exc:  # noqa: BLE001 - a GPU it does not compile for: flash
                _LATENT_FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                log.warning("attention.latent_kernel_off", error=_LATENT_FAILED[0])
        if lay.kv_rows is not None:  # responses see their prompt: gather keys per segment
            key, value = key.index_select(0, lay.kv_rows), value.index_select(0, lay.kv_rows)
        attend = varlen_attention()
        assert attend is not None  # uses_varlen checked it
        out = attend(
            query, key, value, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, scale=self.softmax_scale
        )
        return out.reshape(query.shape[0], -1)

    def _latent_kernel_serves(self, query: Tensor, key: Tensor, bounds: TreeBounds) -> bool:
        """Whether latent attention's own kernel runs this pack of plain documents (see the
        module doc): v narrower than q/k (`value_dim`), as many key as query heads, sizes and
        dtype it takes, no CUDA graph recording (its tiles are copied from the host)."""
        dv = self.value_dim
        if dv is None or dv >= query.shape[-1] or key.shape[1] != query.shape[1]:
            return False
        if _LATENT_FAILED or torch.cuda.is_current_stream_capturing():
            return False
        if not bounds.segments or bounds.segments[-1][1] != query.shape[0]:
            return False
        fused = kernels.load(query.device)
        return fused is not None and fused.mla_supports(query.shape[-1], dv, query.dtype)

    def _attend_latent(self, query: Tensor, key: Tensor, value: Tensor, bounds: TreeBounds):
        """[rows, heads x value_dim]: the pack through latent attention's kernel, v at its own
        width (a view of the padded v it is handed)."""
        fused = kernels.load(query.device)
        assert fused is not None and self.value_dim is not None  # _latent_kernel_serves
        if bounds.mla_tiles is None:  # the first layer of this forward plans it for the rest
            lengths = [end - start for start, end, _, _ in bounds.segments]
            bounds.mla_tiles = to_device(fused.mla_plan(lengths), query.device)
        scale = self.softmax_scale or query.shape[-1] ** -0.5
        value = value[..., : self.value_dim]
        out = fused.mla_attention(query, key, value, bounds.mla_tiles, scale=scale)
        return out.reshape(query.shape[0], -1)

    @staticmethod
    def _long_documents(query: Tensor, key: Tensor, dv: int, bounds: TreeBounds) -> bool:
        """Whether the pack holds documents of LONG_DOCUMENT rows or more that cuDNN runs here
        (see the module doc), with as many key as query heads; cuts it into `bounds.pieces`
        at the first layer. `dv`: the width cuDNN takes v at."""
        if query.shape[0] < LONG_DOCUMENT or key.shape[1] != query.shape[1]:
            return False
        if _CUDNN_FAILED or torch.cuda.is_current_stream_capturing():  # graphs: varlen only
            return False
        if not cudnn_long_documents(query.device, query.dtype, query.shape[-1], dv):
            return False
        if bounds.pieces is None:  # the first layer of this forward cuts it for the rest
            bounds.pieces = long_document_pieces(bounds.segments, query.device)
        return bool(bounds.pieces)

    def attend_pieces(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        pieces: tuple[Piece, ...],
        *,
        causal: Callable[..., Tensor] | None = None,
        attend: Callable[..., Tensor] | None = None,
    ) -> Tensor:
        """Attention of a pack cut into `pieces`: each long document through `causal`
        (`_cudnn_causal`), the documents between through `attend` (the varlen kernel); the
        CPU test hands in others. [rows, heads x d_v], d_v `value_dim` where it is set."""
        causal = causal or _cudnn_causal
        attend = attend or varlen_attention()
        assert attend is not None
        dv = self.value_dim or value.shape[-1]
        out = []
        for p in pieces:
            q, k, v = query[p.start : p.end], key[p.start : p.end], value[p.start : p.end]
            if p.layout is None:  # v at its own width: no product with the padding's zeros
                out.append(causal(q, k, v[..., :dv], scale=self.softmax_scale))
                continue
            if v.shape[-1] < q.shape[-1]:  # the varlen kernel takes one head size
                v = nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1]))
            lay = p.layout
            got = attend(
                q, k, v, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, scale=self.softmax_scale
            )
            out.append(got[..., :dv].reshape(p.end - p.start, -1))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _forward_tree(self, query: Tensor, key: Tensor, value: Tensor, segments) -> Tensor:
        # thd: [tokens, heads, dim]. One SDPA call per run of adjacent documents of one length
        # (viewed as a batch, no copy), one per response (its prompt's keys prepended).
        out = torch.empty_like(query)
        for start, end, docs, c0, c1 in attention_runs(segments):
            if docs:
                q, k, v = (
                    t[start:end].view(docs, (end - start) // docs, *t.shape[1:]).transpose(1, 2)
                    for t in (query, key, value)
                )
                dst = out[start:end].view(docs, (end - start) // docs, *out.shape[1:])
                dst.copy_(self._sdpa(q, k, v).transpose(1, 2))
                continue
            q = query[start:end].transpose(0, 1).unsqueeze(0)
            # The first response follows its prompt in the pack: a view, no copy.
            k, v = (
                t[c0:end] if c1 == start else torch.cat((t[c0:c1], t[start:end]))
                for t in (key, value)
            )
            k, v = (t.transpose(0, 1).unsqueeze(0) for t in (k, v))
            out[start:end] = self._sdpa_after_prompt(q, k, v)[0].transpose(0, 1)
        return out.reshape(query.shape[0], -1)

    def _sdpa_after_prompt(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # Imported here: torch.nn.attention.bias imports torch's compiler (torch._dynamo), a
        # second of every consumer's start, for a path only prefix-shared batches take.
        from torch.nn.attention.bias import causal_lower_right

        # Lower-right causal: with r queries and p + r keys, query i sees keys 0..p + i.
        mask = causal_lower_right(q.shape[2], k.shape[2])
        gqa = q.shape[1] != k.shape[1]
        if gqa and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
            # CausalBias hands its kernels no GQA flag: only flash (CUDA, 16-bit) groups query
            # heads itself; elsewhere give every query head its key/value head (megatron
            # groups query heads consecutively, as repeat_interleave does).
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            gqa = False
        with sdpa_kernel(SDPA_BACKENDS):
            return nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.softmax_scale, enable_gqa=gqa
            )

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        gqa = q.shape[1] != k.shape[1]
        with sdpa_kernel(SDPA_BACKENDS):
            return nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa
            )
