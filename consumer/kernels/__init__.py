"""Fused Triton kernels on CUDA: the teacher head, and two of the forward's elementwise steps.

The PyTorch reference path (`consumer/tp_ops/`) stays the definition of every head output;
these kernels compute the same on CUDA, faster:

- `rowstats.local_reduce`: everything one rank contributes (max, rest sums, entropy sums,
  top-k candidates, target logits, samples) from the bf16/fp16/fp32 logits, chunk by chunk,
  without materialising an fp32 [R, V] copy: one pass over each chunk plus a read of the few
  blocks where the top-k lies;
- `rowstats.gumbel_argmax`: that pass's samples alone: the two-level Gumbel-max (a block of
  ids by its mass, then an id inside it), bit for bit what the reference draws (same
  SplitMix64 hash, same fp32 exp and fp64 noise, same tie rules; helpers in `gumbel`);
- `swiglu.swiglu` and `rope.rope`: the MLP's SwiGLU and the rotary embedding of q and k in
  one pass each (`consumer.forward.model.TeacherMLP`, `consumer.forward.attention.apply_rope`;
  PyTorch elsewhere);
- `mla_rope.mla_qkv`: latent attention's query, key and value rotated, concatenated and
  padded to one head size in one pass (`consumer.forward.mla.TeacherMLA`);
- `mla_attention.mla_attention`: latent attention's packed causal attention with v at its
  own head size (`consumer.forward.attention.SdpaCoreAttention`; 1.8x the varlen flash call
  it replaces there);
- `fp8_quant.quantize_activations_padded`: an FP8 linear's input quantized per token and
  128-channel group, padded and laid out as cuBLAS's block-scaled GEMM reads it
  (`consumer.forward.fp8_gemm`).

Imports run one way: the kernels import the shared leaf `consumer.head_common`, never
`consumer.tp_ops`; the callers (`tp_ops.drivers`, `model`, `attention`) ask `load(device)`
for the kernels and take their PyTorch path when it returns None. This file imports no
Triton itself: the submodules do, and `load` turns their ImportError into None.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from consumer.head_common import LocalReduction

__all__ = ["Kernels", "load", "triton_kernels"]


@dataclass(frozen=True)
class Kernels:
    """The fused kernels' entry points (see the submodules for their arguments)."""

    local_reduce: Callable[..., LocalReduction | None]  # rowstats.local_reduce
    gumbel_argmax: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    swiglu: Callable[[torch.Tensor], torch.Tensor]
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    fp8_quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    mla_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    mla_attention: Callable[..., torch.Tensor]  # mla_attention.mla_attention
    mla_plan: Callable[..., torch.Tensor]  # mla_attention.plan
    mla_supports: Callable[[int, int, torch.dtype], bool]  # mla_attention.supports


def load(device: torch.device) -> Kernels | None:
    """The kernels for tensors on `device`, or None where they do not run (not CUDA, or no
    Triton): the caller's PyTorch path serves then."""
    if device.type != "cuda":
        return None
    return triton_kernels()


@functools.cache
def triton_kernels() -> Kernels | None:
    """The kernels whatever the device (Triton's CPU interpreter, TRITON_INTERPRET=1, runs
    them on CPU tensors), or None when Triton does not import. Loaded once."""
    try:
        from consumer.kernels import fp8_quant, mla_attention, mla_rope, rope, rowstats, swiglu
    except ImportError:  # no Triton here: the reference path serves CUDA as well
        return None
    return Kernels(
        local_reduce=rowstats.local_reduce,
        gumbel_argmax=rowstats.gumbel_argmax,
        swiglu=swiglu.swiglu,
        rope=rope.rope,
        fp8_quantize=fp8_quant.quantize_activations_padded,
        mla_qkv=mla_rope.mla_qkv,
        mla_attention=mla_attention.mla_attention,
        mla_plan=mla_attention.plan,
        mla_supports=mla_attention.supports,
    )
