"""Fused Triton kernels for the teacher head on CUDA.

`consumer.tp_ops` dispatches each row chunk here when its logits live on a CUDA device and
Triton imports; everywhere else (and whenever `tp_ops.FUSED_KERNELS` is False) the PyTorch
reference path in tp_ops runs, and it stays the definition of every output:

- `gumbel.gumbel_argmax`: the Gumbel-max samples, bit for bit what the reference draws (same
  SplitMix64 hash, same fp64 noise rounded once to fp32, same tie rule), in one pass over the
  logits chunk instead of ~30 full-size elementwise PyTorch passes per sample;
- `rowstats.local_reduce`: everything one rank contributes for a chunk (max, rest sums,
  entropy sums, top-k candidates, target logits, samples) from the bf16/fp16/fp32 logits
  without materialising an fp32 [R, V] copy.

Importing this package raises ImportError when Triton is missing; tp_ops treats that as "use
the reference path".
"""

from __future__ import annotations

import triton  # noqa: F401 - fail the import here when Triton is missing

from consumer.kernels.gumbel import gumbel_argmax
from consumer.kernels.rowstats import local_reduce

__all__ = ["gumbel_argmax", "local_reduce"]
