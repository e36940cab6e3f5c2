"""shared.storage against a real S3 API: moto's server over HTTP on loopback.

Faults are injected at the network level, never by mocking the store: a stopped server, a
closed port, a tiny HTTP server that answers with a chosen status, and a TCP proxy that lets a
request reach moto but loses the response (the ambiguous failure that makes retries risky).
"""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

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
from tests.s3_server import (  # noqa: F401  (fixtures register under their short names)
    S3Server,
    isolated_s3_server_fixture,
    s3_bucket_fixture,
    s3_server_fixture,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SMALL = 4096
MULTIPART = MULTIPART_THRESHOLD + 1024 * 1024  # two parts with the default 8 MiB chunk size


def _store(server: S3Server, bucket: str, prefix: str = "", **kwargs: Any) -> ObjectStore:
    url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return ObjectStore.from_url(url, **{**server.store_kwargs(), **kwargs})


def _keys(server: S3Server, bucket: str) -> list[str]:
    resp = server.client().list_objects_v2(Bucket=bucket)
    return sorted(obj["Key"] for obj in resp.get("Contents", []))


def _body(server: S3Server, bucket: str, key: str) -> bytes:
    return bytes(server.client().get_object(Bucket=bucket, Key=key)["Body"].read())


# --- round trips ------------------------------------------------------------------------------


def test_round_trip_small_under_prefix(s3_server: S3Server, s3_bucket: str) -> None:
    store = _store(s3_server, s3_bucket, "runs/r1")
    key = bulk_object_key("teacher:q", "job/1")
    assert store.url == f"s3://{s3_bucket}/runs/r1"
    assert store.url_for(key) == f"s3://{s3_bucket}/runs/r1/{key}"
    assert not store.exists(key)
    data = os.urandom(SMALL)
    checksum = store.put(key, data)
    assert checksum == compute_checksum(data)
    assert store.exists(key)
    assert store.get(key, checksum=checksum) == data
    assert _keys(s3_server, s3_bucket) == [f"runs/r1/{key}"]
    # A plain single PUT: the ETag is the MD5 of the body, without a part count.
    etag = s3_server.client().head_object(Bucket=s3_bucket, Key=f"runs/r1/{key}")["ETag"]
    assert "-" not in etag
    store.delete(key)
    assert not store.exists(key)
    assert _keys(s3_server, s3_bucket) == []
    store.delete(key)  # deleting again is fine


def test_multipart_round_trip(s3_server: S3Server, s3_bucket: str) -> None:
    store = _store(s3_server, s3_bucket, "big")
    data = os.urandom(MULTIPART)
    checksum = store.put("blob.tqa", data)
    etag = s3_server.client().head_object(Bucket=s3_bucket, Key="big/blob.tqa")["ETag"]
    # S3 gives multipart objects an ETag of "<md5 of part md5s>-<part count>".
    assert re.fullmatch(r'"[0-9a-f]{32}-2"', etag), etag
    assert store.get("blob.tqa", checksum=checksum) == data
    assert _body(s3_server, s3_bucket, "big/blob.tqa") == data


def test_same_bytes_twice_is_one_object(s3_server: S3Server, s3_bucket: str) -> None:
    store = _store(s3_server, s3_bucket)
    assert store.put("k", b"v") == store.put("k", b"v")
    assert _keys(s3_server, s3_bucket) == ["k"]


def test_checksum_detects_object_replaced_behind_our_back(
    s3_server: S3Server, s3_bucket: str
) -> None:
    store = _store(s3_server, s3_bucket)
    checksum = store.put("k", b"original bytes")
    s3_server.client().put_object(Bucket=s3_bucket, Key="k", Body=b"original bytez")
    with pytest.raises(ChecksumMismatch) as info:
        store.get("k", checksum=checksum)
    msg = str(info.value)
    assert f"s3://{s3_bucket}/k" in msg
    assert checksum in msg
    assert compute_checksum(b"original bytez") in msg


def test_missing_key_is_object_not_found(s3_server: S3Server, s3_bucket: str) -> None:
    store = _store(s3_server, s3_bucket, "p")
    with pytest.raises(ObjectNotFound) as info:
        store.get("nope.tqa")
    assert "'nope.tqa'" in str(info.value) and f"s3://{s3_bucket}/p" in str(info.value)


def test_missing_bucket_is_not_reported_as_missing_object(s3_server: S3Server) -> None:
    store = _store(s3_server, "no-such-bucket")
    with pytest.raises(StorageError, match="bucket or root does not exist") as info:
        store.put("k", b"v")
    assert not isinstance(info.value, ObjectNotFound | TransientStorageError)
    with pytest.raises(StorageError, match="NoSuchBucket|bucket") as info2:
        store.get("k")
    assert not isinstance(info2.value, ObjectNotFound)


@pytest.mark.parametrize("with_allow_http_env", [True, False])
def test_settings_from_environment(
    s3_server: S3Server,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    with_allow_http_env: bool,
) -> None:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    if not with_allow_http_env:
        # An explicit http:// endpoint is taken as consent to plain HTTP.
        monkeypatch.delenv("AWS_ALLOW_HTTP")
    store = ObjectStore.from_url(f"s3://{s3_bucket}/env")
    checksum = store.put("k", b"from env")
    assert store.get("k", checksum=checksum) == b"from env"
    assert _keys(s3_server, s3_bucket) == ["env/k"]


# --- transient failures -----------------------------------------------------------------------


class _StatusServer:
    """An HTTP server that answers every request with one fixed status and counts requests."""

    def __init__(self, status: int) -> None:
        owner = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self) -> None:
                owner.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                body = b"<Error><Code>Injected</Code></Error>"
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _reply

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def status_server(request: pytest.FixtureRequest) -> Iterator[_StatusServer]:
    server = _StatusServer(request.param)
    try:
        yield server
    finally:
        server.close()


def _store_at(endpoint: str, **kwargs: Any) -> ObjectStore:
    return ObjectStore.from_url(
        "s3://bucket",
        endpoint=endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        **kwargs,
    )


@pytest.mark.parametrize("status_server", [500, 502, 503, 504, 429], indirect=True)
def test_server_errors_and_throttling_are_transient(status_server: _StatusServer) -> None:
    store = _store_at(status_server.endpoint, client_retries=0)
    with pytest.raises(TransientStorageError):
        store.put("k", b"v")
    with pytest.raises(TransientStorageError):
        store.get("k")


@pytest.mark.parametrize("status_server", [400, 403, 501], indirect=True)
def test_client_errors_are_not_transient(status_server: _StatusServer) -> None:
    store = _store_at(status_server.endpoint, client_retries=0)
    with pytest.raises(StorageError) as info:
        store.put("k", b"v")
    assert not isinstance(info.value, TransientStorageError)


@pytest.mark.parametrize("status_server", [503], indirect=True)
def test_obstore_internal_retries_are_bounded(status_server: _StatusServer) -> None:
    store = _store_at(status_server.endpoint)  # default client_retries
    with pytest.raises(TransientStorageError):
        store.put("k", b"v")
    assert status_server.requests == 3  # one try plus DEFAULT_CLIENT_RETRIES (2)


def test_stopped_server_is_transient_and_retry_after_restart_succeeds(
    isolated_s3_server: S3Server,
) -> None:
    server = isolated_s3_server
    bucket = server.create_bucket("retry-bucket")
    store = _store(server, bucket, "out", client_retries=0)
    key = bulk_object_key("q", "job-after-outage")
    data = os.urandom(MULTIPART)

    server.stop()
    with pytest.raises(TransientStorageError):
        store.put(key, data)
    with pytest.raises(TransientStorageError):
        store.exists(key)

    retries: list[int] = []

    def bring_back(attempt: int, error: TransientStorageError, delay: float) -> None:
        retries.append(attempt)
        if attempt == 2:
            # moto keeps state in memory, so the restarted server needs its bucket again.
            server.start()
            server.create_bucket(bucket)

    checksum = store.put_with_retry(key, data, attempts=5, base_delay=0.01, on_retry=bring_back)
    assert retries == [1, 2]
    assert checksum == compute_checksum(data)
    assert _keys(server, bucket) == [f"out/{key}"]
    assert _body(server, bucket, f"out/{key}") == data
    assert store.get(key, checksum=checksum) == data


def test_closed_port_is_transient_then_pointing_back_works(
    s3_server: S3Server, s3_bucket: str
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = int(s.getsockname()[1])
    dead = _store(s3_server, s3_bucket, endpoint=f"http://127.0.0.1:{closed}", client_retries=0)
    with pytest.raises(TransientStorageError, match="transient"):
        dead.put_with_retry("k", b"v", attempts=3, base_delay=0.01)
    live = _store(s3_server, s3_bucket)
    checksum = live.put_with_retry("k", b"v", attempts=3, base_delay=0.01)
    assert _keys(s3_server, s3_bucket) == ["k"]
    assert live.get("k", checksum=checksum) == b"v"


# --- lost responses ---------------------------------------------------------------------------

_REQUEST_LINE = re.compile(rb"^(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.[01]\r\n")


class _LossyProxy:
    """A TCP proxy to ``upstream_port`` that can lose the response to a chosen request.

    When a request line matches ``lose_response_to``, the request is forwarded in full, the
    server processes it, and the proxy then closes the client connection instead of relaying
    the answer: the client sees a dropped connection for a write that did happen.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.lose_response_to: Callable[[str, str], bool] = lambda method, target: False
        self.lost: list[str] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            doomed = threading.Event()
            threading.Thread(
                target=self._requests, args=(client, upstream, doomed), daemon=True
            ).start()
            threading.Thread(
                target=self._responses, args=(upstream, client, doomed), daemon=True
            ).start()

    def _requests(self, src: socket.socket, dst: socket.socket, doomed: threading.Event) -> None:
        try:
            while chunk := src.recv(1 << 16):
                # A new request starts a fresh write from the client, so its line leads a chunk.
                m = _REQUEST_LINE.match(chunk)
                if m is not None:
                    method, target = m.group(1).decode(), m.group(2).decode()
                    with self._lock:
                        if self.lose_response_to(method, target):
                            self.lose_response_to = lambda method, target: False  # once
                            self.lost.append(f"{method} {target}")
                            doomed.set()
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(src, dst)

    def _responses(self, src: socket.socket, dst: socket.socket, doomed: threading.Event) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if doomed.is_set():
                    return  # the server answered, so the request took effect; drop the answer
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(src, dst)


def _close(*socks: socket.socket) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


@pytest.fixture
def lossy_proxy(s3_server: S3Server) -> Iterator[_LossyProxy]:
    proxy = _LossyProxy(s3_server.port)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("size", "method", "marker"),
    [(SMALL, "PUT", ""), (MULTIPART, "POST", "uploadId=")],
    ids=["single-put", "multipart-complete"],
)
def test_lost_response_is_retried_without_a_duplicate(
    s3_server: S3Server,
    s3_bucket: str,
    lossy_proxy: _LossyProxy,
    size: int,
    method: str,
    marker: str,
) -> None:
    key = bulk_object_key("q", f"job-{size}")
    full_key = f"out/{key}"
    lossy_proxy.lose_response_to = lambda m, target: m == method and marker in target
    store = _store(s3_server, s3_bucket, "out", endpoint=lossy_proxy.endpoint, client_retries=0)
    data = os.urandom(size)
    landed: list[bool] = []

    def check_it_landed(attempt: int, error: TransientStorageError, delay: float) -> None:
        # The failed attempt did write the object: exactly the case a naive retry duplicates.
        landed.append(_keys(s3_server, s3_bucket) == [full_key])

    checksum = store.put_with_retry(key, data, base_delay=0.01, on_retry=check_it_landed)
    assert len(lossy_proxy.lost) == 1, lossy_proxy.lost
    assert landed == [True]
    assert _keys(s3_server, s3_bucket) == [full_key]
    assert _body(s3_server, s3_bucket, full_key) == data
    assert store.get(key, checksum=checksum) == data
