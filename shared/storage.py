"""Object storage for bulk result arrays, through obstore.

The consumer writes encoded result arrays with ``put`` (or ``put_with_retry``) and records the
returned checksum next to the key; the client later reads them back with ``get(key,
checksum=...)``. Supported locations:

* ``file:///abs/path``, ``file://./rel/path`` or a plain filesystem path (created if missing);
* ``memory://`` (a fresh in-process store, for tests);
* ``s3://bucket/optional/prefix`` (AWS S3, MinIO, moto, ...). Endpoint, region and credentials
  come from the arguments of ``ObjectStore.from_url`` and otherwise from obstore's standard
  environment handling (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ...).

All failures surface as ``StorageError`` subclasses; ``TransientStorageError`` marks the ones
worth retrying (connection failures, timeouts, 5xx, throttling).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote

import obstore
from obstore.exceptions import BaseError as _ObstoreBaseError
from obstore.store import LocalStore, MemoryStore, S3Store

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config
    from obstore.store import ObjectStore as _RawStore

    from shared.settings import StorageSettings

__all__ = [
    "CHECKSUM_ALGORITHM",
    "MULTIPART_CHUNK_SIZE",
    "MULTIPART_THRESHOLD",
    "SUPPORTED_SCHEMES",
    "ChecksumMismatch",
    "ObjectNotFound",
    "ObjectStore",
    "StorageError",
    "TransientStorageError",
    "bulk_object_key",
    "compute_checksum",
]

# Payloads above this go up as multipart uploads: parts upload in parallel and a failed part
# is retried on its own instead of resending the whole object.
MULTIPART_THRESHOLD: Final = 8 * 1024 * 1024
# S3 rejects parts below 5 MiB (except the last), so the part size must stay at or above that.
MULTIPART_CHUNK_SIZE: Final = 8 * 1024 * 1024
_S3_MIN_PART_SIZE: Final = 5 * 1024 * 1024

CHECKSUM_ALGORITHM: Final = "sha256"
_CHECKSUM_RE: Final = re.compile(r"^sha256:[0-9a-f]{64}$")

SUPPORTED_SCHEMES: Final = ("file://", "memory://", "s3://")

# obstore retries inside each call as well; keep that short so that a dead endpoint surfaces as
# TransientStorageError within about a second and the caller's own backoff policy decides.
DEFAULT_CLIENT_RETRIES: Final = 2
_S3_KEY_MAX_BYTES: Final = 1024


class StorageError(Exception):
    """Base class for every object-storage failure raised by this module."""


class ObjectNotFound(StorageError):
    """The requested key does not exist in the store."""


class ChecksumMismatch(StorageError):
    """The object's bytes do not match the checksum recorded when it was written."""


class TransientStorageError(StorageError):
    """A failure that may succeed on retry: connection refused/reset, timeout, 5xx, throttling."""


def compute_checksum(data: bytes | bytearray | memoryview) -> str:
    """Return the checksum string that ``put`` records for ``data`` (``"sha256:<hex>"``)."""
    return f"{CHECKSUM_ALGORITHM}:{hashlib.sha256(data).hexdigest()}"


_UNSAFE_CHARS: Final = re.compile(r"[^A-Za-z0-9._-]+")
_READABLE_MAX: Final = 64


def _readable(text: str) -> str:
    """Squash ``text`` to a short run of path-safe characters; only for humans reading keys."""
    cleaned = _UNSAFE_CHARS.sub("_", text).lstrip(".")[:_READABLE_MAX]
    return cleaned or "_"


def bulk_object_key(queue: str, job_id: str) -> str:
    """Return the deterministic object-store key under which the bulk arrays of ``job_id`` are
    stored (the Redis record of the result is `shared.keys.result_key`).

    Shape: ``results/<queue>/<2 hex>/<job id>.<32 hex>.tqa``. Queue and job id are sanitised
    for readability only; uniqueness comes from the sha256 of both (128 bits kept), because
    sanitising is lossy ("a:b" and "a/b" both read "a_b"). The two-character fan-out keeps
    directories small on local filesystems and spreads S3 key prefixes. Changing this function
    orphans results already written, so treat it as part of the storage format.
    """
    if not queue or not job_id:
        raise ValueError(f"queue and job_id must be non-empty (got {queue!r}, {job_id!r})")
    # Length-prefixing the queue keeps ("ab", "c") and ("a", "bc") apart.
    material = f"{len(queue)}:{queue}|{job_id}".encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(material).hexdigest()
    return f"results/{_readable(queue)}/{digest[:2]}/{_readable(job_id)}.{digest[:32]}.tqa"


def _validate_key(key: str) -> None:
    """Reject keys that object stores disagree on or that could escape a local root."""
    if not isinstance(key, str) or not key:
        raise StorageError(f"object key must be a non-empty string, got {key!r}")
    if len(key.encode("utf-8", "surrogatepass")) > _S3_KEY_MAX_BYTES:
        raise StorageError(f"object key is longer than {_S3_KEY_MAX_BYTES} bytes: {key[:80]!r}...")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise StorageError(
            f"invalid object key {key!r}: no leading/trailing/double '/' and no '.' or '..' parts"
        )
    if any(ord(ch) < 0x20 or ch in "\x7f\\" for ch in key):
        raise StorageError(f"invalid object key {key!r}: control characters and '\\' not allowed")


def _parse_checksum(checksum: str) -> str:
    normalized = checksum.strip().lower() if isinstance(checksum, str) else ""
    if not _CHECKSUM_RE.match(normalized):
        raise StorageError(f"malformed checksum {checksum!r}; expected 'sha256:<64 hex digits>'")
    return normalized


_STATUS_RE: Final = re.compile(r"non-2xx status code: (\d{3})")
# object_store's HttpErrorKind values that describe a broken exchange rather than a bad request.
_HTTP_KIND_RE: Final = re.compile(r"HttpError \{\s*kind: (\w+)")
_TRANSIENT_HTTP_KINDS: Final = frozenset({"Connect", "Request", "Timeout", "Interrupted", "Decode"})
_TRANSIENT_STATUSES: Final = frozenset({408, 429})


def _is_transient(exc: BaseException) -> bool:
    """Decide whether a failure from obstore is worth retrying.

    obstore exposes connection failures and server errors only as ``GenericError`` whose text
    carries object_store's debug rendering, so this has to read the message. Tests against a
    closed port and against a server answering 5xx pin the expected wording.
    """
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if not isinstance(exc, _ObstoreBaseError):
        return False
    text = str(exc)
    status = _STATUS_RE.search(text)
    if status is not None:
        code = int(status.group(1))
        # 501 Not Implemented will not start working on a retry.
        return code in _TRANSIENT_STATUSES or (code >= 500 and code != 501)
    kind = _HTTP_KIND_RE.search(text)
    return kind is not None and kind.group(1) in _TRANSIENT_HTTP_KINDS


_ABORT_RE: Final = re.compile(r"method: DELETE,\s*uri: Some\(\s*\S+[?&]uploadId=")


def _is_lost_multipart_abort(exc: BaseException) -> bool:
    """Whether a put failed in obstore's abort of its own multipart upload with a 404.

    When the response to CompleteMultipartUpload is lost, the object exists but obstore still
    aborts the upload; S3 answers NoSuchUpload and obstore raises that 404 in place of the
    original connection error, which would otherwise read as "bucket missing".
    """
    text = str(exc)
    return "NoSuchUpload" in text or _ABORT_RE.search(text) is not None


def _summary(exc: BaseException) -> str:
    """First line of an obstore error: the rest is a multi-line Rust debug dump."""
    text = str(exc).split("\n\nDebug source:", 1)[0].strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first if len(first) <= 500 else first[:500] + "..."


def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on", "y")


class ObjectStore:
    """A typed wrapper around an obstore store with checksums, key checks and error mapping."""

    def __init__(
        self,
        store: _RawStore,
        *,
        url: str,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        multipart_chunk_size: int = MULTIPART_CHUNK_SIZE,
    ) -> None:
        """Wrap an already-built obstore ``store`` whose root is described by ``url``.

        Most callers want ``ObjectStore.from_url``; this constructor exists for callers that
        need obstore options the factory does not expose.
        """
        if multipart_chunk_size < _S3_MIN_PART_SIZE:
            raise ValueError(
                f"multipart_chunk_size must be at least {_S3_MIN_PART_SIZE} bytes (S3 minimum)"
            )
        self._store = store
        # "memory://" has no path to strip; url_for relies on the trailing "://" staying.
        self._url = url if url.endswith("://") else url.rstrip("/")
        self._multipart_threshold = multipart_threshold
        self._multipart_chunk_size = multipart_chunk_size

    @classmethod
    def from_settings(cls, storage: StorageSettings, *, url: str | None = None) -> ObjectStore:
        """The store `storage.url` names (or `url`, e.g. a dataset's output location), with the
        S3 endpoint, region and keys of the `storage` settings."""
        return cls.from_url(
            storage.url if url is None else url,
            endpoint=storage.endpoint,
            region=storage.region,
            access_key_id=storage.access_key_id,
            secret_access_key=storage.secret_access_key,
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        allow_http: bool | None = None,
        client_retries: int = DEFAULT_CLIENT_RETRIES,
    ) -> ObjectStore:
        """Open the store at ``url`` (``file://``, plain path, ``memory://`` or ``s3://``).

        S3 settings left as None fall back to obstore's environment handling. ``allow_http``
        left as None follows ``AWS_ALLOW_HTTP`` if set, else is enabled when the endpoint is an
        explicit ``http://`` URL (local MinIO/moto). ``client_retries`` bounds obstore's own
        per-request retries; 0 makes every failure surface immediately.
        """
        scheme, sep, rest = url.partition("://")
        if not sep:
            return cls._local(Path(url), url)
        scheme = scheme.lower()
        if scheme == "file":
            # file://localhost/x is the RFC 8089 spelling of file:///x.
            if rest.startswith("localhost/"):
                rest = rest[len("localhost") :]
            return cls._local(Path(unquote(rest)), url)
        if scheme == "memory":
            return cls(MemoryStore(), url="memory://")
        if scheme == "s3":
            return cls._s3(
                rest,
                endpoint=endpoint,
                region=region,
                access_key_id=access_key_id,
                secret_access_key=secret_access_key,
                allow_http=allow_http,
                client_retries=client_retries,
            )
        raise StorageError(
            f"unsupported storage URL scheme {scheme!r} in {url!r}; supported: "
            + ", ".join(SUPPORTED_SCHEMES)
            + " (or a plain filesystem path)"
        )

    @classmethod
    def _local(cls, path: Path, url: str) -> ObjectStore:
        root = path.expanduser().resolve()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create local store directory {root} for {url!r}: {exc}"
            ) from exc
        return cls(LocalStore(prefix=root), url=root.as_uri())

    @classmethod
    def _s3(
        cls,
        rest: str,
        *,
        endpoint: str | None,
        region: str | None,
        access_key_id: str | None,
        secret_access_key: str | None,
        allow_http: bool | None,
        client_retries: int,
    ) -> ObjectStore:
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not bucket:
            raise StorageError(f"s3 URL needs a bucket: 's3://{rest}'")
        config: S3Config = {}
        if endpoint is not None:
            config["endpoint"] = endpoint
        if region is not None:
            config["region"] = region
        if access_key_id is not None:
            config["access_key_id"] = access_key_id
        if secret_access_key is not None:
            config["secret_access_key"] = secret_access_key

        if allow_http is None and "AWS_ALLOW_HTTP" not in os.environ:
            effective = (
                endpoint
                or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL")
                or os.environ.get("AWS_ENDPOINT")
            )
            if effective is not None and effective.lower().startswith("http://"):
                allow_http = True
        # Passing any client_options replaces obstore's env-derived ones (AWS_ALLOW_HTTP
        # included), so only pass them when we have something to say.
        client_options: ClientConfig | None = (
            {"allow_http": allow_http} if allow_http is not None else None
        )
        retry_config: RetryConfig = {
            "max_retries": client_retries,
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(seconds=1),
                "base": 2,
            },
            "retry_timeout": timedelta(seconds=30),
        }
        try:
            store = S3Store(
                bucket,
                prefix=prefix or None,
                config=config,
                client_options=client_options,
                retry_config=retry_config,
            )
        except (_ObstoreBaseError, ValueError) as exc:
            raise StorageError(f"cannot configure s3://{rest}: {_summary(exc)}") from exc
        url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        return cls(store, url=url)

    @property
    def url(self) -> str:
        """The store's root location, e.g. ``s3://bucket/prefix`` or ``file:///data/results``."""
        return self._url

    def __repr__(self) -> str:
        return f"ObjectStore({self._url!r})"

    def url_for(self, key: str) -> str:
        """Return a human-readable location for ``key`` (for logs and CLI output)."""
        return f"{self._url}/{key}"  # for "memory://" this gives "memory:///key", as intended

    def _error(self, exc: Exception, op: str, key: str) -> StorageError:
        where = self.url_for(key)
        if isinstance(exc, FileNotFoundError):
            if op == "put" and _is_lost_multipart_abort(exc):
                return TransientStorageError(
                    f"put {where}: multipart upload failed and aborting it found no upload (it "
                    f"may have completed); outcome unknown, safe to retry: {_summary(exc)}"
                )
            # S3 answers 404 for a missing bucket too; on put that is the only possible cause.
            if op == "put" or "NoSuchBucket" in str(exc):
                return StorageError(f"{op} {where}: bucket or root does not exist: {_summary(exc)}")
            return ObjectNotFound(f"object {key!r} not found in {self._url}")
        if _is_transient(exc):
            return TransientStorageError(f"{op} {where} failed (transient): {_summary(exc)}")
        return StorageError(f"{op} {where} failed: {_summary(exc)}")

    def put(self, key: str, data: bytes) -> str:
        """Store ``data`` under ``key`` and return its checksum (``"sha256:<hex>"``).

        The write is atomic (readers see the old object or the whole new one, never a partial
        one) and idempotent: writing the same bytes again leaves the same single object.
        Payloads above ``MULTIPART_THRESHOLD`` use a multipart upload.
        """
        _validate_key(key)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"data for {key!r} must be bytes, got {type(data).__name__}")
        checksum = compute_checksum(data)
        self._put(key, data)
        return checksum

    def _put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        try:
            obstore.put(
                self._store,
                key,
                data,
                use_multipart=len(data) > self._multipart_threshold,
                chunk_size=self._multipart_chunk_size,
            )
        except Exception as exc:
            raise self._error(exc, "put", key) from exc

    def put_with_retry(
        self,
        key: str,
        data: bytes,
        *,
        attempts: int = 5,
        base_delay: float = 0.05,
        max_delay: float = 5.0,
        on_retry: Callable[[int, TransientStorageError, float], None] | None = None,
        checksum: str | None = None,
    ) -> str:
        """Like ``put``, retrying ``TransientStorageError`` with exponential backoff and jitter.

        Safe to retry because ``put`` is idempotent: an attempt whose response was lost but
        which did land on the server is simply overwritten with identical bytes.
        ``on_retry(attempt, error, delay)`` is called before each sleep (for logging/metrics).
        Other errors propagate at once; after ``attempts`` failures the last transient error is
        re-raised as ``TransientStorageError``. ``checksum``: ``compute_checksum(data)`` where
        the caller has computed it already (a content-addressed key), so the bytes are hashed
        once.
        """
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        _validate_key(key)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"data for {key!r} must be bytes, got {type(data).__name__}")
        if checksum is None:
            checksum = compute_checksum(data)
        else:
            _parse_checksum(checksum)  # malformed: said here, not when a reader verifies
        last: TransientStorageError | None = None
        for attempt in range(1, attempts + 1):
            try:
                self._put(key, data)
                return checksum
            except TransientStorageError as exc:
                last = exc
                if attempt == attempts:
                    break
                # Jitter keeps many consumers that lost the same endpoint from retrying in step.
                delay = min(max_delay, base_delay * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                if on_retry is not None:
                    on_retry(attempt, exc, delay)
                time.sleep(delay)
        raise TransientStorageError(
            f"put {self.url_for(key)} still failing after {attempts} attempts: {last}"
        ) from last

    def get(self, key: str, *, checksum: str | None = None) -> bytes:
        """Return the bytes stored under ``key``.

        With ``checksum`` (as returned by ``put``) the bytes are verified and
        ``ChecksumMismatch`` is raised if they differ. Missing keys raise ``ObjectNotFound``.
        """
        _validate_key(key)
        expected = _parse_checksum(checksum) if checksum is not None else None
        try:
            data = obstore.get(self._store, key).bytes().to_bytes()
        except Exception as exc:
            raise self._error(exc, "get", key) from exc
        if expected is not None:
            self._verify(key, data, expected)
        return data

    async def get_async(self, key: str, *, checksum: str | None = None) -> bytes:
        """``get`` for asyncio callers: the read does not block the event loop (obstore's
        native async API); the checksum is verified the same way."""
        _validate_key(key)
        expected = _parse_checksum(checksum) if checksum is not None else None
        try:
            result = await obstore.get_async(self._store, key)
            data = (await result.bytes_async()).to_bytes()
        except Exception as exc:
            raise self._error(exc, "get", key) from exc
        if expected is not None:
            self._verify(key, data, expected)
        return data

    def _verify(self, key: str, data: bytes, expected: str) -> None:
        actual = compute_checksum(data)
        if actual != expected:
            raise ChecksumMismatch(
                f"checksum mismatch for {self.url_for(key)}: expected {expected}, "
                f"got {actual} ({len(data)} bytes)"
            )

    def exists(self, key: str) -> bool:
        """Return whether an object is stored under ``key``."""
        _validate_key(key)
        try:
            obstore.head(self._store, key)
        except FileNotFoundError:
            return False
        except Exception as exc:
            raise self._error(exc, "head", key) from exc
        return True

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a key that does not exist is not an error."""
        _validate_key(key)
        try:
            obstore.delete(self._store, key)
        except FileNotFoundError:
            # S3 deletes are already idempotent; make the local store behave the same.
            return
        except Exception as exc:
            raise self._error(exc, "delete", key) from exc
