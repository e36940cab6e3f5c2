"""What the teacher head's two paths share: the reference math (`consumer/tp_ops/`) and the
fused Triton kernels (`consumer/kernels/`).

A leaf: it imports only torch and the standard library, never either path, so both import it
and neither imports the other (the drivers in `tp_ops.drivers` pick a path per call). It holds
the vocabulary shard of a rank, the sampling blocks, the constants of the SplitMix64 hash and
of the exp that the samples are defined with (`tp_ops.sampling_hash`, `tp_ops.sampling_exp`),
the (value desc, id asc) order of candidates, and `LocalReduction`, what either path hands the
exchange.

Shape legend (suffixes on tensor names):
    R  rows of one chunk
    W  target ids per row (may be 0)
    K  top-k entries per row (may be 0)
    N  samples per row (may be 0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "EXP2_COEFFS",
    "EXP2_FLOOR",
    "LOG2E_F32",
    "MIX64_M1",
    "MIX64_M2",
    "NEG_INF",
    "SAMPLE_BLOCK",
    "SENTINEL_ID",
    "SPLITMIX_GAMMA",
    "LocalReduction",
    "VocabShard",
    "block_layout",
    "order_key",
    "signed64",
]

# Columns per sampling block: a sample first picks a block (by its probability mass), then a
# column inside it. Blocks are aligned to global ids; vocabulary shards padded to a multiple of
# it per rank (Megatron's default of 128 does) cut no block, so samples do not depend on TP.
SAMPLE_BLOCK = 128

# Stand-in id for a missing candidate: above every real id, so it loses every tie.
SENTINEL_ID = (1 << 31) - 1
NEG_INF = float("-inf")

# SplitMix64 (unsigned 64-bit words): the increment (golden ratio) and mix64's multipliers.
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
MIX64_M1 = 0xBF58476D1CE4E5B9
MIX64_M2 = 0x94D049BB133111EB

# 2**f on [0, 1] as a degree-5 polynomial (Horner, highest degree first), coefficients exact in
# fp32: a least-squares fit of the relative error at Chebyshev nodes, rounded to fp32. The
# largest relative error of the fp32 evaluation is 1.6e-7.
EXP2_COEFFS = (
    float.fromhex("0x1.ebd7dcp-10"),
    float.fromhex("0x1.26ab44p-7"),
    float.fromhex("0x1.c94e96p-5"),
    float.fromhex("0x1.ebd624p-3"),
    float.fromhex("0x1.62e4f2p-1"),
    float.fromhex("0x1.fffffep-1"),
)
LOG2E_F32 = float.fromhex("0x1.715476p+0")  # log2(e) rounded to fp32
# Below 2**-92 (y < -63.8) a term is 0: next to the block's largest term, 1, it is far below
# the fp64 sum's rounding, and every step above stays clear of fp32 denormals.
EXP2_FLOOR = -92.0


def signed64(value: int) -> int:
    """The 64-bit pattern of `value` as a signed number (what torch int64 scalars and Triton's
    int64 constants take)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def block_layout(start: int, valid: int) -> tuple[int, int]:
    """(offset, blocks) for a shard's `valid` real columns from global id `start`: shifted
    right by offset = start mod SAMPLE_BLOCK they fill `blocks` sampling blocks, local column
    c lying in block (c + offset) // SAMPLE_BLOCK (the first and last may be partial)."""
    offset = start % SAMPLE_BLOCK
    return offset, -(-(offset + valid) // SAMPLE_BLOCK)


def order_key(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering (value descending, then id ascending) for fp32 values, int ids."""
    # +0.0 folds -0.0 into +0.0 so equal floats share a key and the id decides.
    bits = (values + 0.0).view(torch.int32).to(torch.int64)
    # Flipping the magnitude bits of negative floats makes the signed integer order the float
    # order.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered << 32) | (0xFFFFFFFF - ids.to(torch.int64))


@dataclass(frozen=True)
class VocabShard:
    """This rank's logits columns: global ids [start, start + size); ids >= vocab_size are padding.

    The padded vocabulary is split into equal contiguous shards in rank order, so the padding is
    a suffix of the last shard(s) and `valid_size` columns at the front of a shard are real.
    Build one with `tp_ops.vocab_shard`.
    """

    start: int
    size: int
    vocab_size: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.size < 1 or self.vocab_size < 1:
            raise ValueError(
                f"VocabShard needs start >= 0, size >= 1 and vocab_size >= 1, got {self}"
            )

    @property
    def end(self) -> int:
        """One past the last global id of the shard (padding included)."""
        return self.start + self.size

    @property
    def valid_size(self) -> int:
        """How many leading columns of the shard are real vocabulary ids."""
        return max(0, min(self.size, self.vocab_size - self.start))


class LocalReduction(NamedTuple):
    """What one rank contributes per row before the exchange (`tp_ops.exchange`).

    Sums are relative to the row's finite local max (0 when it has none) and leave out the
    local top-k candidates, which travel themselves. `overflow_R` (fused kernels only) marks
    rows whose result the kernels could not guarantee; None from the reference path.
    """

    stats_R3: torch.Tensor  # fp32 [R, 3]: local max, rest sum of exp, rest sum of exp * shift
    tz_RW: torch.Tensor  # fp32, tempered logits of the targets this rank owns, -inf elsewhere
    cand_val_RK: torch.Tensor  # fp32
    cand_id_RK: torch.Tensor  # int64, global ids
    skey_RN: torch.Tensor  # fp32, best Gumbel key per sample on this shard
    sid_RN: torch.Tensor  # int64, its global id
    sz_RN: torch.Tensor  # fp32, its tempered logit
    overflow_R: torch.Tensor | None = None  # bool
