"""Dataset jobs: ingest a JSONL or Parquet file into a queue, export its results to Parquet.

Every step is an rq job (JSON serializer, never pickle; never GPU work: rq forks per job):

- `submit_dataset` writes the dataset record (state `ingesting`) and enqueues `ingest_job`.
- `ingest_job` reads rows from the recorded offset, turns each into a TeacherRequest with job id
  `<dataset id>:<row index>` and submits it through `TeacherClient.submit` (validation and
  idempotency live there), waiting on the done stream while the queue holds more pending tokens
  than the dataset's bound. After every batch it records the next row, byte offset and counts,
  fenced by the dataset lease, so a crashed or repeated ingest resumes where the last batch
  ended; a batch submitted again after a crash is a no-op (submit is idempotent by job id). Bad
  rows are recorded with their reason and never stop the ingest. It runs for a bounded slice,
  then enqueues its own continuation; at the end of the input it marks the dataset `ingested`
  and enqueues `finalize_job`.
- `finalize_job` follows completions (XREAD BLOCK on the done stream, plus sweeps of the result
  records for anything the stream did not show) into per-row bitmaps; once every submitted row
  has a result it exports Parquet shards and `manifest.json` to the output (`exporting` ->
  `done`), otherwise it re-enqueues itself after its slice.
- `replay_dataset` requeues the dataset's failed rq jobs and re-submits its dead letters.

Only one job works on a dataset at a time: each holds the dataset lease (a key with a short TTL
that it refreshes) and waits for it if another holds it. A killed worker's job is found by rq
(StartedJobRegistry heartbeat expiry, shortened by `DatasetWorker`) and retried with
`Retry(max=3)`; after the last retry the dataset is marked `failed` and the rq job stays in
FailedJobRegistry for `replay_dataset`.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import redis
import structlog
from pydantic import BaseModel, ConfigDict, Field
from rq import Callback, Queue, Retry, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job as RqJob
from rq.serializers import JSONSerializer

from producer.client import TeacherClient
from shared import keys
from shared.errors import InvalidJob, TeacherqError
from shared.messages import Limits, TeacherRequest, TeacherResult, check_limits, parse_request
from shared.redis_server import connect
from shared.settings import Settings, StorageSettings, load_settings
from shared.storage import ObjectStore, StorageError

log = structlog.get_logger("teacherq.datasets")

# redis-py's replies, as this module reads them (the client does not decode responses).
_Entries = list[tuple[bytes, dict[bytes, bytes]]]
_XRead = list[tuple[bytes, _Entries]]

INGEST_QUEUE = "teacherq-ingest"
EXPORT_QUEUE = "teacherq-export"
# The first retry is immediate: the usual cause is a killed worker, and the new job resumes
# from the recorded offset. Later ones back off for Redis or object-store trouble.
RETRY_INTERVALS_S = (0, 10, 60)
LEASE_TTL_S = 10.0
LEASE_REFRESH_S = 2.0
SWEEP_INTERVAL_S = 30.0
RESULTS_CHUNK = 1000
MAX_MANIFEST_FAILURES = 10_000
RATE_SAMPLES = 60
ROW_FIELDS = frozenset(
    {
        "input_ids",
        "label_token_ids",
        "sample_n",
        "top_k",
        "return_entropy",
        "temperature",
        "seed",
        "metadata",
    }
)
_OPTION_FIELDS = ("sample_n", "top_k", "return_entropy", "temperature", "seed")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class DatasetError(TeacherqError):
    """A dataset cannot be submitted or found; the message says why."""


# ---------------------------------------------------------------------------------------------
# Redis keys. They belong in shared/keys.py; every one carries the queue's hash tag.


def _dq(queue: str) -> str:
    return f"{keys.PREFIX}:{{{queue}}}"


def datasets_index_key(queue: str) -> str:
    """Sorted set of the queue's dataset ids, scored by creation time."""
    return f"{_dq(queue)}:datasets"


def dataset_key(queue: str, dataset_id: str) -> str:
    """Hash: the dataset record (spec, state, timestamps, ingest progress)."""
    return f"{_dq(queue)}:dataset:{dataset_id}"


def rejected_key(queue: str, dataset_id: str) -> str:
    """Hash row index -> reason, for rows refused at ingest."""
    return f"{dataset_key(queue, dataset_id)}:rejected"


def finished_key(queue: str, dataset_id: str) -> str:
    """Bitmap: bit i set once row i has a result record (ok or failed)."""
    return f"{dataset_key(queue, dataset_id)}:finished"


def failed_key(queue: str, dataset_id: str) -> str:
    """Bitmap: bit i set when row i's result is a failure."""
    return f"{dataset_key(queue, dataset_id)}:failed"


def rate_key(queue: str, dataset_id: str) -> str:
    """List of recent `[time, finished rows]` samples (newest first), for the ETA."""
    return f"{dataset_key(queue, dataset_id)}:rate"


def lease_key(queue: str, dataset_id: str) -> str:
    """Owner token of the one job working on the dataset, with a short TTL."""
    return f"{dataset_key(queue, dataset_id)}:lease"


# ---------------------------------------------------------------------------------------------
# The dataset record


class RequestOptions(BaseModel):
    """Request options applied to every row; a row's own value wins."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    top_k: int = 0
    sample_n: int = 0
    return_entropy: bool = False
    temperature: float = 1.0
    seed: int = 0


class DatasetSpec(BaseModel):
    """What a dataset is (input, queue, options: its identity) and how to run it (the rest)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    v: int = 1
    dataset_id: str
    input: str
    format: Literal["jsonl", "parquet"]
    queue: str
    options: RequestOptions = RequestOptions()
    output: str
    batch_rows: int = Field(default=256, ge=1, le=2000)
    max_pending_tokens: int = Field(default=4_000_000, ge=1)
    shard_rows: int = Field(default=10_000, ge=1)
    slice_s: float = Field(default=120.0, gt=0)
    retry_intervals: tuple[int, ...] = RETRY_INTERVALS_S

    def identity(self) -> tuple[str, str, str, RequestOptions]:
        """The fields an existing dataset id must agree on."""
        return (self.input, self.format, self.queue, self.options)


_INT_FIELDS = (
    "total_rows",
    "next_row",
    "byte_offset",
    "rows_queued",
    "rows_rejected",
    "tokens_queued",
)
_TIME_FIELDS = (
    "created_at",
    "updated_at",
    "ingest_started_at",
    "ingested_at",
    "export_started_at",
    "done_at",
)


@dataclass
class DatasetRecord:
    """A dataset as stored in its Redis hash."""

    spec: DatasetSpec
    state: str
    error: str | None = None
    rq_job: str | None = None
    total_rows: int | None = None
    next_row: int = 0
    byte_offset: int = 0
    rows_queued: int = 0
    rows_rejected: int = 0
    tokens_queued: int = 0
    done_cursor: str = "0-0"
    ignored_fields: list[str] = field(default_factory=list)
    created_at: float | None = None
    updated_at: float | None = None
    ingest_started_at: float | None = None
    ingested_at: float | None = None
    export_started_at: float | None = None
    done_at: float | None = None

    @property
    def dataset_id(self) -> str:
        """The dataset id."""
        return self.spec.dataset_id

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> DatasetRecord:
        """Parse the Redis hash."""
        f = {k.decode(): v.decode() for k, v in raw.items()}
        rec = cls(
            spec=DatasetSpec.model_validate_json(f["spec"]),
            state=f["state"],
            error=f.get("error") or None,
            rq_job=f.get("rq_job") or None,
            done_cursor=f.get("done_cursor", "0-0"),
            ignored_fields=json.loads(f.get("ignored_fields", "[]")),
        )
        for name in _INT_FIELDS:
            if f.get(name, "") != "":
                setattr(rec, name, int(f[name]))
        for name in _TIME_FIELDS:
            if f.get(name, "") != "":
                setattr(rec, name, float(f[name]))
        return rec

    def to_hash(self) -> dict[str, str]:
        """Every field as hash values."""
        out = {
            "spec": self.spec.model_dump_json(),
            "state": self.state,
            "error": self.error or "",
            "rq_job": self.rq_job or "",
            "done_cursor": self.done_cursor,
            "ignored_fields": json.dumps(sorted(self.ignored_fields)),
        }
        for name in (*_INT_FIELDS, *_TIME_FIELDS):
            value = getattr(self, name)
            out[name] = "" if value is None else str(value)
        return out


def load_record(r: redis.Redis, queue: str, dataset_id: str) -> DatasetRecord | None:
    """The dataset's record, or None."""
    raw = cast(dict[bytes, bytes], r.hgetall(dataset_key(queue, dataset_id)))
    return DatasetRecord.from_hash(raw) if raw else None


# ---------------------------------------------------------------------------------------------
# Identity


def normalize_location(location: str) -> str:
    """An input/output location in the form stored and hashed: s3:// URLs as given (no
    trailing slash), local paths and file:// URLs as absolute paths."""
    if location.startswith("s3://"):
        return location.rstrip("/")
    if location.startswith("file://"):
        location = location[len("file://") :]
    return Path(location).expanduser().resolve().as_posix()


def derive_dataset_id(input_location: str, *, queue: str, options: RequestOptions) -> str:
    """Deterministic dataset id from the normalized input location, queue and options."""
    material = json.dumps(
        {"input": input_location, "queue": queue, "options": options.model_dump()},
        sort_keys=True,
    )
    return "ds-" + hashlib.sha256(material.encode()).hexdigest()[:16]


def check_dataset_id(dataset_id: str) -> str:
    """Validate a caller-chosen dataset id (it prefixes job ids `<id>:<row>`)."""
    if not _ID_RE.match(dataset_id):
        raise DatasetError(
            f"dataset id {dataset_id!r} is invalid: 1-64 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return dataset_id


def row_job_id(dataset_id: str, index: int) -> str:
    """The job id of row `index`."""
    return f"{dataset_id}:{index}"


# ---------------------------------------------------------------------------------------------
# Reading rows


@dataclass(frozen=True)
class RawRow:
    """One input row: its fields, or why it could not be read; `offset` is where the next row
    starts (bytes for JSONL, rows for Parquet)."""

    index: int
    fields: dict[str, Any] | None
    error: str | None
    offset: int


def detect_format(location: str, head: bytes) -> Literal["jsonl", "parquet"]:
    """Parquet by suffix or magic bytes, JSONL otherwise."""
    suffix = location.rsplit(".", 1)[-1].lower()
    if suffix in ("parquet", "pq") or head[:4] == b"PAR1":
        return "parquet"
    return "jsonl"


def iter_jsonl(f: BinaryIO, *, start_row: int = 0, start_byte: int = 0) -> Iterator[RawRow]:
    """Rows of a JSONL stream from a byte offset; blank lines are skipped and do not count."""
    f.seek(start_byte)
    offset, index = start_byte, start_row
    for line in f:
        offset += len(line)
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            yield RawRow(index, None, f"not valid JSON: {exc}", offset)
        else:
            if isinstance(obj, dict):
                yield RawRow(index, obj, None, offset)
            else:
                yield RawRow(
                    index, None, f"expected a JSON object, got {type(obj).__name__}", offset
                )
        index += 1


def iter_parquet(f: BinaryIO, *, start_row: int = 0, batch_rows: int = 1024) -> Iterator[RawRow]:
    """Rows of a Parquet file from a row index, reading only the known columns and starting at
    the row group that holds `start_row`."""
    pf = pq.ParquetFile(f)
    md = pf.metadata
    group, group_start = 0, 0
    while group < md.num_row_groups and group_start + md.row_group(group).num_rows <= start_row:
        group_start += md.row_group(group).num_rows
        group += 1
    if group >= md.num_row_groups:
        return
    columns = [c for c in pf.schema_arrow.names if c in ROW_FIELDS]
    index = group_start
    for batch in pf.iter_batches(
        batch_size=batch_rows, row_groups=range(group, md.num_row_groups), columns=columns
    ):
        for row in batch.to_pylist():
            if index >= start_row:
                yield RawRow(index, row, None, index + 1)
            index += 1


class _ReaderFile(io.RawIOBase):
    """A standard binary file over obstore's ReadableFile (which returns Bytes and lacks the
    `closed`/`readinto` that pyarrow and io.BufferedReader need)."""

    def __init__(self, reader: Any) -> None:
        self._r = reader

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = memoryview(self._r.read(len(buf)))
        memoryview(buf).cast("B")[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self._r.seek(offset, whence))

    def tell(self) -> int:
        return int(self._r.tell())

    def close(self) -> None:
        if not self.closed:
            self._r.close()
        super().close()


def _object_store(url: str, storage: StorageSettings) -> ObjectStore:
    return ObjectStore.from_url(
        url,
        endpoint=storage.endpoint,
        region=storage.region,
        access_key_id=storage.access_key_id,
        secret_access_key=storage.secret_access_key,
    )


@contextmanager
def open_input(location: str, storage: StorageSettings) -> Iterator[BinaryIO]:
    """A seekable binary file for a local path or an s3:// object (ranged reads through
    obstore, S3 settings from `storage`)."""
    if not location.startswith("s3://"):
        with open(location, "rb") as fh:
            yield fh
        return
    import obstore

    bucket, _, key = location[len("s3://") :].partition("/")
    store = _object_store(f"s3://{bucket}", storage)
    # ObjectStore has no ranged/streaming read yet; its wrapped obstore store is used directly.
    reader = obstore.open_reader(store._store, key)
    with io.BufferedReader(_ReaderFile(reader), buffer_size=1 << 20) as fh:
        yield fh  # type: ignore[misc]  # BufferedReader is a BinaryIO in practice


def iter_rows(
    f: BinaryIO, fmt: str, *, start_row: int, start_byte: int, batch_rows: int
) -> Iterator[RawRow]:
    """Rows of either format from a recorded position."""
    if fmt == "parquet":
        return iter_parquet(f, start_row=start_row, batch_rows=batch_rows)
    return iter_jsonl(f, start_row=start_row, start_byte=start_byte)


@dataclass(frozen=True)
class InputInfo:
    """What a quick look at the input tells: format, row count (Parquet), column names."""

    format: Literal["jsonl", "parquet"]
    total_rows: int | None
    columns: list[str] | None


def probe_input(location: str, storage: StorageSettings) -> InputInfo:
    """Open the input and check it looks usable; raise DatasetError naming what is wrong."""
    try:
        with open_input(location, storage) as f:
            fmt = detect_format(location, f.read(4))
            f.seek(0)
            if fmt == "jsonl":
                return InputInfo("jsonl", None, None)
            pf = pq.ParquetFile(f)
            names = list(pf.schema_arrow.names)
            if "input_ids" not in names:
                raise DatasetError(f"{location}: Parquet file has no input_ids column ({names})")
            return InputInfo("parquet", pf.metadata.num_rows, names)
    except (OSError, StorageError, pa.ArrowException) as exc:
        raise DatasetError(f"cannot read {location}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Rows to requests


def row_request(row: Mapping[str, Any], *, options: RequestOptions, job_id: str) -> TeacherRequest:
    """The request for one row: the dataset options, overridden by the row's own non-null
    values. Raises InvalidJob naming what is wrong with the row."""
    if row.get("input_ids") is None:
        raise InvalidJob("row has no input_ids")
    data: dict[str, Any] = options.model_dump()
    for name in _OPTION_FIELDS:
        if row.get(name) is not None:
            data[name] = row[name]
    data["input_ids"] = row["input_ids"]
    if row.get("label_token_ids") is not None:
        data["label_token_ids"] = row["label_token_ids"]
    meta = row.get("metadata")
    if isinstance(meta, str):  # Parquet files often carry metadata as a JSON string
        try:
            meta = json.loads(meta)
        except ValueError:
            raise InvalidJob("metadata is a string but not JSON") from None
    if meta is not None:
        if not isinstance(meta, dict):
            raise InvalidJob(f"metadata must be a JSON object, got {type(meta).__name__}")
        data["metadata"] = meta
    data["job_id"] = job_id
    return parse_request(data)


@dataclass
class PreparedBatch:
    """A batch of rows split into valid requests and rejected rows (index, reason);
    `resubmitted` rows failed validation now but were enqueued by an earlier attempt."""

    valid: list[tuple[int, TeacherRequest]]
    rejected: list[tuple[int, str]]
    ignored_fields: set[str]
    resubmitted: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Tokens of the valid requests."""
        return sum(req.num_tokens for _, req in self.valid)


def prepare_rows(
    rows: Sequence[RawRow], *, dataset_id: str, options: RequestOptions, limits: Limits
) -> PreparedBatch:
    """Validate rows against the request schema and the queue's limits."""
    out = PreparedBatch([], [], set())
    for row in rows:
        if row.fields is None:
            out.rejected.append((row.index, row.error or "unreadable row"))
            continue
        out.ignored_fields.update(k for k in row.fields if k not in ROW_FIELDS)
        try:
            req = row_request(row.fields, options=options, job_id=row_job_id(dataset_id, row.index))
            check_limits(req, limits)
        except InvalidJob as exc:
            out.rejected.append((row.index, str(exc)))
            continue
        out.valid.append((row.index, req))
    return out


# ---------------------------------------------------------------------------------------------
# Lease and progress writes (Lua: check the owner and write in one step)

_LEASE_REFRESH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_LEASE_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# KEYS: lease, record, rejected. ARGV: token, ttl ms, 2n, n record field/values, then rejected
# row/reason pairs. Writes only while the caller still owns the lease (fencing: a job that
# lost its lease, e.g. a stalled one whose TTL ran out, cannot move progress backwards).
_FENCED_WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local n = tonumber(ARGV[3])
if n > 0 then redis.call('HSET', KEYS[2], unpack(ARGV, 4, 3 + n)) end
if #ARGV > 3 + n then redis.call('HSET', KEYS[3], unpack(ARGV, 4 + n)) end
return 1
"""


class LeaseLost(TeacherqError):
    """Another job took over the dataset (this one stalled past the lease TTL)."""


class Lease:
    """Exclusive right to work on one dataset, kept alive by refresh() and fenced writes."""

    def __init__(self, r: redis.Redis, queue: str, dataset_id: str) -> None:
        self.r = r
        self.key = lease_key(queue, dataset_id)
        self.record_key = dataset_key(queue, dataset_id)
        self.rejected_key = rejected_key(queue, dataset_id)
        self.token = uuid.uuid4().hex
        self._last = 0.0

    def acquire(self, *, wait_s: float) -> None:
        """Take the lease, waiting up to wait_s for a holder to finish or its TTL to lapse."""
        deadline = time.monotonic() + wait_s
        while not self.r.set(self.key, self.token, nx=True, px=int(LEASE_TTL_S * 1000)):
            if time.monotonic() > deadline:
                raise LeaseLost(f"{self.key} still held after {wait_s:.0f}s")
            time.sleep(0.5)  # a lock hand-over has no event to block on
        self._last = time.monotonic()

    def refresh(self, *, force: bool = False) -> None:
        """Extend the TTL (at most every LEASE_REFRESH_S unless forced); raise if lost."""
        if not force and time.monotonic() - self._last < LEASE_REFRESH_S:
            return
        ok = self.r.eval(_LEASE_REFRESH, 1, self.key, self.token, int(LEASE_TTL_S * 1000))
        if not ok:
            raise LeaseLost(f"lost {self.key}")
        self._last = time.monotonic()

    def write(self, fields: Mapping[str, Any], rejected: Iterable[tuple[int, str]] = ()) -> None:
        """Write record fields (and rejected rows) only while holding the lease."""
        argv: list[Any] = [self.token, int(LEASE_TTL_S * 1000)]
        flat = [x for kv in fields.items() for x in kv]
        argv += [len(flat), *flat]
        argv += [x for pair in rejected for x in pair]
        ok = self.r.eval(_FENCED_WRITE, 3, self.key, self.record_key, self.rejected_key, *argv)
        if not ok:
            raise LeaseLost(f"lost {self.key} before writing")
        self._last = time.monotonic()

    def release(self) -> None:
        """Give the lease up if still ours."""
        self.r.eval(_LEASE_RELEASE, 1, self.key, self.token)


# ---------------------------------------------------------------------------------------------
# Completion tracking


class Tracker:
    """Marks rows finished (and failed) in bitmaps from done-stream announcements, and from
    sweeps of the result records for whatever the stream did not show (entries trimmed, or
    announced before the cursor)."""

    def __init__(self, client: TeacherClient, rec: DatasetRecord) -> None:
        self.client = client
        self.r = client.r
        q, ds = rec.spec.queue, rec.dataset_id
        self.queue, self.dataset_id = q, ds
        self.prefix = f"{ds}:"
        self.cursor = rec.done_cursor
        self.finished, self.failed = finished_key(q, ds), failed_key(q, ds)
        self.record = dataset_key(q, ds)
        self.rate = rate_key(q, ds)
        self._last_sample = 0.0

    def poll(self, *, block_ms: int | None) -> None:
        """Read new completion notices (blocking up to block_ms) and mark this dataset's rows."""
        reply = cast(
            _XRead,
            self.r.xread({self.client.streams.done: self.cursor}, count=10_000, block=block_ms),
        )
        marks: list[tuple[int, str]] = []
        for _stream, entries in reply or []:
            for entry_id, f in entries:
                self.cursor = entry_id.decode()
                job_id = f.get(b"job_id", b"").decode(errors="replace")
                tail = job_id[len(self.prefix) :]
                if job_id.startswith(self.prefix) and tail.isdigit():
                    marks.append((int(tail), f.get(b"status", b"ok").decode()))
        if reply:
            failed = [i for i, status in marks if status != "ok"]
            # A failure notice may be stale (replayed since): trust the record, not the notice.
            statuses = dict(zip(failed, self._statuses(failed), strict=True))
            self._mark([(i, statuses.get(i, s)) for i, s in marks])
            self.r.hset(self.record, "done_cursor", self.cursor)
        self._sample()

    def sweep(self, upto: int) -> None:
        """Look up the result record of every submitted row below `upto` not marked yet."""
        raw = cast(bytes | None, self.r.get(self.finished)) or b""
        bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8))[:upto]
        unset = np.flatnonzero(np.concatenate([bits, np.zeros(upto - len(bits), np.uint8)]) == 0)
        rejected = {int(i) for i in self.r.hkeys(rejected_key(self.queue, self.dataset_id))}
        todo = [int(i) for i in unset if int(i) not in rejected]
        for start in range(0, len(todo), RESULTS_CHUNK):
            chunk = todo[start : start + RESULTS_CHUNK]
            found = [(i, s) for i, s in zip(chunk, self._statuses(chunk), strict=True) if s]
            self._mark(found)
        self._sample()

    def _statuses(self, rows: Sequence[int]) -> list[str | None]:
        pipe = self.r.pipeline(transaction=False)
        for i in rows:
            pipe.hget(keys.result_key(self.queue, row_job_id(self.dataset_id, i)), "status")
        return [s.decode() if s else None for s in pipe.execute()]

    def _mark(self, rows: Sequence[tuple[int, str | None]]) -> None:
        if not rows:
            return
        pipe = self.r.pipeline(transaction=False)
        for i, status in rows:
            if status is None:  # no record after all (replayed since): not finished
                pipe.setbit(self.finished, i, 0)
                pipe.setbit(self.failed, i, 0)
                continue
            pipe.setbit(self.finished, i, 1)
            pipe.setbit(self.failed, i, int(status != "ok"))
        pipe.execute()

    def counts(self) -> tuple[int, int]:
        """(rows finished, rows failed) as marked so far."""
        pipe = self.r.pipeline(transaction=False)
        pipe.bitcount(self.finished)
        pipe.bitcount(self.failed)
        finished, failed = pipe.execute()
        return int(finished), int(failed)

    def _sample(self) -> None:
        now = time.time()
        if now - self._last_sample < 2.0:
            return
        self._last_sample = now
        pipe = self.r.pipeline(transaction=False)
        pipe.lpush(self.rate, json.dumps([round(now, 3), self.counts()[0]]))
        pipe.ltrim(self.rate, 0, RATE_SAMPLES - 1)
        pipe.execute()


def estimate_eta(
    samples: Sequence[tuple[float, int]], *, remaining: int | None, window_s: float = 120.0
) -> tuple[float | None, float | None]:
    """(rows/s, seconds left) from `[time, finished]` samples (any order) over the last
    window_s; None where unknown."""
    if len(samples) < 2:
        return None, None
    ordered = sorted(samples)
    newest = ordered[-1]
    recent = [s for s in ordered if s[0] >= newest[0] - window_s]
    oldest = recent[0] if len(recent) > 1 else ordered[-2]
    dt = newest[0] - oldest[0]
    if dt <= 0:
        return None, None
    rate = (newest[1] - oldest[1]) / dt
    if remaining is None or rate <= 0:
        return rate, None
    return rate, remaining / rate


# ---------------------------------------------------------------------------------------------
# rq plumbing


def _retry(spec: DatasetSpec) -> Retry:
    return Retry(max=len(spec.retry_intervals), interval=list(spec.retry_intervals))


def enqueue_step(r: redis.Redis, kind: Literal["ingest", "finalize"], spec: DatasetSpec) -> str:
    """Enqueue the dataset's next rq job and record its id; returns the rq job id."""
    ingest = kind == "ingest"
    q = Queue(INGEST_QUEUE if ingest else EXPORT_QUEUE, connection=r, serializer=JSONSerializer)
    job_id = uuid.uuid4().hex
    # One MULTI: the job and the record naming it as the dataset's current job exist together
    # (the failure callback ignores jobs that are not current: stale duplicates).
    with r.pipeline() as pipe:
        q.enqueue(
            ingest_job if ingest else finalize_job,
            spec.queue,
            spec.dataset_id,
            retry=_retry(spec),
            on_failure=Callback(on_job_failure),
            # A slice plus room for a slow read or, for finalize, the export itself.
            job_timeout=int(spec.slice_s + (600 if ingest else 4 * 3600)),
            result_ttl=24 * 3600,
            failure_ttl=30 * 24 * 3600,
            meta={"dataset": spec.dataset_id, "queue": spec.queue, "kind": kind},
            description=f"{kind} {spec.queue}/{spec.dataset_id}",
            job_id=job_id,
            pipeline=pipe,
        )
        pipe.hset(dataset_key(spec.queue, spec.dataset_id), "rq_job", job_id)
        pipe.execute()
    return job_id


_ALIVE = ("queued", "started", "scheduled", "deferred")


def step_alive(r: redis.Redis, rq_job: str | None) -> bool:
    """Whether the dataset's recorded rq job will still run (a started job whose worker died
    counts: rq retries it)."""
    if not rq_job:
        return False
    try:
        job = RqJob.fetch(rq_job, connection=r, serializer=JSONSerializer)
    except NoSuchJobError:
        return False
    return str(job.get_status(refresh=False).value) in _ALIVE


def on_job_failure(
    job: RqJob, connection: redis.Redis, exc_type: type, exc: BaseException, _tb: Any
) -> None:
    """rq failure callback (also for abandoned jobs): mark the dataset failed once the job has
    no retries left, so `teacherq datasets` shows it and replay can pick it up."""
    meta = job.meta or {}
    queue, ds = meta.get("queue"), meta.get("dataset")
    if not queue or not ds:
        return
    if job.retries_left:
        log.warning("dataset.job_retry", dataset=ds, kind=meta.get("kind"), error=repr(exc))
        return
    current = cast(bytes | None, connection.hget(dataset_key(queue, ds), "rq_job"))
    if current is None or current.decode() != job.id:
        return  # a stale duplicate: the dataset has moved on to another job
    connection.hset(
        dataset_key(queue, ds),
        mapping={
            "state": "failed",
            "error": f"{exc_type.__name__}: {exc}"[:2000],
            "updated_at": time.time(),
        },
    )
    log.error("dataset.failed", dataset=ds, kind=meta.get("kind"), error=repr(exc))


def _job_client(queue: str) -> TeacherClient:
    # rq job entry points run in a forked work-horse: settings come from the worker's
    # environment like any teacherq process; the queue comes from the job.
    settings = load_settings()
    return TeacherClient(with_queue(settings, queue))


def with_queue(settings: Settings, queue: str) -> Settings:
    """The settings with another queue name."""
    if settings.queue.name == queue:
        return settings
    return settings.model_copy(update={"queue": settings.queue.model_copy(update={"name": queue})})


@contextmanager
def _leased(client: TeacherClient, dataset_id: str) -> Iterator[tuple[Lease, DatasetRecord]]:
    rec = load_record(client.r, client.queue, dataset_id)
    if rec is None:
        raise DatasetError(f"no dataset {dataset_id!r} in queue {client.queue!r}")
    lease = Lease(client.r, client.queue, dataset_id)
    # Wait long enough for a live holder to end its slice (a duplicate of this job, e.g. the
    # orphaned work-horse of a killed worker) before giving up to rq's retry.
    lease.acquire(wait_s=rec.spec.slice_s + 3 * LEASE_TTL_S)
    try:
        fresh = load_record(client.r, client.queue, dataset_id)
        assert fresh is not None
        yield lease, fresh
    finally:
        lease.release()


def ingest_job(queue: str, dataset_id: str) -> dict[str, Any]:
    """rq entry point: ingest the next slice of the dataset's rows."""
    with _job_client(queue) as client, _leased(client, dataset_id) as (lease, rec):
        if rec.state != "ingesting":
            return {"status": "skipped", "state": rec.state}
        return _ingest(client, lease, rec)


def finalize_job(queue: str, dataset_id: str) -> dict[str, Any]:
    """rq entry point: wait (one slice) for the dataset's rows to finish, then export."""
    with _job_client(queue) as client, _leased(client, dataset_id) as (lease, rec):
        if rec.state not in ("ingested", "exporting"):
            return {"status": "skipped", "state": rec.state}
        return _finalize(client, lease, rec)


def _continue(
    client: TeacherClient, kind: Literal["ingest", "finalize"], rec: DatasetRecord, **info: Any
) -> dict[str, Any]:
    job_id = enqueue_step(client.r, kind, rec.spec)
    log.info(f"dataset.{kind}.continued", dataset=rec.dataset_id, next_job=job_id, **info)
    return {"status": "continued", "next_job": job_id, **info}


# ---------------------------------------------------------------------------------------------
# Ingest


def _ingest(client: TeacherClient, lease: Lease, rec: DatasetRecord) -> dict[str, Any]:
    spec = rec.spec
    deadline = time.monotonic() + spec.slice_s
    tracker = Tracker(client, rec)
    if rec.ingest_started_at is None:
        rec.ingest_started_at = time.time()
        lease.write({"ingest_started_at": rec.ingest_started_at})
    with open_input(spec.input, client.settings.storage) as f:
        rows = iter_rows(
            f,
            spec.format,
            start_row=rec.next_row,
            start_byte=rec.byte_offset,
            batch_rows=spec.batch_rows,
        )
        for batch in _batched(rows, spec.batch_rows):
            if not _wait_for_room(client, spec, lease, tracker, deadline):
                return _continue(client, "ingest", rec, next_row=rec.next_row)
            _record_batch(lease, rec, batch, _submit_batch(client, spec, batch))
            tracker.poll(block_ms=None)
            if time.monotonic() > deadline:
                return _continue(client, "ingest", rec, next_row=rec.next_row)
    # Finalize first: it waits for our lease. Were we to die between the two, our retry reads
    # nothing more and comes back here, whereas a dataset marked ingested without a finalize
    # job would wait forever.
    job_id = enqueue_step(client.r, "finalize", spec)
    now = time.time()
    lease.write(
        {"state": "ingested", "total_rows": rec.next_row, "ingested_at": now, "updated_at": now}
    )
    log.info(
        "dataset.ingested",
        dataset=rec.dataset_id,
        rows=rec.next_row,
        queued=rec.rows_queued,
        rejected=rec.rows_rejected,
    )
    return {
        "status": "ingested",
        "rows": rec.next_row,
        "rejected": rec.rows_rejected,
        "next_job": job_id,
    }


def _record_batch(
    lease: Lease, rec: DatasetRecord, batch: list[RawRow], prepared: PreparedBatch
) -> None:
    """Advance the recorded position past `batch` (fenced by the lease). Counts are absolute,
    from the last recorded ones, so a batch submitted again after a crash is not counted twice.
    """
    rec.next_row = batch[-1].index + 1
    rec.byte_offset = batch[-1].offset if rec.spec.format == "jsonl" else 0
    rec.rows_queued += len(prepared.valid) + len(prepared.resubmitted)
    rec.rows_rejected += len(prepared.rejected)
    rec.tokens_queued += prepared.tokens
    rec.ignored_fields = sorted(set(rec.ignored_fields) | prepared.ignored_fields)
    fields = {
        "next_row": rec.next_row,
        "byte_offset": rec.byte_offset,
        "rows_queued": rec.rows_queued,
        "rows_rejected": rec.rows_rejected,
        "tokens_queued": rec.tokens_queued,
        "updated_at": time.time(),
        "ignored_fields": json.dumps(rec.ignored_fields),
    }
    lease.write(fields, prepared.rejected)


def _batched(rows: Iterator[RawRow], n: int) -> Iterator[list[RawRow]]:
    batch: list[RawRow] = []
    for row in rows:
        batch.append(row)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _wait_for_room(
    client: TeacherClient, spec: DatasetSpec, lease: Lease, tracker: Tracker, deadline: float
) -> bool:
    """Block on the done stream while the queue holds too many pending tokens; False if the
    slice ran out first."""
    while client.streams.pending_tokens() >= spec.max_pending_tokens:
        if time.monotonic() > deadline:
            return False
        lease.refresh()
        tracker.poll(block_ms=1000)
    return True


def _submit_batch(client: TeacherClient, spec: DatasetSpec, batch: list[RawRow]) -> PreparedBatch:
    prepared = prepare_rows(
        batch, dataset_id=spec.dataset_id, options=spec.options, limits=client.limits()
    )
    try:
        client.submit([req for _, req in prepared.valid])
    except InvalidJob:
        # The limits changed since prepare_rows (a consumer advertised its vocabulary):
        # submit one by one so only the offending rows are rejected.
        still_valid = []
        for index, req in prepared.valid:
            try:
                client.submit([req])
                still_valid.append((index, req))
            except InvalidJob as exc:
                prepared.rejected.append((index, str(exc).removeprefix("request 0: ")))
        prepared.valid = still_valid
    _keep_already_submitted(client, spec.dataset_id, prepared)
    return prepared


def _keep_already_submitted(
    client: TeacherClient, dataset_id: str, prepared: PreparedBatch
) -> None:
    """A row rejected now but enqueued by an earlier attempt (before a consumer advertised the
    vocabulary, say) is in the stream and will get a result: count it as queued."""
    if not prepared.rejected:
        return
    pipe = client.r.pipeline(transaction=False)
    for index, _ in prepared.rejected:
        pipe.exists(keys.submitted_key(client.queue, row_job_id(dataset_id, index)))
    flags = pipe.execute()
    prepared.resubmitted = [i for (i, _), was in zip(prepared.rejected, flags, strict=True) if was]
    prepared.rejected = [
        (i, why) for (i, why), was in zip(prepared.rejected, flags, strict=True) if not was
    ]


# ---------------------------------------------------------------------------------------------
# Finalize and export


def _finalize(client: TeacherClient, lease: Lease, rec: DatasetRecord) -> dict[str, Any]:
    if rec.state == "ingested":
        finished = _wait_finished(client, lease, rec)
        if finished is not None:
            return _continue(client, "finalize", rec, finished=finished)
        rec.export_started_at = time.time()
        lease.write(
            {
                "state": "exporting",
                "export_started_at": rec.export_started_at,
                "updated_at": rec.export_started_at,
            }
        )
    elif rec.export_started_at is None:
        rec.export_started_at = time.time()
    manifest = export_dataset(client, rec, refresh=lease.refresh)
    now = time.time()
    lease.write({"state": "done", "done_at": now, "updated_at": now, "error": ""})
    log.info("dataset.done", dataset=rec.dataset_id, **manifest["rows"])
    return {"status": "done", **manifest["rows"]}


def _wait_finished(client: TeacherClient, lease: Lease, rec: DatasetRecord) -> int | None:
    """Follow completions until every submitted row has a result (None), or the slice ends
    (the rows finished so far)."""
    deadline = time.monotonic() + rec.spec.slice_s
    tracker = Tracker(client, rec)
    tracker.sweep(rec.next_row)
    last_sweep = time.monotonic()
    while (finished := tracker.counts()[0]) < rec.rows_queued:
        if time.monotonic() > deadline:
            return finished
        lease.refresh()
        tracker.poll(block_ms=1000)
        if time.monotonic() - last_sweep > SWEEP_INTERVAL_S:
            tracker.sweep(rec.next_row)
            last_sweep = time.monotonic()
    return None


_FLOAT = pa.float32()
_INT = pa.int64()
# Result arrays: (name, dims, element type). Row j scores position j + 1 of input_ids.
_ARRAY_COLUMNS = (
    ("logprobs", 1, _FLOAT),
    ("label_logprobs", 2, _FLOAT),
    ("sampled_token_ids", 2, _INT),
    ("sampled_logprobs", 2, _FLOAT),
    ("topk_token_ids", 2, _INT),
    ("topk_logprobs", 2, _FLOAT),
    ("topk_rest_logprob", 1, _FLOAT),
    ("entropy", 1, _FLOAT),
)
EXPORT_SCHEMA = pa.schema(
    [
        ("row_index", pa.int64()),
        ("job_id", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("model_version", pa.string()),
    ]
    + [
        (name, pa.list_(pa.list_(t)) if dims == 2 else pa.list_(t))
        for name, dims, t in _ARRAY_COLUMNS
    ]
    + [("metadata", pa.string())]
)


@dataclass(frozen=True)
class ExportRow:
    """One output row: `status` is ok, failed (the teacher could not score it) or rejected
    (refused at ingest)."""

    row_index: int
    job_id: str
    status: Literal["ok", "failed", "rejected"]
    error: str | None
    result: TeacherResult | None


def _list_array(values: Sequence[np.ndarray | None], dims: int, typ: pa.DataType) -> pa.Array:
    """A (nested) list column from per-row numpy arrays, None for null, without going through
    Python lists."""
    dtype = typ.to_pandas_dtype()
    present = [np.asarray(v, dtype=dtype) for v in values if v is not None]
    mask = pa.array([v is None for v in values], type=pa.bool_())
    lengths = [0 if v is None else int(np.shape(v)[0]) for v in values]
    outer = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat = pa.array(
        np.concatenate([a.reshape(-1) for a in present]) if present else np.empty(0, dtype),
        type=typ,
    )
    if dims == 1:
        return pa.ListArray.from_arrays(outer, flat, mask=mask)
    widths = [np.full(a.shape[0], a.shape[1]) for a in present]
    inner_len = np.concatenate(widths) if widths else np.empty(0, np.int64)
    inner = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(inner_len)]).astype(np.int32)), flat
    )
    return pa.ListArray.from_arrays(outer, inner, mask=mask)


def rows_table(rows: Sequence[ExportRow]) -> pa.Table:
    """The export table for rows, in EXPORT_SCHEMA."""
    results = [r.result if r.status == "ok" else None for r in rows]
    columns: list[pa.Array] = [
        pa.array([r.row_index for r in rows], type=pa.int64()),
        pa.array([r.job_id for r in rows], type=pa.string()),
        pa.array([r.status for r in rows], type=pa.string()),
        pa.array([r.error for r in rows], type=pa.string()),
        pa.array([res.model_version if res else None for res in results], type=pa.string()),
    ]
    for name, dims, typ in _ARRAY_COLUMNS:
        columns.append(
            _list_array([getattr(res, name) if res else None for res in results], dims, typ)
        )
    columns.append(
        pa.array([json.dumps(res.metadata) if res else None for res in results], type=pa.string())
    )
    return pa.Table.from_arrays(columns, schema=EXPORT_SCHEMA)


@dataclass
class ExportStats:
    """What the manifest reports, accumulated row by row."""

    counts: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    failures_omitted: int = 0
    model_versions: Counter[str] = field(default_factory=Counter)
    job_timings: dict[str, list[float]] = field(default_factory=dict)

    def add(self, row: ExportRow) -> None:
        """Count one exported row."""
        self.counts[row.status] += 1
        if row.status != "ok":
            if len(self.failures) < MAX_MANIFEST_FAILURES:
                self.failures.append(
                    {
                        "row_index": row.row_index,
                        "job_id": row.job_id,
                        "stage": "ingest" if row.status == "rejected" else "teacher",
                        "reason": row.error,
                    }
                )
            else:
                self.failures_omitted += 1
        if row.result is not None and row.status == "ok":
            self.model_versions[row.result.model_version] += 1
            for k, v in row.result.timings.items():
                self.job_timings.setdefault(k, []).append(float(v))


def _summary(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values)
    return {
        "mean": round(float(arr.mean()), 3),
        "p50": round(float(np.percentile(arr, 50)), 3),
        "p95": round(float(np.percentile(arr, 95)), 3),
        "max": round(float(arr.max()), 3),
    }


def build_manifest(
    rec: DatasetRecord, stats: ExportStats, shards: list[dict[str, Any]], *, exported_at: float
) -> dict[str, Any]:
    """manifest.json: counts, failures with reasons, model versions, shards, timings."""
    spec = rec.spec

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    total = sum(stats.counts.values())
    return {
        "version": 1,
        "dataset_id": spec.dataset_id,
        "queue": spec.queue,
        "input": spec.input,
        "output": spec.output,
        "options": spec.options.model_dump(),
        "rows": {
            "total": total,
            "ok": stats.counts["ok"],
            "failed": stats.counts["failed"],
            "rejected": stats.counts["rejected"],
        },
        "failures": stats.failures,
        "failures_omitted": stats.failures_omitted,
        "ignored_fields": sorted(rec.ignored_fields),
        "model_versions": dict(stats.model_versions),
        "shards": shards,
        "columns": {f.name: str(f.type) for f in EXPORT_SCHEMA},
        "timings": {
            "created_at": rec.created_at,
            "ingest_started_at": rec.ingest_started_at,
            "ingested_at": rec.ingested_at,
            "export_started_at": rec.export_started_at,
            "exported_at": exported_at,
            "ingest_s": span(rec.ingest_started_at, rec.ingested_at),
            "until_all_finished_s": span(rec.ingest_started_at, rec.export_started_at),
            "export_s": span(rec.export_started_at, exported_at),
            "total_s": span(rec.created_at, exported_at),
            "per_job_ms": {k: _summary(v) for k, v in sorted(stats.job_timings.items())},
        },
    }


def _read_results(client: TeacherClient, job_ids: list[str]) -> list[TeacherResult | None | str]:
    """Results by job id; a result whose bulk object cannot be read comes back as the reason,
    so one damaged object fails its row, not the export."""
    try:
        return list(client.results(job_ids))
    except StorageError:
        out: list[TeacherResult | None | str] = []
        for job_id in job_ids:
            try:
                out.append(client.results([job_id])[0])
            except StorageError as exc:
                out.append(f"result unreadable: {exc}")
        return out


def _export_rows(
    client: TeacherClient, rec: DatasetRecord, start: int, stop: int, rejected: Mapping[int, str]
) -> list[ExportRow]:
    ds = rec.dataset_id
    indices = [i for i in range(start, stop) if i not in rejected]
    fetched = dict(
        zip(indices, _read_results(client, [row_job_id(ds, i) for i in indices]), strict=True)
    )
    rows = []
    for i in range(start, stop):
        job_id = row_job_id(ds, i)
        res = fetched.get(i)
        if i in rejected:
            rows.append(ExportRow(i, job_id, "rejected", rejected[i], None))
        elif isinstance(res, str):
            rows.append(ExportRow(i, job_id, "failed", res, None))
        elif res is None:
            rows.append(ExportRow(i, job_id, "failed", "no result record (expired?)", None))
        else:
            rows.append(ExportRow(i, job_id, "ok" if res.ok else "failed", res.error, res))
    return rows


def export_dataset(
    client: TeacherClient, rec: DatasetRecord, *, refresh: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """Write the dataset's Parquet shards (input order, `shard_rows` rows each) and then
    manifest.json to the output; returns the manifest. Rewriting is idempotent."""
    spec = rec.spec
    store = _object_store(spec.output, client.settings.storage)
    total = rec.total_rows if rec.total_rows is not None else rec.next_row
    raw = cast(dict[bytes, bytes], client.r.hgetall(rejected_key(spec.queue, spec.dataset_id)))
    rejected = {int(k): v.decode() for k, v in raw.items()}
    stats, shards = ExportStats(), []
    # No manifest while shards are rewritten (a re-export after a replay): readers wait for it.
    store.delete("manifest.json")
    for shard_no, first in enumerate(range(0, max(total, 1), spec.shard_rows)):
        last = min(first + spec.shard_rows, total)
        buf = pa.BufferOutputStream()
        with pq.ParquetWriter(buf, EXPORT_SCHEMA, compression="zstd") as writer:
            for start in range(first, last, RESULTS_CHUNK):
                refresh()
                rows = _export_rows(client, rec, start, min(start + RESULTS_CHUNK, last), rejected)
                for row in rows:
                    stats.add(row)
                writer.write_table(rows_table(rows))
        data = buf.getvalue().to_pybytes()
        path = f"part-{shard_no:05d}.parquet"
        checksum = store.put(path, data)
        shards.append(
            {
                "path": path,
                "first_row": first,
                "rows": last - first,
                "bytes": len(data),
                "checksum": checksum,
            }
        )
        log.info("dataset.export.shard", dataset=spec.dataset_id, path=store.url_for(path))
    manifest = build_manifest(rec, stats, shards, exported_at=time.time())
    # Written last: a manifest present means every shard it lists is complete.
    store.put("manifest.json", json.dumps(manifest, indent=2).encode())
    return manifest


# ---------------------------------------------------------------------------------------------
# Submitting and listing


# KEYS: record, index. ARGV: dataset id, time, record field/values. Creates it only if absent.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""


@dataclass(frozen=True)
class Submitted:
    """What submit_dataset did: `created`, `resumed`, `exporting`, `running` (its job is
    queued or running already) or `already done`."""

    dataset_id: str
    action: str
    rq_job: str | None
    record: DatasetRecord


def submit_dataset(
    client: TeacherClient,
    *,
    input: str,  # noqa: A002 - the CLI's word for it
    output: str,
    options: RequestOptions | None = None,
    dataset_id: str | None = None,
    **knobs: Any,
) -> Submitted:
    """Create (or resume) a dataset on the client's queue and enqueue its next rq job.

    Idempotent: submitting the same input and options again resumes an unfinished dataset,
    re-exports a finished one whose output changed, and otherwise does nothing. `knobs` are
    DatasetSpec's run settings (batch_rows, max_pending_tokens, shard_rows, slice_s,
    retry_intervals). Raises DatasetError if the input cannot be read or the id is taken by
    another input.
    """
    options = options or RequestOptions()
    location = normalize_location(input)
    info = probe_input(location, client.settings.storage)
    ds = (
        check_dataset_id(dataset_id)
        if dataset_id
        else derive_dataset_id(location, queue=client.queue, options=options)
    )
    out = output if output.startswith("s3://") else normalize_location(output)
    spec = DatasetSpec(
        dataset_id=ds,
        input=location,
        format=info.format,
        queue=client.queue,
        options=options,
        output=out,
        **knobs,
    )
    now = time.time()
    fresh = DatasetRecord(
        spec=spec, state="ingesting", total_rows=info.total_rows, created_at=now, updated_at=now
    )
    # Parquet columns are known up front (JSONL keys are collected while reading).
    fresh.ignored_fields = [c for c in info.columns or [] if c not in ROW_FIELDS]
    # Completions are read from the done stream from this point on (earlier ones by sweeps).
    last = cast(_Entries, client.r.xrevrange(client.streams.done, count=1))
    fresh.done_cursor = last[0][0].decode() if last else "0-0"
    key = dataset_key(client.queue, ds)
    flat = [x for kv in fresh.to_hash().items() for x in kv]
    if client.r.eval(_CREATE, 2, key, datasets_index_key(client.queue), ds, now, *flat):
        job = enqueue_step(client.r, "ingest", spec)
        log.info("dataset.submitted", dataset=ds, input=location, rq_job=job)
        return Submitted(ds, "created", job, fresh)
    rec = load_record(client.r, client.queue, ds)
    assert rec is not None
    return _resubmit(client, rec, spec)


def _resubmit(client: TeacherClient, rec: DatasetRecord, spec: DatasetSpec) -> Submitted:
    """Submitting an existing dataset again: new run settings, and resume if it stopped."""
    ds, key = spec.dataset_id, dataset_key(client.queue, spec.dataset_id)
    if rec.spec.identity() != spec.identity():
        raise DatasetError(
            f"dataset {ds} already exists for {rec.spec.input} with options "
            f"{rec.spec.options.model_dump()}; choose another --dataset-id"
        )
    output_changed = rec.spec.output != spec.output
    client.r.hset(key, mapping={"spec": spec.model_dump_json(), "updated_at": time.time()})
    rec.spec = spec
    if rec.state == "done" and not output_changed:
        return Submitted(ds, "already done", None, rec)
    if rec.state in ("ingesting", "ingested", "exporting") and step_alive(client.r, rec.rq_job):
        return Submitted(ds, "running", rec.rq_job, rec)
    state = "ingesting" if rec.ingested_at is None else "ingested"
    client.r.hset(key, mapping={"state": state, "error": ""})
    job = enqueue_step(client.r, "ingest" if state == "ingesting" else "finalize", spec)
    action = "resumed" if state == "ingesting" else "exporting"
    log.info("dataset.resubmitted", dataset=ds, action=action, rq_job=job)
    return Submitted(ds, action, job, rec)


def dataset_queues(r: redis.Redis) -> list[str]:
    """Queues that have datasets (SCAN for their index keys)."""
    found = set()
    for k in r.scan_iter(match=f"{keys.PREFIX}:{{*}}:datasets", count=1000, _type="zset"):
        text = k.decode()
        found.add(text[text.index("{") + 1 : text.rindex("}")])
    return sorted(found)


def find_dataset(r: redis.Redis, dataset_id: str, queue: str | None = None) -> DatasetRecord:
    """A dataset by id, in `queue` or else in any queue; raises DatasetError if absent."""
    for q in [queue] if queue else dataset_queues(r):
        rec = load_record(r, q, dataset_id)
        if rec is not None:
            return rec
    raise DatasetError(f"no dataset {dataset_id!r}" + (f" in queue {queue!r}" if queue else ""))


def dataset_progress(r: redis.Redis, rec: DatasetRecord) -> dict[str, Any]:
    """A JSON-ready snapshot of one dataset: record, progress counts, rate and ETA."""
    q, ds = rec.spec.queue, rec.dataset_id
    pipe = r.pipeline(transaction=False)
    pipe.bitcount(finished_key(q, ds))
    pipe.bitcount(failed_key(q, ds))
    pipe.lrange(rate_key(q, ds), 0, -1)
    finished, failed, raw_samples = pipe.execute()
    samples = [tuple(json.loads(s)) for s in raw_samples]
    total = rec.total_rows
    # A JSONL file's length is known only once read: until then the ETA covers the rows read
    # so far and is a lower bound.
    known = rec.next_row if total is None else total
    remaining = max(0, known - rec.rows_rejected - finished)
    rate, eta = estimate_eta(samples, remaining=remaining)  # type: ignore[arg-type]
    if rec.state in ("done", "failed"):
        rate, eta = None, None
    return {
        "dataset_id": ds,
        "queue": q,
        "state": rec.state,
        "input": rec.spec.input,
        "output": rec.spec.output,
        "total_rows": total,
        "rows_read": rec.next_row,
        "rows_queued": rec.rows_queued,
        "rows_done": int(finished) - int(failed),
        "rows_failed": int(failed),
        "rows_rejected": rec.rows_rejected,
        "rate_rows_per_s": None if rate is None else round(rate, 3),
        "eta_s": None if eta is None else round(eta, 1),
        "eta_is_lower_bound": total is None,
        "error": rec.error,
        "rq_job": rec.rq_job,
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
    }


def list_datasets(r: redis.Redis, queues: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Progress snapshots of every dataset of `queues` (default: all), oldest first."""
    out = []
    for q in queues if queues is not None else dataset_queues(r):
        for ds in cast(list[bytes], r.zrange(datasets_index_key(q), 0, -1)):
            rec = load_record(r, q, ds.decode())
            if rec is not None:
                out.append(dataset_progress(r, rec))
    return out


# ---------------------------------------------------------------------------------------------
# Replay

# KEYS: result, submitted marker, finished bitmap, failed bitmap. ARGV: row.
# 1: replay it (a failed result, or a previous replay that stopped between this and the
# re-add): record and marker are deleted and the row unmarked, so submit enqueues it again.
# 2: it succeeded since. 0: it is in flight (no record yet, marker present).
_REPLAY_CHECK = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'failed' or (not status and redis.call('EXISTS', KEYS[2]) == 0) then
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('SETBIT', KEYS[3], ARGV[1], 0)
  redis.call('SETBIT', KEYS[4], ARGV[1], 0)
  return 1
end
if status == 'ok' then return 2 end
return 0
"""


def _replay_dead_letters(client: TeacherClient, rec: DatasetRecord) -> dict[str, int]:
    """Re-add the dataset's dead-lettered jobs from the original fields kept in the dead
    letter (`orig:<field>`), newest dead letter per job; dead letters of jobs replayed or
    since succeeded are removed."""
    ds, q, r = rec.dataset_id, client.queue, client.r
    prefix = f"{ds}:".encode()
    entries: dict[bytes, _Entries] = {}
    for entry_id, f in _xrange_all(r, client.streams.dead):
        raw_id = f.get(b"job_id", b"")
        if raw_id.startswith(prefix) and raw_id[len(prefix) :].isdigit():
            entries.setdefault(raw_id, []).append((entry_id, f))
    counts = Counter[str]()
    for job_id_b, dead in entries.items():
        job_id = job_id_b.decode()
        orig = {k[5:].decode(): v for k, v in dead[-1][1].items() if k.startswith(b"orig:")}
        if not {"v", "meta", "input_ids"} <= orig.keys():
            counts["skipped_no_payload"] += 1  # e.g. a batch failure records only the id
            continue
        row = job_id.rsplit(":", 1)[1]
        verdict = r.eval(
            _REPLAY_CHECK,
            4,
            keys.result_key(q, job_id),
            keys.submitted_key(q, job_id),
            finished_key(q, ds),
            failed_key(q, ds),
            row,
        )
        if verdict == 0:
            counts["skipped_in_flight"] += 1
            continue
        if verdict == 1:
            tokens = int(orig.pop("n_tokens", b"0") or 0)
            client.streams.submit(job_id, orig, tokens=tokens)
            counts["replayed"] += 1
        else:
            counts["already_ok"] += 1
        r.xdel(client.streams.dead, *[eid for eid, _ in dead])
    return dict(counts)


def _xrange_all(r: redis.Redis, stream: str) -> Iterator[tuple[bytes, dict[bytes, bytes]]]:
    start = "-"
    while True:
        batch = cast(_Entries, r.xrange(stream, min=start, count=1000))
        if not batch:
            return
        yield from batch
        start = "(" + batch[-1][0].decode()


def replay_dataset(
    client_or_settings: TeacherClient | Settings, dataset_id: str, *, queue: str | None = None
) -> dict[str, Any]:
    """Requeue the dataset's failed rq jobs (FailedJobRegistry of the ingest and export queues)
    and re-submit its dead-lettered jobs; a failed or finished dataset goes back to
    `ingesting` or `ingested`, so it resumes and is exported again. Holds the dataset lease
    meanwhile (waiting for a running step's slice to end). Returns what was done."""
    client = (
        client_or_settings
        if isinstance(client_or_settings, TeacherClient)
        else TeacherClient(client_or_settings)
    )
    rec = find_dataset(client.r, dataset_id, queue)
    if rec.spec.queue != client.queue:
        client = TeacherClient(with_queue(client.settings, rec.spec.queue), client=client.r)
    failed_jobs = []
    for name in (INGEST_QUEUE, EXPORT_QUEUE):
        registry = Queue(name, connection=client.r, serializer=JSONSerializer).failed_job_registry
        for job_id in registry.get_job_ids():
            job = RqJob.fetch(job_id, connection=client.r, serializer=JSONSerializer)
            meta = job.meta or {}
            if meta.get("dataset") == dataset_id and meta.get("queue") == rec.spec.queue:
                failed_jobs.append((registry, job))
    with _leased(client, dataset_id) as (lease, rec):
        dead = _replay_dead_letters(client, rec) if rec.ingest_started_at is not None else {}
        target = "ingesting" if rec.ingested_at is None else "ingested"
        reopen = rec.state == "failed" or (
            dead.get("replayed", 0) > 0 and rec.state in ("done", "exporting")
        )
        if reopen:
            lease.write({"state": target, "error": "", "updated_at": time.time()})
    # Requeued only now: they would wait for the lease anyway.
    for registry, job in failed_jobs:
        registry.requeue(job)
    if reopen and not failed_jobs and not step_alive(client.r, rec.rq_job):
        enqueue_step(client.r, "ingest" if target == "ingesting" else "finalize", rec.spec)
    summary = {
        "dataset_id": dataset_id,
        "queue": rec.spec.queue,
        "rq_jobs_requeued": [job.id for _, job in failed_jobs],
        "dead_letters": dead,
        "state": target if reopen else rec.state,
    }
    log.info("dataset.replayed", **summary)
    return summary


# ---------------------------------------------------------------------------------------------
# The rq worker


class DatasetWorker(Worker):
    """rq's forking Worker that notices a killed worker's job within seconds, not minutes.

    rq keeps a running job alive in its StartedJobRegistry with heartbeats every
    `job_monitoring_interval` and a TTL of that plus 60 s; a worker's maintenance pass then
    retries (or fails) jobs whose TTL ran out. A shorter margin makes a crashed ingest resume
    about 15 s after the crash instead of over a minute; a job wrongly taken for dead is safe,
    because the retry waits for the dataset lease.
    """

    heartbeat_margin_s = 10

    def get_heartbeat_ttl(self, job: RqJob, working_time: float = 0.0) -> int:
        """TTL of the job's next heartbeat."""
        interval = self.job_monitoring_interval
        if job.timeout and job.timeout > 0:
            interval = int(min(job.timeout - working_time, interval))
        return int(interval) + self.heartbeat_margin_s


def run_worker(
    settings: Settings,
    *,
    burst: bool = False,
    name: str | None = None,
    queues: Sequence[str] = (INGEST_QUEUE, EXPORT_QUEUE),
) -> bool:
    """Run an rq worker (with its scheduler, for retry intervals) on the dataset queues, on the
    same Redis as TeacherClient; returns whether it ran any job."""
    conn = connect(settings.redis)
    rq_queues = [Queue(n, connection=conn, serializer=JSONSerializer) for n in queues]
    worker = DatasetWorker(
        rq_queues,
        connection=conn,
        serializer=JSONSerializer,
        name=name,
        # The dequeue blocks worker_ttl - 15 s; maintenance (which finds dead workers' jobs)
        # only runs between dequeues, so keep both short.
        worker_ttl=20,
        job_monitoring_interval=5,
        maintenance_interval=5,
    )
    return bool(worker.work(burst=burst, with_scheduler=True, logging_level="INFO"))
