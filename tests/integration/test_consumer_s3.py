"""A real consumer process writing bulk results to S3 (moto's server over HTTP), as in the
docker-compose deployment, and the client reading them back through the same API.

`queue.inline_max_bytes=0` sends every result to object storage, so each job exercises the
upload, the checksum recorded in Redis and the verified download.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from producer import TeacherClient, TeacherRequest
from shared import keys
from shared.settings import Settings, StorageSettings
from shared.storage import ChecksumMismatch, ObjectNotFound, compute_checksum
from tests.reference import tiny_full_log_softmax
from tests.s3_server import (  # noqa: F401  (fixtures register under their short names)
    S3Server,
    s3_bucket_fixture,
    s3_server_fixture,
)
from tests.timing import scaled

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

VOCAB = 1000  # the tiny preset's
PREFIX = "teacher/results"


def _on_s3(settings: Settings, server: S3Server, bucket: str, *, explicit: bool) -> Settings:
    """`settings` with bulk results in s3://bucket/PREFIX, every result out of line.

    explicit: endpoint and credentials as TEACHERQ_STORAGE__* settings (as docker-compose sets
    them); otherwise left unset, for the standard AWS_* environment to supply.
    """
    storage = StorageSettings(
        url=f"s3://{bucket}/{PREFIX}",
        **(
            {
                "endpoint": server.endpoint,
                "region": server.region,
                "access_key_id": server.access_key_id,
                "secret_access_key": server.secret_access_key,
            }
            if explicit
            else {}
        ),
    )
    queue = settings.queue.model_copy(update={"inline_max_bytes": 0})
    return settings.model_copy(update={"storage": storage, "queue": queue})


def _requests(n: int) -> list[TeacherRequest]:
    """Jobs asking for every output kind, at three temperatures."""
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(n):
        length = int(rng.integers(6, 48))
        reqs.append(
            TeacherRequest(
                input_ids=rng.integers(0, VOCAB, size=length),
                label_token_ids=rng.integers(0, VOCAB, size=(length - 1, 2)) if i % 2 else None,
                top_k=4 if i % 3 == 0 else 0,
                sample_n=2 if i % 4 == 0 else 0,
                return_entropy=i % 2 == 0,
                temperature=[1.0, 0.7, 1.5][i % 3],
                seed=i,
            )
        )
    return reqs


def _assert_matches_reference(req: TeacherRequest, res) -> None:
    """Every output of `res` against full-vocabulary log-softmax of the same model."""
    ref = tiny_full_log_softmax(req.input_ids, req.temperature)
    rows = np.arange(req.num_tokens - 1)
    np.testing.assert_allclose(res.logprobs, ref[rows, req.input_ids[1:]], atol=2e-4)
    if req.label_token_ids is not None:
        want = np.take_along_axis(ref, req.label_token_ids, axis=1)
        np.testing.assert_allclose(res.label_logprobs, want, atol=2e-4)
    if req.top_k:
        order = np.argsort(-ref, axis=1)[:, : req.top_k]
        np.testing.assert_allclose(
            res.topk_logprobs, np.take_along_axis(ref, order, axis=1), atol=2e-4
        )
    if req.sample_n:
        np.testing.assert_allclose(
            res.sampled_logprobs, np.take_along_axis(ref, res.sampled_token_ids, axis=1), atol=2e-4
        )
    if req.return_entropy:
        np.testing.assert_allclose(res.entropy, -(np.exp(ref) * ref).sum(axis=1), atol=2e-4)


def _pointer(client: TeacherClient, job_id: str) -> dict:
    """The object pointer ({key, checksum, bytes}) of a job's result record."""
    meta = json.loads(client.r.hget(keys.result_key(client.queue, job_id), "meta"))
    assert meta["object"] is not None, f"{job_id}: result stored inline, expected S3"
    return meta["object"]


def _listed(server: S3Server, bucket: str) -> set[str]:
    resp = server.client().list_objects_v2(Bucket=bucket)
    return {obj["Key"] for obj in resp.get("Contents", [])}


def test_results_round_trip_through_s3_and_match_the_reference(
    settings, start_consumer, s3_server, s3_bucket
) -> None:
    s = _on_s3(settings, s3_server, s3_bucket, explicit=True)
    start_consumer(s)
    client = TeacherClient(s)
    reqs = _requests(8)
    ids = client.submit(reqs)
    results = client.wait(ids, timeout=scaled(120))

    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for req, res in zip(reqs, results, strict=True):
        _assert_matches_reference(req, res)

    # One object per job, under the store's prefix, holding exactly what the client returned.
    s3 = s3_server.client()
    pointers = {job_id: _pointer(client, job_id) for job_id in ids}
    assert _listed(s3_server, s3_bucket) == {f"{PREFIX}/{p['key']}" for p in pointers.values()}
    for res in results:
        p = pointers[res.job_id]
        body = s3.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/{p['key']}")["Body"].read()
        assert len(body) == p["bytes"] and compute_checksum(body) == p["checksum"]
        stored = st_load(body)
        assert stored.keys() == res.arrays().keys()
        for name, arr in res.arrays().items():
            np.testing.assert_array_equal(stored[name], arr)


def test_corrupted_or_missing_object_is_detected_on_read(
    settings, start_consumer, s3_server, s3_bucket
) -> None:
    s = _on_s3(settings, s3_server, s3_bucket, explicit=True)
    start_consumer(s)
    client = TeacherClient(s)
    [job] = client.submit([TeacherRequest(input_ids=list(range(40)), top_k=8)])
    [good] = client.wait([job], timeout=scaled(60))
    assert good.ok

    s3 = s3_server.client()
    key = f"{PREFIX}/{_pointer(client, job)['key']}"
    original = s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    # Flip one bit in the last byte: array data, so the blob still parses as safetensors and
    # only the checksum can tell.
    corrupted = original[:-1] + bytes([original[-1] ^ 0x01])
    s3.put_object(Bucket=s3_bucket, Key=key, Body=corrupted)
    with pytest.raises(ChecksumMismatch, match="checksum mismatch"):
        TeacherClient(s).results([job])
    with pytest.raises(ChecksumMismatch):
        client.wait([job], timeout=scaled(10))

    s3.put_object(Bucket=s3_bucket, Key=key, Body=original)  # repaired: readable again
    [again] = client.results([job])
    np.testing.assert_array_equal(again.topk_logprobs, good.topk_logprobs)

    # An object removed under a live record (e.g. a bucket lifecycle rule shorter than the
    # result TTL) is reported as missing, not as an empty result.
    s3.delete_object(Bucket=s3_bucket, Key=key)
    with pytest.raises(ObjectNotFound):
        client.results([job])


def test_endpoint_and_credentials_fall_back_to_the_aws_environment(
    settings, start_consumer, s3_server, s3_bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _on_s3(settings, s3_server, s3_bucket, explicit=False)
    assert s.storage.endpoint is None and s.storage.access_key_id is None
    start_consumer(s, extra_env=s3_server.env())
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    client = TeacherClient(s)
    req = TeacherRequest(input_ids=[5, 9, 14, 2, 7], return_entropy=True)
    [res] = client.wait(client.submit([req]), timeout=scaled(60))

    assert res.ok, res.error
    _assert_matches_reference(req, res)
    assert _listed(s3_server, s3_bucket) == {f"{PREFIX}/{_pointer(client, res.job_id)['key']}"}
