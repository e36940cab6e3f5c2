"""Teacher outputs from tensor-parallel, vocabulary-sharded logits, never gathering the vocabulary.

Each tensor-parallel (TP) rank holds the logits of one contiguous slice of the padded vocabulary.
From those slices this package computes, per scored position (a "row"): log-probs of given
target ids, the top-k ids with their true log-probs and the log of the mass outside the top-k,
samples drawn by a two-level Gumbel-max trick from a counter-based hash (see `sampling_hash`),
and the entropy. Every output is taken from the tempered distribution
softmax(logits * inv_temperature), with padded vocabulary columns (ids >= vocab_size) excluded
everywhere.

Chunk by chunk of rows, every rank reduces its own shard in fp32 to a few numbers and
candidates per row; then one all_gather of O(3 + W + 2K + 3N) 32-bit words per row and rank
lets every rank merge the same result. Working memory is O(chunk rows x V + T x (W + K + N));
the full [T, V] logits never need to exist.

Modules, in the order a call passes through them (docs/architecture.md has the picture):
    layout         VocabShard (from consumer.head_common), vocab_shard, HeadCall (the
                   parameters of a call), HeadOutputs, CommStats
    temperature    validate_temperature
    random_source  the counter-based random source of the samples (the definition)
    validation     the checks of a call
    local          the reference local reduction of a row chunk (sampling_exp, samples, top-k)
    exchange       one all_gather of every rank's reduction, and the merge
    drivers        head_from_logits, chunked_head: pick the path (fused kernels or reference)

Pure tensor math: imports only torch, torch.distributed, the standard library, the leaves
`consumer.head_common` and `consumer.transfer` (`to_device`), (in `temperature` only) the
requests' temperature rule `shared.messages.inverse_temperature`, and (in `drivers` only) the
kernels' loader `consumer.kernels`.
This file re-exports the public API; the modules' other names are internal to the package.
"""

from __future__ import annotations

from consumer.head_common import SAMPLE_BLOCK, LocalReduction, VocabShard, block_layout
from consumer.tp_ops.drivers import (
    DEFAULT_CHUNK_ELEMENTS,
    PendingHead,
    chunked_head,
    head_from_logits,
)
from consumer.tp_ops.layout import CommStats, HeadCall, HeadOutputs, vocab_shard
from consumer.tp_ops.local import sampling_exp
from consumer.tp_ops.random_source import sampling_hash, stream_keys, uniform_from_hash
from consumer.tp_ops.temperature import validate_temperature

# Re-exported for the forward modules that still import it from here; it lives in the leaf
# consumer.transfer.
from consumer.transfer import to_device

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "SAMPLE_BLOCK",
    "CommStats",
    "HeadCall",
    "HeadOutputs",
    "LocalReduction",
    "PendingHead",
    "VocabShard",
    "block_layout",
    "chunked_head",
    "head_from_logits",
    "sampling_exp",
    "sampling_hash",
    "stream_keys",
    "to_device",
    "uniform_from_hash",
    "validate_temperature",
    "vocab_shard",
]
