"""GraphedForward's bookkeeping on the CPU (no graphs are recorded here: the CUDA side is in
tests/gpu/test_forward.py): eager results, and a bounded memory of the layouts it has seen."""

from __future__ import annotations

import numpy as np
import torch

from consumer.forward import graphs
from consumer.forward.attention import TreeBounds, segment_arrays
from consumer.forward.graphs import GraphedForward, eager_forward
from consumer.forward.model import TINY, build_model


def test_layouts_seen_are_remembered_within_a_bound(layout, monkeypatch) -> None:
    monkeypatch.setattr(graphs, "SEEN_LAYOUTS", 3)
    model = build_model(TINY, layout)
    forward = GraphedForward(model, max_graphs=0)  # off: counts sightings, runs eagerly
    gen = torch.Generator().manual_seed(0)
    for n in (10, 11, 12, 13, 10):
        ids = torch.randint(0, TINY.vocab_size, (2 * n,), generator=gen)
        pos = torch.cat([torch.arange(n), torch.arange(n)])
        bounds = TreeBounds.documents([n, n])
        with torch.no_grad():
            got = forward(ids, pos, bounds)
            torch.testing.assert_close(got, eager_forward(model, ids, pos, bounds))
    assert len(forward._seen) == 3 and forward.size == 0 and forward.replays == 0
    assert [segments[0][1] for segments, _ in forward._seen] == [12, 13, 10]


def _documents(lengths: list[int]) -> tuple[tuple[int, int, int, int], ...]:
    return TreeBounds.documents(lengths).segments


def test_a_bucket_pads_rows_segments_and_spans_and_keeps_the_batch_s_layout() -> None:
    segments = _documents([700, 1300, 2001])
    bucket = graphs.Bucket.of(segments)
    rows = 4001
    assert bucket.tokens == graphs.bucket_rows(rows) == 4096  # 128-row steps below 4096
    assert bucket.segments == (*segments, (rows, 4096, rows, rows))  # the padding document
    plain = segment_arrays(bucket.segments)
    slots = len(bucket.cu_q) - 1
    assert slots == 16 and len(bucket.cu_k) == slots + 1
    np.testing.assert_array_equal(bucket.cu_q[: len(plain.cu_q)], plain.cu_q)
    assert (bucket.cu_q[len(plain.cu_q) :] == 4096).all()  # empty segments after
    assert bucket.kv_rows is None and (bucket.max_q, bucket.max_k) == (2048, 4096)


def test_lengths_that_never_repeat_fall_into_few_buckets() -> None:
    """Batches of ~16k tokens of lengths uniform in 512-4096, cut as the consumer cuts them:
    the bucket keys repeat although no two layouts do, and padding stays small."""
    rng = np.random.default_rng(0)
    keys, layouts, padding = set(), set(), []
    for _ in range(300):
        lengths: list[int] = []
        while True:
            n = int(rng.integers(512, 4097))
            if sum(lengths) + n > 16384:
                break
            lengths.append(n)
        bucket = graphs.Bucket.of(_documents(lengths))
        keys.add(bucket.key)
        layouts.add(tuple(lengths))
        padding.append(bucket.tokens / sum(lengths) - 1)
    assert len(layouts) == 300 and len(keys) <= 24
    assert max(padding) < 0.07 and float(np.mean(padding)) < 0.03


def test_a_bucket_of_shared_prompts_gathers_every_segment_s_keys() -> None:
    # a prompt (rows 0-99) and two responses that see it
    segments = ((0, 100, 0, 0), (100, 150, 0, 100), (150, 220, 0, 100))
    bucket = graphs.Bucket.of(segments)
    plain = segment_arrays(bucket.segments)
    assert plain.kv_rows is not None and bucket.kv_rows is not None
    keys = len(plain.kv_rows)
    assert len(bucket.kv_rows) >= keys and len(bucket.kv_rows) >= bucket.tokens
    np.testing.assert_array_equal(bucket.kv_rows[:keys], plain.kv_rows)
    assert bucket.cu_k[-1] == keys and bucket.max_k == len(bucket.kv_rows)


def test_the_padding_document_leaves_every_row_of_the_batch_as_it_was(layout) -> None:
    """The CPU forward (per-segment SDPA) of a batch with its bucket's padding document equals
    the forward without it on the batch's rows: padding attends only to itself."""
    model = build_model(TINY, layout)
    lengths = [37, 90, 15]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY.vocab_size, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    bucket = graphs.Bucket.of(_documents(lengths))
    pad = bucket.tokens - len(ids)
    assert pad > 0
    padded = TreeBounds.from_segments(bucket.segments, max_position=max(lengths) - 1)
    with torch.no_grad():
        want = eager_forward(model, ids, pos, TreeBounds.documents(lengths))
        got = eager_forward(
            model,
            torch.cat([ids, torch.randint(0, TINY.vocab_size, (pad,), generator=gen)]),
            torch.cat([pos, torch.zeros(pad, dtype=torch.long)]),
            padded,
        )
    torch.testing.assert_close(got[: len(ids)], want)
