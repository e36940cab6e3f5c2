"""End to end on a real valkey-server with real consumer processes: submit -> consume ->
results, idempotency, validation, dead letters, object storage, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from producer import InvalidJob, TeacherClient, TeacherRequest
from shared import keys
from shared.codec import encode_array
from shared.messages import DEFAULT_MAX_INPUT_TOKENS, encode_job
from tests.helpers import mixed_requests
from tests.processes import run_cli
from tests.reference import tiny_full_log_softmax
from tests.timing import scaled

pytestmark = pytest.mark.integration
VOCAB = 1000  # the tiny preset's


def test_submit_consume_results_match_full_vocab_reference(settings, start_consumer) -> None:
    start_consumer(settings)
    client = TeacherClient(settings)
    reqs = mixed_requests(np.random.default_rng(0), 8)
    ids = client.submit(reqs)
    assert len(set(ids)) == 8
    results = client.wait(ids, timeout=scaled(120))
    for req, res in zip(reqs, results, strict=True):
        assert res.ok, res.error
        assert res.model_version == "tiny-random-seed1234"
        assert res.metadata == req.metadata
        ref = tiny_full_log_softmax(req.input_ids, req.temperature)
        rows = np.arange(req.num_tokens - 1)
        np.testing.assert_allclose(res.logprobs, ref[rows, req.input_ids[1:]], atol=2e-4)
        if req.label_token_ids is not None:
            want = np.take_along_axis(ref, req.label_token_ids, axis=1)
            np.testing.assert_allclose(res.label_logprobs, want, atol=2e-4)
        else:
            assert res.label_logprobs is None
        if req.top_k:
            order = np.argsort(-ref, axis=1)[:, : req.top_k]
            np.testing.assert_allclose(
                res.topk_logprobs, np.take_along_axis(ref, order, axis=1), atol=2e-4
            )
            np.testing.assert_allclose(
                res.topk_logprobs, np.take_along_axis(ref, res.topk_token_ids, axis=1), atol=2e-4
            )
        else:
            assert res.topk_token_ids is None
        if req.sample_n:
            assert res.sampled_token_ids.shape == (req.num_tokens - 1, req.sample_n)
            np.testing.assert_allclose(
                res.sampled_logprobs,
                np.take_along_axis(ref, res.sampled_token_ids, axis=1),
                atol=2e-4,
            )
        if req.return_entropy:
            want = -(np.exp(ref) * ref).sum(axis=1)
            np.testing.assert_allclose(res.entropy, want, atol=2e-4)
        else:
            assert res.entropy is None


def test_resubmitting_a_job_id_computes_it_once(settings, start_consumer, r) -> None:
    client = TeacherClient(settings)
    req = TeacherRequest(input_ids=[1, 2, 3, 4], job_id="same-job")
    auto = TeacherRequest(input_ids=[5, 6, 7])
    first = client.submit([req, auto])
    second = client.submit([req, TeacherRequest(input_ids=[5, 6, 7])])
    assert first == second == ["same-job", first[1]]
    assert r.xlen(keys.jobs_stream(settings.queue.name)) == 2  # no duplicate entries
    start_consumer(settings)
    client.wait(first, timeout=scaled(60))
    done = r.xrange(keys.done_stream(settings.queue.name))
    assert sorted(f[b"job_id"].decode() for _, f in done) == sorted(first)


def test_duplicate_entries_for_one_job_id_compute_once(settings, start_consumer, r) -> None:
    """Entries written twice (e.g. a retried XADD) are computed at most once."""

    req = TeacherRequest(input_ids=[9, 8, 7, 6])
    fields = encode_job(req, job_id="dup")
    stream = keys.jobs_stream(settings.queue.name)
    client = TeacherClient(settings)
    client.streams.ensure_group()
    r.xadd(stream, fields)
    r.xadd(stream, fields)
    proc = start_consumer(settings)
    [res] = client.wait(["dup"], timeout=scaled(60))
    assert res.ok
    log = proc.log_path.read_text()
    assert log.count('"job.duplicate_skipped"') == 1, log[-2000:]
    done = [f for _, f in r.xrange(keys.done_stream(settings.queue.name))]
    assert [f[b"job_id"] for f in done] == [b"dup"]
    group = r.xinfo_groups(stream)[0]
    assert group["pending"] == 0


def test_invalid_requests_are_refused_at_submit(settings, r) -> None:
    client = TeacherClient(settings)
    with pytest.raises(InvalidJob, match=r"request 1: .*input_ids is empty"):
        client.submit([{"input_ids": [1, 2]}, {"input_ids": []}])
    # No consumer yet and queue.max_input_tokens unset: the default limit holds.
    too_long = [1] * (DEFAULT_MAX_INPUT_TOKENS + 1)
    with pytest.raises(InvalidJob, match=r"8193 tokens; the maximum is 8192 \(queue\."):
        client.submit([{"input_ids": too_long}])
    assert r.exists(keys.jobs_stream(settings.queue.name)) == 0  # nothing enqueued


def test_vocabulary_advertised_by_consumers_is_checked(settings, start_consumer) -> None:
    start_consumer(settings)
    client = TeacherClient(settings)
    with pytest.raises(InvalidJob, match=r"input_ids\[1\] = 1000 is outside the vocabulary"):
        client.submit([{"input_ids": [1, VOCAB]}])


def test_the_served_models_length_limit_is_advertised_and_enforced(
    settings, start_consumer, r
) -> None:
    """Unset queue.max_input_tokens means the live model's limit (the tiny preset's
    max_position_embeddings, 4096) at submit; a longer job that reaches the consumer anyway,
    e.g. from a producer configured with a higher limit, fails alone with both numbers."""
    start_consumer(settings)
    client = TeacherClient(settings)
    limit = 4096
    with pytest.raises(
        InvalidJob, match=rf"{limit + 1} tokens; the maximum is {limit} \(the model's"
    ):
        client.submit([{"input_ids": [1] * (limit + 1)}])
    assert client.limits().max_input_tokens == limit
    stream = keys.jobs_stream(settings.queue.name)
    r.xadd(stream, encode_job(TeacherRequest(input_ids=[1] * (limit + 2)), job_id="long"))
    good = client.submit([TeacherRequest(input_ids=[1, 2, 3])])
    long_, ok = client.wait(["long", *good], timeout=scaled(60))
    assert f"{limit + 2} tokens; the maximum is {limit} (the model's" in long_.error
    assert ok.ok


def test_bad_stream_entries_are_dead_lettered_and_good_jobs_flow(
    settings, start_consumer, r
) -> None:
    client = TeacherClient(settings)
    client.streams.ensure_group()
    stream = keys.jobs_stream(settings.queue.name)
    r.xadd(stream, {"v": "1", "job_id": "no-ids", "meta": "{}"})
    r.xadd(
        stream,
        {
            "v": "1",
            "job_id": "truncated",
            "meta": "{}",
            "input_ids": encode_array(np.arange(10, dtype=np.int32))[:-5],
        },
    )
    r.xadd(
        stream,
        {
            "v": "1",
            "job_id": "oov",
            "meta": "{}",
            "input_ids": encode_array(np.array([1, 5000], dtype=np.int32)),
        },
    )
    r.xadd(stream, {"garbage": b"\x00\xff"})
    good = client.submit([TeacherRequest(input_ids=[1, 2, 3])])
    start_consumer(settings)
    results = client.wait(["no-ids", "truncated", "oov", *good], timeout=scaled(60))
    assert "no 'input_ids' field" in results[0].error
    assert "truncated" in results[1].error or "bytes" in results[1].error
    assert "outside the vocabulary [0, 1000)" in results[2].error
    assert results[3].ok
    dead = r.xrange(keys.dead_stream(settings.queue.name))
    assert len(dead) == 4
    by_job = {f[b"job_id"].decode(): f for _, f in dead}
    assert by_job["oov"][b"exception"] == b"InvalidJob"
    assert by_job["oov"][b"orig:input_ids"] == encode_array(np.array([1, 5000], dtype=np.int32))
    assert r.xinfo_groups(stream)[0]["pending"] == 0


def test_large_results_go_to_object_storage(settings, start_consumer, tmp_path) -> None:
    s = settings.model_copy(
        update={"queue": settings.queue.model_copy(update={"inline_max_bytes": 0})}
    )
    start_consumer(s)
    client = TeacherClient(s)
    [job] = client.submit([TeacherRequest(input_ids=list(range(50)), top_k=16)])
    [res] = client.wait([job], timeout=scaled(60))
    assert res.ok and res.topk_logprobs.shape == (49, 16)
    files = list((tmp_path / "objects").rglob("*"))
    assert any(f.is_file() for f in files), "bulk arrays should be in the file store"
    ref = tiny_full_log_softmax(np.arange(50))
    np.testing.assert_allclose(res.logprobs, ref[np.arange(49), np.arange(1, 50)], atol=2e-4)


def test_cancel_before_start_is_not_computed(settings, start_consumer) -> None:
    client = TeacherClient(settings)
    [job] = client.submit([TeacherRequest(input_ids=[4, 5, 6])])
    client.cancel(job)
    start_consumer(settings)
    [res] = client.wait([job], timeout=scaled(30))
    assert res.error == "cancelled by the user"


def test_cli_submit_and_results(settings, start_consumer, tmp_path) -> None:
    start_consumer(settings)
    jsonl = tmp_path / "jobs.jsonl"
    jsonl.write_text(
        json.dumps({"input_ids": [1, 2, 3, 4], "top_k": 2})
        + "\n\n"
        + json.dumps({"input_ids": [7, 8, 9], "job_id": "cli-2"})
        + "\n"
    )
    sub = run_cli(settings, "submit", str(jsonl), "--wait")
    assert sub.returncode == 0, sub.stderr
    ids = sub.stdout.split()
    assert len(ids) == 2 and ids[1] == "cli-2"
    res = run_cli(settings, "results", *ids, "--json")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [row["job_id"] for row in rows] == ids
    assert len(rows[0]["logprobs"]) == 3 and len(rows[0]["topk_token_ids"][0]) == 2
    ref = tiny_full_log_softmax(np.array([7, 8, 9]))
    np.testing.assert_allclose(rows[1]["logprobs"], ref[[0, 1], [8, 9]], atol=2e-4)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, 2], "temperature": 0}) + "\n")
    out = run_cli(settings, "submit", str(bad))
    assert out.returncode == 2 and "temperature must be a finite number > 0" in out.stderr


def test_pending_tokens_count_submitted_minus_acknowledged(settings, start_consumer) -> None:
    client = TeacherClient(settings)
    ids = client.submit([TeacherRequest(input_ids=list(range(n))) for n in (5, 7, 11)])
    client.submit([TeacherRequest(input_ids=list(range(5)))])  # a resubmission adds nothing
    assert client.streams.pending_tokens() == 23
    assert client.status()["pending_tokens"] == 23
    start_consumer(settings)
    client.wait(ids, timeout=scaled(60))
    assert client.streams.pending_tokens() == 0
