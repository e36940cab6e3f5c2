"""Core attention for prefill-only teachers: torch scaled_dot_product_attention, no [s, s] mask.

megatron-core's local DotProductAttention materialises a [b, heads, s, s] score tensor and a mask;
this module plugs into the same slot of a megatron layer spec (`SelfAttentionSubmodules.
core_attention`) and calls SDPA with `is_causal=True` instead, so flash / memory-efficient kernels
run on the GPU and nothing quadratic is allocated on the CPU beyond what SDPA itself needs.

Packed batches (several documents in one row) arrive in megatron's `thd` layout with
`DocumentBounds`: each document attends causally to itself only, one SDPA call per document.

Batches with shared prompts (`consumer/prefix.py`) arrive with `TreeBounds`: a response
segment attends to its prompt's rows and causally to itself. Per response that is one SDPA
call with keys = prompt ++ response and a lower-right-aligned causal mask of shape [r, p + r]
(`torch.nn.attention.bias.causal_lower_right`): query i of the response sees every prompt key
and response keys 0..i. On CUDA that mask is never materialised (flash / memory-efficient
kernels take it as a flag); elsewhere SDPA gets the [r, p + r] boolean mask, never a
[total, total] one. The prompt's keys are concatenated per response rather than attended
separately and merged, because SDPA does not return the log-sum-exp a merge would need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right


@dataclass
class DocumentBounds(PackedSeqParams):
    """PackedSeqParams plus the document boundaries as host integers (no device sync per layer).

    `bounds` holds the cumulative token offsets `[0, len_0, len_0 + len_1, ..., total]`.
    """

    bounds: tuple[int, ...] = ()

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device) -> DocumentBounds:
        """Build thd packing parameters for documents of the given lengths, in order."""
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        longest = max(lengths)
        return cls(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            bounds=tuple(bounds),
        )


@dataclass
class TreeBounds(PackedSeqParams):
    """thd packing where a segment may also see an earlier one (its shared prompt) in full.

    `segments` holds host integers (start, end, context_start, context_end) over packed rows;
    an empty context means plain causal attention within the segment. Rotary embeddings come
    from the forward's explicit position ids (positions continue from the prompt in each
    response), not from the row index within a segment: `TeacherGPTModel` gathers the rotary
    table at those ids, and `cu_seqlens` spans the whole pack as one sequence so that megatron
    applies row t's angles to row t whatever its segment.
    """

    segments: tuple[tuple[int, int, int, int], ...] = ()

    @classmethod
    def from_segments(
        cls, segments: tuple[tuple[int, int, int, int], ...], *, max_position: int,
        device: torch.device,
    ) -> TreeBounds:  # fmt: skip
        """thd parameters for packed segments; `max_position` is the largest position id."""
        total = segments[-1][1]
        cu = torch.tensor([0, total], dtype=torch.int32, device=device)
        return cls(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            # Also the length of megatron's own rotary table, which the model replaces.
            max_seqlen_q=max_position + 1,
            max_seqlen_kv=max_position + 1,
            segments=segments,
        )


class SdpaCoreAttention(nn.Module):
    """Causal attention through SDPA; drop-in for megatron's core_attention submodule."""

    def __init__(self, *, config, softmax_scale=None, **_unused) -> None:  # megatron builder kwargs
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale

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
            return self._forward_tree(query, key, value, packed_seq_params.segments)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._forward_packed(query, key, value, packed_seq_params)
        # sbhd: [s, b, heads, dim] -> [b, heads, s, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _forward_packed(self, query: Tensor, key: Tensor, value: Tensor, params) -> Tensor:
        # thd: [tokens, heads, dim]; one causal SDPA per document.
        bounds = getattr(params, "bounds", None) or tuple(params.cu_seqlens_q.tolist())
        out = torch.empty_like(query)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            out[start:end] = self._sdpa(q, k, v)[0].transpose(0, 1)
        return out.reshape(query.shape[0], -1)

    def _forward_tree(self, query: Tensor, key: Tensor, value: Tensor, segments) -> Tensor:
        # thd: [tokens, heads, dim]; one SDPA per segment, prompt keys prepended to responses'.
        out = torch.empty_like(query)
        for start, end, c0, c1 in segments:
            q = query[start:end].transpose(0, 1).unsqueeze(0)
            if c0 == c1:
                k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (key, value))
                out[start:end] = self._sdpa(q, k, v)[0].transpose(0, 1)
                continue
            # The first response follows its prompt in the pack: a view, no copy.
            k, v = (
                t[c0:end] if c1 == start else torch.cat((t[c0:c1], t[start:end]))
                for t in (key, value)
            )
            k, v = (t.transpose(0, 1).unsqueeze(0) for t in (k, v))
            out[start:end] = self._sdpa_after_prompt(q, k, v)[0].transpose(0, 1)
        return out.reshape(query.shape[0], -1)

    def _sdpa_after_prompt(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # Lower-right causal: with r queries and p + r keys, query i sees keys 0..p + i.
        mask = causal_lower_right(q.shape[2], k.shape[2])
        gqa = q.shape[1] != k.shape[1]
        if gqa and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
            # CausalBias hands its kernels no GQA flag: only flash (CUDA, 16-bit) groups query
            # heads itself; elsewhere give every query head its key/value head (megatron
            # groups query heads consecutively, as repeat_interleave does).
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            gqa = False
        return nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.softmax_scale, enable_gqa=gqa
        )

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
