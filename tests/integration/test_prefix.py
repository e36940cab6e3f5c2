"""Shared-prefix packing end to end: GRPO-like groups through a real consumer (TP 1 and 2).

The token budget is set so that the jobs fit one micro-batch only if each prompt is computed
once; the consumer's log must show that one batch, and every result must match the full-vocab
reference of the job scored alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from producer import TeacherClient, TeacherRequest
from tests.reference import tiny_full_log_softmax
from tests.timing import scaled

pytestmark = pytest.mark.integration
VOCAB = 1000  # the tiny preset's
ATOL = 2e-4  # as test_pipeline: the reference is float64, the consumer float32


def _grpo_requests(rng: np.random.Generator) -> list[TeacherRequest]:
    reqs = []
    # A short prompt grouped by the producer's prefix_id, a long one found by its tokens.
    for p, prefix_id in ((20, "grpo-0"), (100, None)):
        prompt = rng.integers(0, VOCAB, size=p)
        for r in range(4):
            response = rng.integers(0, VOCAB, size=int(rng.integers(5, 20)))
            reqs.append(
                TeacherRequest(
                    input_ids=np.concatenate([prompt, response]),
                    top_k=4 if r % 2 else 0,
                    sample_n=2,
                    return_entropy=r < 2,
                    temperature=0.8,
                    seed=r // 2,  # pairs agree: their prompt rows share the head too
                    prefix_id=prefix_id,
                    metadata={"r": r},
                )
            )
    reqs.append(TeacherRequest(input_ids=rng.integers(0, VOCAB, size=30), top_k=3))
    return reqs


def _batches(log_text: str) -> list[dict]:
    events = []
    for line in log_text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "batch.done":
            events.append(record)
    return events


@pytest.mark.parametrize("tp", [1, 2])
def test_jobs_sharing_prompts_run_in_one_batch_and_match_the_reference(
    settings, start_consumer, tp
) -> None:
    reqs = _grpo_requests(np.random.default_rng(tp))
    unshared = sum(r.num_tokens for r in reqs)
    budget = unshared - 3 * 20 - 3 * 100  # each prompt once: exactly one micro-batch
    assert unshared > 2 * budget  # without sharing they need at least three
    s = settings.model_copy(
        update={
            "consumer": settings.consumer.model_copy(update={"token_budget": budget}),
            "parallel": settings.parallel.model_copy(update={"tp": tp}),
        }
    )
    client = TeacherClient(s)
    ids = client.submit(reqs)  # all queued before the consumer starts: one batching window
    proc = start_consumer(s, nproc=tp)
    results = client.wait(ids, timeout=scaled(180))
    assert [b["jobs"] for b in _batches(proc.log_path.read_text())] == [len(reqs)]
    for req, res in zip(reqs, results, strict=True):
        assert res.ok, res.error
        assert res.metadata == req.metadata
        ref = tiny_full_log_softmax(req.input_ids, req.temperature)
        rows = np.arange(req.num_tokens - 1)
        np.testing.assert_allclose(res.logprobs, ref[rows, req.input_ids[1:]], atol=ATOL)
        if req.top_k:
            order = np.argsort(-ref, axis=1)[:, : req.top_k]
            want = np.take_along_axis(ref, order, axis=1)
            np.testing.assert_allclose(res.topk_logprobs, want, atol=ATOL)
        if req.sample_n:
            got = np.take_along_axis(ref, res.sampled_token_ids, axis=1)
            np.testing.assert_allclose(res.sampled_logprobs, got, atol=ATOL)
        if req.return_entropy:
            np.testing.assert_allclose(res.entropy, -(np.exp(ref) * ref).sum(axis=1), atol=ATOL)
    # Jobs of one group with the same seed draw the same samples on the prompt rows they
    # share, and their own on their responses (keyed by seed and position, not by batch).
    a, b = results[0], results[1]
    p = 20
    np.testing.assert_array_equal(a.sampled_token_ids[:p], b.sampled_token_ids[:p])


def test_groups_submitted_one_at_a_time_to_an_idle_consumer_share_their_prompt(
    settings, start_consumer
) -> None:
    """A trainer sends one GRPO group per submit call; the consumer is already waiting on
    the stream. Each call reaches the stream in one transaction, so the consumer never takes
    a group's first response before the rest arrive: every prompt is computed once."""
    proc = start_consumer(settings)  # ready and blocked on the stream before any submit
    client = TeacherClient(settings)
    rng = np.random.default_rng(5)
    prompt_len, responses, groups = 80, 6, 4  # prompts found by tokens: >= 64 (prefix.py)
    ids = []
    for _ in range(groups):
        prompt = rng.integers(0, VOCAB, size=prompt_len)
        group = [
            TeacherRequest(input_ids=np.concatenate([prompt, rng.integers(0, VOCAB, size=int(n))]))
            for n in rng.integers(5, 30, size=responses)
        ]
        ids += client.submit(group)
        client.wait(ids[-responses:], timeout=scaled(60))  # the next group comes after this one's
    assert all(r.ok for r in client.wait(ids, timeout=scaled(60)))
    batches = _batches(proc.log_path.read_text())
    assert [b["jobs"] for b in batches] == [responses] * groups
    # Each response after a group's first reuses its prompt's rows.
    saved = sum(b["prefix_tokens_saved"] for b in batches)
    assert saved == groups * (responses - 1) * prompt_len
