"""A real consumer (`python -m consumer` under torchrun, gloo) serving a mixture-of-experts
checkpoint through the queue (#23): a Qwen2-MoE replica of two ranks with EP=2 (TP=1, so the
replica group is wider than the TP groups) scores jobs as transformers does."""

from __future__ import annotations

import numpy as np
import pytest

from producer import TeacherClient, TeacherRequest
from tests.reference import hf_full_log_softmax
from tests.timing import scaled

pytestmark = pytest.mark.integration


def test_moe_checkpoint_served_with_expert_parallelism(settings, start_consumer, hf_checkpoint):
    path = hf_checkpoint("qwen2_moe", "qwen2-moe", seed=4, vocab_size=300, decoder_sparse_step=1)
    s = settings.model_copy(
        update={
            "model": settings.model.model_copy(update={"path": str(path)}),
            "parallel": settings.parallel.model_copy(update={"tp": 1, "ep": 2}),
        }
    )
    start_consumer(s, nproc=2)
    client = TeacherClient(s)
    layout = next(iter(client.consumers().values()))["layout"]
    assert layout.startswith("tp1·ep2"), layout
    rng = np.random.default_rng(7)
    reqs = [
        TeacherRequest(
            input_ids=rng.integers(0, 300, size=n), top_k=3, sample_n=2, return_entropy=True, seed=i
        )
        for i, n in enumerate((12, 30, 5))
    ]
    results = client.wait(client.submit(reqs), timeout=scaled(180))
    for req, res in zip(reqs, results, strict=True):
        assert res.ok, res.error
        assert res.model_version.startswith("qwen2-moe@")
        ref = hf_full_log_softmax(path, req.input_ids)
        rows = np.arange(req.num_tokens - 1)
        np.testing.assert_allclose(res.logprobs, ref[rows, req.input_ids[1:]], atol=2e-3)
        np.testing.assert_allclose(res.entropy, -(np.exp(ref) * ref).sum(1), atol=2e-3)
