"""Fused Triton kernels on CUDA: the teacher head, and two of the forward's elementwise steps.

`consumer.tp_ops` dispatches each row chunk here when its logits live on a CUDA device and
Triton imports; everywhere else (and whenever `tp_ops.FUSED_KERNELS` is False) the PyTorch
reference path in tp_ops runs, and it stays the definition of every output:

- `rowstats.local_reduce`: everything one rank contributes (max, rest sums, entropy sums,
  top-k candidates, target logits, samples) from the bf16/fp16/fp32 logits, chunk by chunk,
  without materialising an fp32 [R, V] copy: one pass over each chunk plus a read of the few
  blocks where the top-k lies;
- `rowstats.gumbel_argmax`: that pass's samples alone: the two-level Gumbel-max (a block of
  ids by its mass, then an id inside it), bit for bit what the reference draws (same
  SplitMix64 hash, same fp32 exp and fp64 noise, same tie rules; helpers in `gumbel`);
- `swiglu.swiglu` and `rope.rope`: the MLP's SwiGLU and the rotary embedding of q and k in
  one pass each (`consumer.model.TeacherMLP`, `consumer.attention.apply_rope`; PyTorch
  elsewhere). They do not follow `FUSED_KERNELS`, which switches the head only.

`tp_ops.triton_kernels(device)` returns this package where it runs. Importing this package
raises ImportError when Triton is missing; tp_ops treats that as "use the reference path".
"""

from __future__ import annotations

import triton  # noqa: F401 - fail the import here when Triton is missing

from consumer.kernels.rope import rope
from consumer.kernels.rowstats import gumbel_argmax, local_reduce
from consumer.kernels.swiglu import swiglu

__all__ = ["gumbel_argmax", "local_reduce", "rope", "swiglu"]
