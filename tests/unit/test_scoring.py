"""Scorer.launch: batches queued before earlier ones are collected give exactly the outputs of
scoring each alone (on CUDA the queued work overlaps; here, on the CPU, the order must not
matter either)."""

from __future__ import annotations

import numpy as np
import torch

from consumer.forward.model import TINY, build_model
from consumer.forward.scoring import Scorer
from consumer.group.batching import batch_from_jobs
from shared.messages import Job, TeacherRequest


def _batch(seed: int, lengths: list[int]):
    rng = np.random.default_rng(seed)
    jobs = [
        Job(
            job_id=f"j{i}",
            entry_id=f"0-{i}",
            submitted_at=0.0,
            request=TeacherRequest(
                input_ids=rng.integers(0, TINY.vocab_size, n),
                top_k=3,
                sample_n=2,
                return_entropy=bool(i % 2),
            ),
        )
        for i, n in enumerate(lengths)
    ]
    return batch_from_jobs(jobs)


def test_launched_batches_collected_out_of_order_equal_each_scored_alone(layout) -> None:
    scorer = Scorer(
        model=build_model(TINY, layout), spec=TINY, layout=layout, device=torch.device("cpu")
    )
    a, b = _batch(1, [12, 12, 7]), _batch(2, [30, 5])
    first, second = scorer.launch(a), scorer.launch(b)
    got_b, got_a = second.result(), first.result()
    for got, batch in ((got_a, a), (got_b, b)):
        want = scorer.score(batch)
        assert len(got) == len(want) == batch.num_jobs
        for g, w in zip(got, want, strict=True):
            assert g.keys() == w.keys()
            for name in w:
                np.testing.assert_array_equal(g[name], w[name], err_msg=name)
