"""Tests for shared.storage against real local stores: file:// in a temp dir and memory://."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.storage import (
    MULTIPART_THRESHOLD,
    ChecksumMismatch,
    ObjectNotFound,
    ObjectStore,
    StorageError,
    TransientStorageError,
    bulk_object_key,
    compute_checksum,
)
from tests.timing import scaled


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """Each behavioural test runs against both local backends."""
    if request.param == "file":
        return ObjectStore.from_url(f"file://{tmp_path / 'store'}")
    return ObjectStore.from_url("memory://")


@pytest.fixture
def file_store(tmp_path: Path) -> ObjectStore:
    return ObjectStore.from_url(f"file://{tmp_path / 'store'}")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# --- from_url ---------------------------------------------------------------------------------


def test_file_url_absolute_creates_directory(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    s = ObjectStore.from_url(f"file://{root}")
    assert root.is_dir()
    assert s.url == root.as_uri()
    s.put("k", b"v")
    assert (root / "k").read_bytes() == b"v"


def test_file_url_relative_and_plain_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rel = ObjectStore.from_url("file://./rel/dir")
    plain = ObjectStore.from_url("plain/dir")
    rel.put("x", b"1")
    plain.put("y", b"2")
    assert (tmp_path / "rel" / "dir" / "x").read_bytes() == b"1"
    assert (tmp_path / "plain" / "dir" / "y").read_bytes() == b"2"
    assert rel.url == (tmp_path / "rel" / "dir").as_uri()


def test_file_url_percent_encoded_and_localhost(tmp_path: Path) -> None:
    s = ObjectStore.from_url(f"file://localhost{tmp_path}/with%20space")
    s.put("k", b"v")
    assert (tmp_path / "with space" / "k").read_bytes() == b"v"


def test_file_url_that_is_a_file_is_a_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    with pytest.raises(StorageError, match="cannot create local store directory"):
        ObjectStore.from_url(f"file://{blocker}/sub")


@pytest.mark.parametrize("url", ["ftp://host/x", "gs://bucket/x", "HTTP://example.com/x"])
def test_unknown_scheme_names_scheme_and_supported_ones(url: str) -> None:
    with pytest.raises(StorageError) as info:
        ObjectStore.from_url(url)
    msg = str(info.value)
    scheme = url.split("://")[0].lower()
    assert f"unsupported storage URL scheme {scheme!r}" in msg
    for supported in ("file://", "memory://", "s3://"):
        assert supported in msg


def test_s3_url_without_bucket_is_rejected() -> None:
    with pytest.raises(StorageError, match="needs a bucket"):
        ObjectStore.from_url("s3:///prefix")


def test_memory_stores_are_independent() -> None:
    a = ObjectStore.from_url("memory://")
    b = ObjectStore.from_url("memory://")
    a.put("k", b"v")
    assert not b.exists("k")
    assert a.url_for("results/x.tqa") == "memory:///results/x.tqa"


# --- put / get / exists / delete --------------------------------------------------------------


def test_round_trip_put_get_exists_delete(store: ObjectStore) -> None:
    key = "results/q/ab/job.tqa"
    assert not store.exists(key)
    checksum = store.put(key, b"payload")
    assert checksum == "sha256:" + hashlib.sha256(b"payload").hexdigest()
    assert checksum == compute_checksum(b"payload")
    assert store.exists(key)
    assert store.get(key) == b"payload"
    assert store.get(key, checksum=checksum) == b"payload"
    assert isinstance(store.get(key), bytes)
    store.delete(key)
    assert not store.exists(key)
    with pytest.raises(ObjectNotFound):
        store.get(key)


def test_empty_payload(store: ObjectStore) -> None:
    checksum = store.put("empty", b"")
    assert store.get("empty", checksum=checksum) == b""


def test_put_same_bytes_twice_is_idempotent(store: ObjectStore) -> None:
    first = store.put("k", b"same")
    second = store.put("k", b"same")
    assert first == second
    assert store.get("k", checksum=first) == b"same"


def test_put_new_bytes_overwrites_and_old_checksum_no_longer_matches(store: ObjectStore) -> None:
    old = store.put("k", b"old")
    new = store.put("k", b"new")
    assert old != new
    assert store.get("k", checksum=new) == b"new"
    with pytest.raises(ChecksumMismatch):
        store.get("k", checksum=old)


def test_put_accepts_bytearray_and_memoryview(store: ObjectStore) -> None:
    assert store.put("a", bytearray(b"xy")) == compute_checksum(b"xy")  # type: ignore[arg-type]
    assert store.put("b", memoryview(b"xy")) == compute_checksum(b"xy")  # type: ignore[arg-type]
    assert store.get("a") == store.get("b") == b"xy"


def test_put_rejects_str(store: ObjectStore) -> None:
    with pytest.raises(TypeError, match="must be bytes, got str"):
        store.put("k", "text")  # type: ignore[arg-type]


def test_large_payload_round_trip_above_multipart_threshold(store: ObjectStore) -> None:
    data = os.urandom(MULTIPART_THRESHOLD + 1024 * 1024 + 7)
    checksum = store.put("big/blob.tqa", data)
    assert store.get("big/blob.tqa", checksum=checksum) == data


def test_file_store_leaves_no_temporary_files(file_store: ObjectStore, tmp_path: Path) -> None:
    file_store.put("a/small", b"x" * 10)
    file_store.put("a/big", os.urandom(MULTIPART_THRESHOLD + 1))
    file_store.put("a/small", b"x" * 10)
    assert _files(tmp_path / "store") == ["a/big", "a/small"]


def test_missing_key_names_key_and_store(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound) as info:
        store.get("results/nope.tqa")
    msg = str(info.value)
    assert "'results/nope.tqa'" in msg
    assert store.url in msg
    assert isinstance(info.value, StorageError)


def test_delete_missing_key_is_not_an_error(store: ObjectStore) -> None:
    store.delete("never/written")
    assert not store.exists("never/written")


# --- checksums --------------------------------------------------------------------------------


def test_corruption_on_disk_is_detected(file_store: ObjectStore, tmp_path: Path) -> None:
    key = "results/q/00/job.tqa"
    checksum = file_store.put(key, b"A" * 1000)
    path = tmp_path / "store" / key
    corrupted = bytearray(path.read_bytes())
    corrupted[500] ^= 0x01
    path.write_bytes(bytes(corrupted))
    with pytest.raises(ChecksumMismatch) as info:
        file_store.get(key, checksum=checksum)
    msg = str(info.value)
    assert key in msg
    assert f"expected {checksum}" in msg
    assert f"got {compute_checksum(bytes(corrupted))}" in msg
    # Without a checksum the corrupted bytes come back unverified, as documented.
    assert file_store.get(key) == bytes(corrupted)


def test_truncation_on_disk_is_detected(file_store: ObjectStore, tmp_path: Path) -> None:
    checksum = file_store.put("k", b"0123456789")
    (tmp_path / "store" / "k").write_bytes(b"01234")
    with pytest.raises(ChecksumMismatch, match="got sha256:.* \\(5 bytes\\)"):
        file_store.get("k", checksum=checksum)


def test_checksum_comparison_ignores_case(store: ObjectStore) -> None:
    checksum = store.put("k", b"v")
    assert store.get("k", checksum=checksum.upper().replace("SHA256", "sha256")) == b"v"


@pytest.mark.parametrize("bad", ["", "md5:abc", "sha256:xyz", "sha256:" + "0" * 63, "deadbeef"])
def test_malformed_checksum_is_rejected_before_reading(store: ObjectStore, bad: str) -> None:
    with pytest.raises(StorageError, match="malformed checksum"):
        store.get("missing-key-is-not-reached", checksum=bad)


# --- keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["", "/abs", "trailing/", "a//b", "a/../b", "./a", "a/.", "tab\there", "back\\slash"]
)
def test_invalid_keys_are_rejected(store: ObjectStore, key: str) -> None:
    for op in (lambda: store.put(key, b"x"), lambda: store.get(key), lambda: store.exists(key)):
        with pytest.raises(StorageError, match="object key"):
            op()


def test_key_too_long_is_rejected(store: ObjectStore) -> None:
    with pytest.raises(StorageError, match="longer than 1024 bytes"):
        store.put("k" * 1025, b"x")


def test_bulk_object_key_is_deterministic_and_safe() -> None:
    key = bulk_object_key("teacher:qwen", "batch/7:job#1")
    assert key == bulk_object_key("teacher:qwen", "batch/7:job#1")
    assert re.fullmatch(r"results/teacher_qwen/[0-9a-f]{2}/batch_7_job_1\.[0-9a-f]{32}\.tqa", key)


def test_bulk_object_key_distinguishes_ids_that_sanitise_alike() -> None:
    ids = ["a:b", "a/b", "a_b", "a b", "a\\b", "a?b"]
    keys = {bulk_object_key("q", i) for i in ids}
    assert len(keys) == len(ids)
    assert bulk_object_key("q1", "j") != bulk_object_key("q2", "j")
    assert bulk_object_key("ab", "c") != bulk_object_key("a", "bc")


def test_bulk_object_key_rejects_empty() -> None:
    with pytest.raises(ValueError):
        bulk_object_key("", "job")
    with pytest.raises(ValueError):
        bulk_object_key("q", "")


@settings(max_examples=200, deadline=None)
@given(queue=st.text(min_size=1, max_size=50), job_id=st.text(min_size=1, max_size=300))
def test_bulk_object_key_is_always_a_valid_storable_key(queue: str, job_id: str) -> None:
    key = bulk_object_key(queue, job_id)
    assert re.fullmatch(r"results/[A-Za-z0-9_.-]+/[0-9a-f]{2}/[A-Za-z0-9_.-]+\.tqa", key)
    assert ".." not in key.split("/")
    store = ObjectStore.from_url("memory://")
    store.put(key, b"x")
    assert store.exists(key)


def test_bulk_object_keys_work_on_the_file_store(file_store: ObjectStore) -> None:
    for job_id in ["../../etc/passwd", "a/b/c", "x:y", ".hidden", "."]:
        key = bulk_object_key("q", job_id)
        file_store.put(key, job_id.encode())
        assert file_store.get(key) == job_id.encode()


# --- transient errors and put_with_retry ------------------------------------------------------


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port with nothing listening: connections are refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    yield port


def _dead_s3(port: int) -> ObjectStore:
    return ObjectStore.from_url(
        "s3://bucket/prefix",
        endpoint=f"http://127.0.0.1:{port}",
        region="us-east-1",
        access_key_id="x",
        secret_access_key="y",
        client_retries=0,
    )


def test_connection_refused_is_transient(closed_port: int) -> None:
    store = _dead_s3(closed_port)
    with pytest.raises(TransientStorageError, match=r"put s3://bucket/prefix/k failed \(transient"):
        store.put("k", b"v")
    with pytest.raises(TransientStorageError):
        store.get("k")
    with pytest.raises(TransientStorageError):
        store.exists("k")


def test_put_with_retry_gives_up_after_attempts(closed_port: int) -> None:
    store = _dead_s3(closed_port)
    calls: list[tuple[int, float]] = []
    t0 = time.monotonic()
    with pytest.raises(TransientStorageError, match="still failing after 4 attempts") as info:
        store.put_with_retry(
            "k", b"v", attempts=4, base_delay=0.01, on_retry=lambda n, e, d: calls.append((n, d))
        )
    assert time.monotonic() - t0 < scaled(10)
    assert [n for n, _ in calls] == [1, 2, 3]
    # Exponential backoff with jitter in [0.5, 1] of the nominal delay.
    for n, delay in calls:
        nominal = 0.01 * 2 ** (n - 1)
        assert nominal * 0.5 <= delay <= nominal
    assert isinstance(info.value.__cause__, TransientStorageError)


def test_put_with_retry_does_not_retry_permanent_errors(tmp_path: Path) -> None:
    store = ObjectStore.from_url(f"file://{tmp_path}")
    (tmp_path / "occupied").write_bytes(b"a file where a directory is needed")
    calls: list[int] = []
    with pytest.raises(StorageError) as info:
        store.put_with_retry("occupied/child", b"v", on_retry=lambda n, e, d: calls.append(n))
    assert not isinstance(info.value, TransientStorageError)
    assert calls == []


def test_put_with_retry_succeeds_first_time_without_sleeping(store: ObjectStore) -> None:
    calls: list[int] = []
    checksum = store.put_with_retry("k", b"v", on_retry=lambda n, e, d: calls.append(n))
    assert checksum == compute_checksum(b"v")
    assert store.get("k", checksum=checksum) == b"v"
    assert calls == []


def test_put_with_retry_takes_the_callers_checksum(store: ObjectStore) -> None:
    """A caller that hashed the bytes already (a content-addressed key) passes the checksum: it
    comes back as the object's, and the stored bytes verify against it; a malformed one is
    refused before anything is written."""
    data = os.urandom(5000)
    given_checksum = compute_checksum(data)
    assert store.put_with_retry("k", data, checksum=given_checksum) == given_checksum
    assert store.get("k", checksum=given_checksum) == data
    with pytest.raises(StorageError, match="malformed checksum 'md5:00'"):
        store.put_with_retry("k2", data, checksum="md5:00")
    with pytest.raises(ObjectNotFound):
        store.get("k2")


def test_put_with_retry_validates_attempts(store: ObjectStore) -> None:
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        store.put_with_retry("k", b"v", attempts=0)


def test_get_async_reads_verifies_and_reports_like_get(store: ObjectStore) -> None:
    """The asyncio read returns the same bytes as `get`, verifies the checksum (a wrong one
    raises ChecksumMismatch) and names a missing key with ObjectNotFound."""
    import asyncio

    data = os.urandom(70_000)
    checksum = store.put("results/async.tqa", data)

    async def main() -> None:
        assert await store.get_async("results/async.tqa", checksum=checksum) == data
        assert await store.get_async("results/async.tqa") == store.get("results/async.tqa")
        with pytest.raises(ChecksumMismatch):
            await store.get_async("results/async.tqa", checksum=compute_checksum(b"other"))
        with pytest.raises(ObjectNotFound, match="results/gone.tqa"):
            await store.get_async("results/gone.tqa")

    asyncio.run(main())
