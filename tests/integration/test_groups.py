"""Consumer groups on CPU (gloo): TP and DP replicas on one queue, SIGTERM drain, a failing
non-leader rank, weight updates mid-stream, sleep and wake."""

from __future__ import annotations

import time

import numpy as np
import pytest

from producer import TeacherClient, TeacherRequest
from shared import keys
from shared.settings import Settings
from shared.weights import UpdateInProgress, request_update
from tests.helpers import assert_exactly_once, fast, group_jobs, wait_consumer_state
from tests.processes import terminate
from tests.reference import hf_token_logprobs, tiny_full_log_softmax
from tests.timing import scaled

pytestmark = pytest.mark.integration


def tp(settings: Settings, n: int) -> Settings:
    return settings.model_copy(update={"parallel": settings.parallel.model_copy(update={"tp": n})})


def test_tp_group_and_dp_replicas_share_a_queue(settings, start_consumer) -> None:
    reqs = group_jobs(24)
    # Reference: a single-rank consumer on its own queue.
    single = fast(settings.with_queue("single-" + settings.queue.name))
    proc = start_consumer(single)
    want = TeacherClient(single).wait(TeacherClient(single).submit(reqs), timeout=scaled(120))
    terminate(proc)

    s = fast(settings, batch_max_jobs=2)
    start_consumer(s, nproc=2, wait=False)  # two data-parallel replicas in one launch
    start_consumer(tp(s, 2), nproc=2, wait=False)  # one tensor-parallel replica of two ranks
    from tests.helpers import wait_for_consumers

    wait_for_consumers(s, count=3)
    client = TeacherClient(s)
    got = client.wait(client.submit(reqs), timeout=scaled(180))
    for a, b in zip(got, want, strict=True):
        assert a.ok, a.error
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=2e-5)
        np.testing.assert_array_equal(a.sampled_token_ids, b.sampled_token_ids)
    layouts = {c["layout"] for c in client.consumers().values()}
    assert layouts == {"tp1·pp1·dp2", "tp2·pp1·dp1"}
    # Heartbeats carry the counters: wait until they account for every job.
    deadline = time.monotonic() + scaled(10)
    while sum(c["jobs_done"] for c in client.consumers().values()) < len(reqs):
        assert time.monotonic() < deadline, client.consumers()
        time.sleep(0.1)
    workers = [c for c in client.consumers().values() if c["jobs_done"] > 0]
    assert len(workers) >= 2, "the queue's work is spread over the replicas"
    assert_exactly_once(client, [r.job_id for r in reqs])


def test_sigterm_drains_without_losing_work(settings, start_consumer) -> None:
    s = fast(settings, batch_max_jobs=2, prefetch_batches=1)
    client = TeacherClient(s)
    reqs = group_jobs(120, seed=1)
    ids = client.submit(reqs)
    first = start_consumer(s)
    deadline = time.monotonic() + scaled(60)
    while client.r.xlen(keys.done_stream(s.queue.name)) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert terminate(first, timeout=scaled(60)) == 0, "a drained consumer exits 0"
    name = next(n for n, c in client.consumers().items() if c["state"] == "stopped")
    pending = client.r.xpending_range(
        keys.jobs_stream(s.queue.name), "consumers", "-", "+", 100, consumername=name
    )
    assert pending == [], "everything the drained consumer claimed was stored and acked"
    done_before = client.r.xlen(keys.done_stream(s.queue.name))
    assert done_before < len(ids), "the drain stopped before the queue was empty"
    start_consumer(s)
    assert all(r.ok for r in client.wait(ids, timeout=scaled(120)))
    assert_exactly_once(client, ids)


def test_failure_on_a_non_leader_rank_does_not_hang(settings, start_consumer) -> None:
    s = tp(fast(settings, batch_max_jobs=4, raise_at="1:2"), 2)
    proc = start_consumer(s, nproc=2)
    client = TeacherClient(s)
    ids = client.submit(group_jobs(12, seed=2))
    results = client.wait(ids, timeout=scaled(120))  # a hang would end in TimeoutError
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    log = proc.log_path.read_text()
    assert "injected failure on rank 1" in log or "a peer rank failed" in log
    assert_exactly_once(client, ids)


@pytest.fixture(scope="module")
def two_checkpoints(hf_checkpoint):
    return hf_checkpoint("qwen2", "teacher-a", seed=1), hf_checkpoint("qwen2", "teacher-b", seed=2)


def test_weight_update_mid_stream_stamps_versions(settings, start_consumer, two_checkpoints):
    a, b = two_checkpoints
    s = fast(settings).model_copy(
        update={"model": settings.model.model_copy(update={"path": str(a)})}
    )
    start_consumer(s)
    client = TeacherClient(s)
    wave1 = group_jobs(4, seed=3, vocab=500)
    before = client.wait(client.submit(wave1), timeout=scaled(60))
    # A job that must be computed by the updated weights, submitted before the update.
    eager = TeacherRequest(input_ids=[1, 2, 3, 4], min_model_generation=1, job_id="needs-gen1")
    client.submit([eager])
    first = request_update(client.r, s.queue.name, str(b))
    again = request_update(client.r, s.queue.name, str(b))
    assert again.coalesced and again.request_id == first.request_id
    assert again.generation == first.generation == 1
    with pytest.raises(UpdateInProgress, match="teacher-b"):
        request_update(client.r, s.queue.name, str(a))
    client.update_weights(str(b), wait=True, timeout=scaled(120))
    wave2 = group_jobs(4, seed=4, vocab=500)
    after = client.wait(client.submit(wave2), timeout=scaled(60))
    [late] = client.wait(["needs-gen1"], timeout=scaled(60))

    for req, res in zip(wave1, before, strict=True):
        assert res.model_version.startswith("teacher-a@") and res.model_generation == 0
        np.testing.assert_allclose(res.logprobs, hf_token_logprobs(a, req.input_ids), atol=1e-4)
    for req, res in zip(wave2, after, strict=True):
        assert res.model_version.startswith("teacher-b@") and res.model_generation == 1
        np.testing.assert_allclose(res.logprobs, hf_token_logprobs(b, req.input_ids), atol=1e-4)
    assert late.model_generation == 1 and late.model_version.startswith("teacher-b@")
    # Another update can start once this one is done.
    assert request_update(client.r, s.queue.name, str(a)).generation == 2


def test_sleep_and_wake_round_trip(settings, start_consumer, two_checkpoints) -> None:
    _, b = two_checkpoints
    s = fast(settings, sleep_after_idle_s=0.5)
    proc = start_consumer(s)
    client = TeacherClient(s)
    wait_consumer_state(client, "sleeping")
    [res] = client.wait(client.submit([TeacherRequest(input_ids=[5, 6, 7, 8])]), timeout=scaled(60))
    ref = tiny_full_log_softmax(np.array([5, 6, 7, 8]))
    np.testing.assert_allclose(res.logprobs, ref[[0, 1, 2], [6, 7, 8]], atol=2e-4)
    wait_consumer_state(client, "sleeping")
    # A weight update received while asleep: reloads, and the consumer stays asleep.
    client.update_weights(str(b), wait=True, timeout=scaled(120))
    wait_consumer_state(client, "sleeping")
    [rec] = client.consumers().values()
    assert rec["model_generation"] == 1 and rec["model_version"].startswith("teacher-b@")
    # (a job id of its own; the same content after the update would be a new job too, see
    # test_generations.py)
    after = TeacherRequest(input_ids=[5, 6, 7, 8], job_id="after-update")
    [res] = client.wait(client.submit([after]), timeout=scaled(60))
    assert res.ok and res.model_generation == 1
    np.testing.assert_allclose(res.logprobs, hf_token_logprobs(b, [5, 6, 7, 8]), atol=1e-4)
    log = proc.log_path.read_text()
    assert log.count('"consumer.sleeping"') >= 2 and '"consumer.awake"' in log
