"""Layout and bookkeeping of a head call: which vocabulary columns a rank holds, what a call
returns, what it needs to know about its group, and what its collectives moved.

Shape legend (suffixes on tensor names):
    T  rows (scored positions) of the batch
    W  target ids per row (may be 0)
    K  top-k entries per row (may be 0)
    N  samples per row (may be 0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from consumer.head_common import SENTINEL_ID, VocabShard

__all__ = ["CommStats", "HeadCall", "HeadOutputs", "HeadRequest", "vocab_shard"]


def vocab_shard(*, rank: int, tp_size: int, padded_vocab: int, vocab_size: int) -> VocabShard:
    """The shard of `rank` among `tp_size` equal, contiguous slices of the padded vocabulary."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank must lie in [0, tp_size), got rank={rank} tp_size={tp_size}")
    if padded_vocab % tp_size:
        raise ValueError(
            f"padded_vocab {padded_vocab} is not a multiple of tp_size {tp_size}; pad the "
            "vocabulary to a multiple of the tensor-parallel size"
        )
    if not 1 <= vocab_size <= padded_vocab:
        raise ValueError(
            f"vocab_size must lie in [1, padded_vocab={padded_vocab}], got {vocab_size}"
        )
    if padded_vocab >= SENTINEL_ID:
        raise ValueError(f"padded_vocab {padded_vocab} does not fit the 31-bit id exchange")
    size = padded_vocab // tp_size
    return VocabShard(start=rank * size, size=size, vocab_size=vocab_size)


@dataclass
class CommStats:
    """Per collective kind: calls made and bytes this rank sent and received.

    Pass one as `comm=` to the head functions; it accumulates across calls. Nothing is recorded
    for TP = 1, where no collective runs.
    """

    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)

    def record(self, *, kind: str, sent: int, received: int) -> None:
        """Count one collective of `kind` that moved `sent` and `received` bytes on this rank."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + sent
        self.bytes_received[kind] = self.bytes_received.get(kind, 0) + received


@dataclass(frozen=True)
class HeadOutputs:
    """Per-row teacher outputs; identical on every rank of the TP group.

    topk ids are ordered by descending log-prob, ties by ascending id. entropy_T is None when it
    was not requested; W, K or N of 0 give [T, 0] tensors.
    """

    target_logprobs_TW: torch.Tensor  # fp32
    topk_ids_TK: torch.Tensor  # int64
    topk_logprobs_TK: torch.Tensor  # fp32, normalised over the whole vocabulary
    topk_rest_logprob_T: torch.Tensor  # fp32, log of the mass outside the top-k
    sample_ids_TN: torch.Tensor  # int64
    sample_logprobs_TN: torch.Tensor  # fp32
    entropy_T: torch.Tensor | None  # fp32, nats

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> HeadOutputs:
        """These outputs with `fn` applied to every tensor (an absent entropy stays None)."""
        return HeadOutputs(
            target_logprobs_TW=fn(self.target_logprobs_TW),
            topk_ids_TK=fn(self.topk_ids_TK),
            topk_logprobs_TK=fn(self.topk_logprobs_TK),
            topk_rest_logprob_T=fn(self.topk_rest_logprob_T),
            sample_ids_TN=fn(self.sample_ids_TN),
            sample_logprobs_TN=fn(self.sample_logprobs_TN),
            entropy_T=None if self.entropy_T is None else fn(self.entropy_T),
        )


@dataclass(frozen=True)
class HeadCall:
    """What a head call (`head_from_logits`, `chunked_head`) computes from the logits: the one
    list of the head's parameters. Every rank of `tp_group` passes the same values except its
    own `shard`. `validation.check_inputs` checks them, on the host, before any collective.

    The per-row tensors may live on the logits' device or on the CPU. On the CPU their values
    are checked without a device sync and then copied over asynchronously, so a caller that
    keeps them on the host lets the device run ahead.
    """

    shard: VocabShard
    """This rank's columns of the padded vocabulary (`vocab_shard`)."""
    tp_group: dist.ProcessGroup | None
    """The tensor-parallel group; None for TP = 1."""
    inv_temperature_T: torch.Tensor
    """fp32 [T], 1 / temperature per row (`validate_temperature`)."""
    target_ids_TW: torch.Tensor | None = None
    """int64 [T, W] global ids in [0, vocab_size) whose log-probs are wanted; None: W = 0."""
    top_k: int = 0
    """K <= vocab_size: the top-K ids by descending probability, ties to the lowest id."""
    sample_n: int = 0
    """N samples per row, keyed by `seed_T` and `position_T` (see `sampling_hash`)."""
    seed_T: torch.Tensor | None = None
    """int64 [T], required when sample_n > 0."""
    position_T: torch.Tensor | None = None
    """int64 [T], required when sample_n > 0."""
    want_entropy: bool = False
    """Also return the entropy of the tempered distribution."""
    chunk_rows: int | None = None
    """Rows per chunk (each upcast to fp32); None: about DEFAULT_CHUNK_ELEMENTS / V."""
    comm: CommStats | None = None
    """Records the collectives, if given."""
    fused: bool = True
    """Run the local reduction through the fused kernels where they load for the logits'
    device (CUDA with Triton: `consumer.kernels.load`); False: the reference path everywhere."""


@dataclass(frozen=True)
class HeadRequest:
    """What the local reduction and the exchange of one call need: the shard, the group (rank
    and size derived from `tp_group`, None for TP = 1), the outputs asked for, and where to
    count the collectives."""

    shard: VocabShard
    tp_group: dist.ProcessGroup | None
    rank: int
    tp_size: int
    top_k: int
    sample_n: int
    want_entropy: bool
    comm: CommStats | None
