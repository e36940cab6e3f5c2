"""Core attention for prefill-only teachers: torch scaled_dot_product_attention, no [s, s] mask.

megatron-core's local DotProductAttention materialises a [b, heads, s, s] score tensor and a mask;
this module plugs into the same slot of a megatron layer spec (`SelfAttentionSubmodules.
core_attention`) and calls SDPA with `is_causal=True` instead, so flash / memory-efficient kernels
run on the GPU and nothing quadratic is allocated on the CPU beyond what SDPA itself needs.

Packed batches (several documents in one row) arrive in megatron's `thd` layout with
`DocumentBounds`: each document attends causally to itself only, one SDPA call per document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor, nn


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

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
