"""Consumers serving real checkpoints end to end: a Hugging Face checkpoint checked against
transformers, and a TP=2 replica (torchrun, gloo) against TP=1 on the same jobs."""

from __future__ import annotations

import numpy as np
import pytest

from producer import TeacherClient, TeacherRequest
from tests.reference import hf_full_log_softmax
from tests.timing import scaled

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def qwen2_checkpoint(hf_checkpoint):
    return hf_checkpoint("qwen2", "qwen2", seed=3)


def _jobs(vocab: int) -> list[TeacherRequest]:
    rng = np.random.default_rng(5)
    out = []
    for i, n in enumerate((9, 33, 17, 4)):
        ids = rng.integers(0, vocab, size=n)
        out.append(
            TeacherRequest(
                input_ids=ids,
                label_token_ids=rng.integers(0, vocab, size=(n - 1, 2)),
                top_k=4,
                sample_n=3,
                return_entropy=True,
                temperature=0.9 if i % 2 else 1.0,
                seed=100 + i,
            )
        )
    return out


def _with_model(settings, path, tp: int = 1):
    return settings.model_copy(
        update={
            "model": settings.model.model_copy(update={"path": str(path)}),
            "parallel": settings.parallel.model_copy(update={"tp": tp}),
        }
    )


def test_hf_checkpoint_matches_transformers(settings, start_consumer, qwen2_checkpoint) -> None:
    s = _with_model(settings, qwen2_checkpoint)
    start_consumer(s)
    client = TeacherClient(s)
    vocab = client.limits().vocab_size
    assert vocab == 500  # advertised by the consumer from the checkpoint's config
    reqs = _jobs(vocab)
    results = client.wait(client.submit(reqs), timeout=scaled(120))
    for req, res in zip(reqs, results, strict=True):
        assert res.ok, res.error
        assert res.model_version.startswith("qwen2@")
        ref = hf_full_log_softmax(qwen2_checkpoint, req.input_ids, req.temperature)
        rows = np.arange(req.num_tokens - 1)
        np.testing.assert_allclose(res.logprobs, ref[rows, req.input_ids[1:]], atol=1e-4)
        np.testing.assert_allclose(
            res.label_logprobs, np.take_along_axis(ref, req.label_token_ids, 1), atol=1e-4
        )
        np.testing.assert_allclose(res.entropy, -(np.exp(ref) * ref).sum(1), atol=1e-4)


def test_tp2_replica_equals_tp1(settings, start_consumer, qwen2_checkpoint) -> None:
    import uuid

    reqs = _jobs(500)
    runs = {}
    for tp in (1, 2):
        queue = settings.queue.model_copy(update={"name": f"tp{tp}-{uuid.uuid4().hex[:6]}"})
        s = _with_model(settings, qwen2_checkpoint, tp=tp).model_copy(update={"queue": queue})
        proc = start_consumer(s, nproc=tp)
        client = TeacherClient(s)
        runs[tp] = client.wait(client.submit(reqs), timeout=scaled(180))
        assert client.consumers()[next(iter(client.consumers()))]["layout"].startswith(f"tp{tp}")
        proc.terminate()
        proc.wait(timeout=scaled(60))
        # torchrun itself exits non-zero on SIGTERM after forwarding it; the replica drained.
        assert '"consumer.stopped"' in proc.log_path.read_text()
    for a, b in zip(runs[1], runs[2], strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
        np.testing.assert_allclose(a.label_logprobs, b.label_logprobs, atol=2e-5)
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=2e-5)
        np.testing.assert_array_equal(a.topk_token_ids, b.topk_token_ids)
        np.testing.assert_allclose(a.entropy, b.entropy, atol=2e-5)
        # Same seeds: the same samples whatever the TP size.
        np.testing.assert_array_equal(a.sampled_token_ids, b.sampled_token_ids)
