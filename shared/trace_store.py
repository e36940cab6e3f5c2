"""Finished spans in Redis: a sink that records them, and a reader that rebuilds traces.

Every process a job crosses (producer, consumer leader) configures the sink once in main()::

    tracing.configure_sink(RedisSpanSink(client, queue), process="consumer gpu3-dp0")

and `teacherq trace` reads them back with `TraceStore`. Layout (all keys of the queue's hash
slot, all expiring after `queue.trace_ttl_s`, TRACE_TTL_S by default):

- `teacherq:{q}:trace:<trace_id>`  list of compact JSON span records, capped at
  TRACE_MAX_SPANS (a trainer that wraps all its submits in one span makes one huge trace);
- `teacherq:{q}:trace_job:<job_id>` the trace id of a job (from any span with a `job_id`
  attr, except a resubmission's `submit` that enqueued nothing);
- `teacherq:{q}:trace_batch:<batch_id>` the trace id of a batch (spans with a `batch_id`
  and no `job_id`: a batch's own trace, which its jobs' traces link to);
- `teacherq:{q}:trace_jobs` sorted set job_id -> first span start, for time windows.

Writes go through a background thread that pipelines whatever accumulated, so a batch of 64
jobs costs a round trip or two, not hundreds; tracing is best-effort and never blocks or
breaks the traced code (a full buffer or a Redis error drops records and counts them).

Retention you can budget: traces are most of a small job's Redis memory (docs/deploy.md), so
they have their own TTL (`queue.trace_ttl_s`) and a sampling rate (`queue.trace_sample_rate`):
a trace is kept or dropped as a whole, decided from its trace id alone, so every process a
job crosses makes the same choice without talking to the others.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import cast

import redis

from shared.keys import (
    TRACE_MAX_SPANS,
    TRACE_TTL_S,
    batch_trace_key,
    job_trace_key,
    trace_jobs_key,
    trace_key,
)
from shared.log import get_logger
from shared.otlp import sink_from_environment
from shared.settings import QueueSettings
from shared.tracing import SpanRecord, SpanSink, configure_sink, current_sink

log = get_logger("teacherq.spans")

# -- the sink ------------------------------------------------------------------------------


def encode_span(record: SpanRecord) -> str:
    """A record as compact JSON (None fields left out; values JSON cannot hold as text)."""
    compact = {k: v for k, v in record.items() if v is not None}
    return json.dumps(compact, separators=(",", ":"), default=str)


class RedisSpanSink:
    """A span sink (`tracing.configure_sink`) that stores records in Redis in the background.

    `__call__` only appends to a bounded buffer; a daemon thread flushes it every
    `flush_interval_s` (or sooner when `flush_at` records wait) in one pipeline. `flush()`
    writes what is buffered now; `close()` flushes and stops the thread (also run at exit).
    """

    def __init__(
        self,
        client: redis.Redis,
        queue: str,
        *,
        ttl_s: int = TRACE_TTL_S,
        max_spans_per_trace: int = TRACE_MAX_SPANS,
        flush_interval_s: float = 0.2,
        flush_at: int = 500,
        max_buffer: int = 100_000,
        sample_rate: float = 1.0,
    ) -> None:
        self.r = client
        self.sample_rate = sample_rate
        self.queue = queue
        self.ttl_s = ttl_s
        self.max_spans = max_spans_per_trace
        self.flush_interval_s = flush_interval_s
        self.flush_at = flush_at
        self.dropped = 0
        self._buf: deque[SpanRecord] = deque(maxlen=max_buffer)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # flush() from a caller vs the thread
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="span-sink", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def __call__(self, record: SpanRecord) -> None:
        """Buffer one record (never blocks on Redis); records of unsampled traces are
        dropped here."""
        if self.sample_rate < 1.0 and not sampled(str(record["trace_id"]), self.sample_rate):
            return
        with self._lock:
            if len(self._buf) == self._buf.maxlen:
                self.dropped += 1  # the deque drops the oldest: keep the newest spans
            self._buf.append(record)
            n = len(self._buf)
        if n >= self.flush_at:
            self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> int:
        """Write every buffered record now; returns how many were written."""
        with self._write_lock:
            with self._lock:
                records = list(self._buf)
                self._buf.clear()
            if not records:
                return 0
            try:
                self._write(records)
            except redis.RedisError as exc:
                self.dropped += len(records)
                # One line; the traceback only at debug level (a library stays quiet).
                log.warning("trace.flush_failed", records=len(records), error=str(exc))
                log.debug("trace.flush_failed", exc_info=True)
                return 0
            return len(records)

    def _write(self, records: list[SpanRecord]) -> None:
        pipe = self.r.pipeline(transaction=False)
        traces: set[str] = set()
        jobs: dict[str, tuple[str, float]] = {}
        batches: dict[str, str] = {}
        for rec in records:
            tid = rec["trace_id"]
            pipe.rpush(trace_key(self.queue, tid), encode_span(rec))
            traces.add(tid)
            attrs = rec.get("attrs") or {}
            job_id, batch_id = attrs.get("job_id"), attrs.get("batch_id")
            if isinstance(job_id, str) and attrs.get("enqueued") is not False:
                start = float(rec["start_time"])
                first = jobs.get(job_id)
                jobs[job_id] = (tid, min(start, first[1]) if first else start)
            elif isinstance(batch_id, str):
                batches[batch_id] = tid
        for tid in traces:
            key = trace_key(self.queue, tid)
            pipe.ltrim(key, -self.max_spans, -1)
            pipe.expire(key, self.ttl_s)
        for job_id, (tid, start) in jobs.items():
            pipe.set(job_trace_key(self.queue, job_id), tid, ex=self.ttl_s)
            # LT: the earliest span seen decides when a job happened, whichever process wrote
            # first.
            pipe.zadd(trace_jobs_key(self.queue), {job_id: start}, lt=True)
        for batch_id, tid in batches.items():
            pipe.set(batch_trace_key(self.queue, batch_id), tid, ex=self.ttl_s)
        if jobs:
            pipe.zremrangebyscore(trace_jobs_key(self.queue), "-inf", time.time() - self.ttl_s)
            pipe.expire(trace_jobs_key(self.queue), self.ttl_s)
        pipe.execute()

    def close(self) -> None:
        """Flush and stop the background thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5)
        self.flush()
        atexit.unregister(self.close)


def sampled(trace_id: str, rate: float) -> bool:
    """Whether a trace is kept at sampling `rate`: the same answer in every process."""
    if rate >= 1.0:
        return True
    digest = hashlib.blake2b(trace_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < rate * 2**64


def install_sink(
    client: redis.Redis,
    queue: str,
    *,
    process: str | None = None,
    ttl_s: int = TRACE_TTL_S,
    sample_rate: float = 1.0,
) -> RedisSpanSink:
    """Record this process's finished spans to Redis (call once in main(); a trainer calls it
    to have its `submit` spans in `teacherq trace`). Returns the sink; `close()` it on exit
    (also done at interpreter exit). Pass the queue's `trace_ttl_s` and `trace_sample_rate`
    settings so every process keeps the same traces for the same time."""
    sink = RedisSpanSink(client, queue, ttl_s=ttl_s, sample_rate=sample_rate)
    otlp = sink_from_environment()
    configure_sink(sink if otlp is None else _Tee(sink, otlp), process=process)
    return sink


class _Default:
    """The sink clients install when the process chose none (`ensure_sink`), and how many
    open clients hold it."""

    lock = threading.Lock()
    sink: SpanSink | None = None
    holders = 0


def ensure_sink(
    client: redis.Redis | Callable[[], redis.Redis], queue: QueueSettings, *, process: str
) -> bool:
    """`install_sink` with the queue's trace settings, unless this process already records
    its spans. What every client does when it is built, so a job submitted from the Python
    API has its `submit` span in `teacherq trace` as from the CLI.

    Clients open at once share the first one's sink. Returns whether this client holds it:
    then it calls `release_sink()` when it closes, and the last holder to do so flushes and
    closes the sink, so a client built afterwards records to its own Redis and queue. False
    when main() chose the sink (`install_sink`, `tracing.configure_sink`): that one stays.
    `client` may be a function making one, called only if a sink is installed."""
    with _Default.lock:
        current = current_sink()
        if current is not None and current is not _Default.sink:
            return False
        if current is None:  # none yet, or ours was replaced behind our back
            # A client (redis.Redis, or a cluster client typed as one), or a function making it.
            if hasattr(client, "execute_command"):
                made = cast(redis.Redis, client)
            else:
                made = cast(Callable[[], redis.Redis], client)()
            install_sink(
                made,
                queue.name,
                process=process,
                ttl_s=queue.trace_ttl_s,
                sample_rate=queue.trace_sample_rate,
            )
            _Default.sink, _Default.holders = current_sink(), 0
        _Default.holders += 1
        return True


def release_sink() -> None:
    """A client that `ensure_sink` returned True to is closing: the last one stops recording
    to the shared sink, flushes it and closes it."""
    with _Default.lock:
        _Default.holders -= 1
        if _Default.holders > 0 or _Default.sink is None:
            return
        sink, _Default.sink, _Default.holders = _Default.sink, None, 0
        if current_sink() is sink:
            configure_sink(None)
    close = getattr(sink, "close", None)
    if close is not None:
        close()


class _Tee:
    """Hands each record to the Redis sink, then to the OTLP exporter (`shared.otlp`)."""

    def __init__(self, first: SpanSink, second: SpanSink) -> None:
        self.sinks = (first, second)

    def __call__(self, record: SpanRecord) -> None:
        for sink in self.sinks:
            sink(record)

    def flush(self) -> None:
        """Write or export what each sink holds now."""
        for sink in self.sinks:
            flush = getattr(sink, "flush", None)
            if flush is not None:
                flush()

    def close(self) -> None:
        """Close both sinks (each also closes at exit)."""
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()


# -- the reader ----------------------------------------------------------------------------


def decode_spans(raw: Iterable[bytes | str]) -> list[SpanRecord]:
    """Records from their JSON, in start order; unreadable entries are skipped (logged)."""
    out: list[SpanRecord] = []
    for item in raw:
        try:
            rec = json.loads(item)
        except (json.JSONDecodeError, UnicodeDecodeError):
            log.warning("trace.bad_record", record=str(item)[:200])
            continue
        rec.setdefault("attrs", {})
        rec.setdefault("parent_span_id", None)
        out.append(rec)
    # Dedupe: a flush retried after a timeout may have written a record twice.
    unique = {rec["span_id"]: rec for rec in out}
    return sorted(unique.values(), key=lambda r: (r["start_time"], -r["duration_ms"]))


def job_subset(spans: list[SpanRecord], job_id: str) -> list[SpanRecord]:
    """The spans of one job in a trace other jobs may share (a trainer that submits inside
    its own span): spans naming the job, their ancestors and their descendants."""
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str, list[str]] = {}
    for s in spans:
        if s["parent_span_id"]:
            children.setdefault(s["parent_span_id"], []).append(s["span_id"])
    keep: set[str] = set()
    for s in spans:
        if s["attrs"].get("job_id") != job_id:
            continue
        keep.add(s["span_id"])
        parent = s["parent_span_id"]
        while parent in by_id and parent not in keep:
            keep.add(parent)
            parent = by_id[parent]["parent_span_id"]
        todo = list(children.get(s["span_id"], []))
        while todo:
            sid = todo.pop()
            if sid not in keep:
                keep.add(sid)
                todo.extend(children.get(sid, []))
    return [s for s in spans if s["span_id"] in keep]


class TraceStore:
    """Read recorded spans of one queue."""

    def __init__(self, client: redis.Redis, queue: str) -> None:
        self.r = client
        self.queue = queue

    def spans(self, trace_id: str) -> list[SpanRecord]:
        """Every recorded span of a trace, in start order."""
        return decode_spans(self.r.lrange(trace_key(self.queue, trace_id), 0, -1))

    def trace_of_job(self, job_id: str) -> str | None:
        """The trace id of a job, if any of its spans was recorded."""
        raw = self.r.get(job_trace_key(self.queue, job_id))
        return raw.decode() if isinstance(raw, bytes) else raw

    def trace_of_batch(self, batch_id: str) -> str | None:
        """The trace id of a batch, if its spans were recorded."""
        raw = self.r.get(batch_trace_key(self.queue, batch_id))
        return raw.decode() if isinstance(raw, bytes) else raw

    def job_spans(self, job_id: str) -> list[SpanRecord]:
        """The spans of one job (empty if none were recorded)."""
        trace_id = self.trace_of_job(job_id)
        return job_subset(self.spans(trace_id), job_id) if trace_id else []

    def batch_spans(self, batch_id: str) -> list[SpanRecord]:
        """The spans of a batch's own trace (empty if none were recorded)."""
        trace_id = self.trace_of_batch(batch_id)
        return self.spans(trace_id) if trace_id else []

    def jobs_between(self, since: float, until: float, *, limit: int = 1000) -> list[str]:
        """Job ids whose first recorded span started in [since, until], oldest first."""
        raw = self.r.zrangebyscore(trace_jobs_key(self.queue), since, until, start=0, num=limit)
        return [j.decode() if isinstance(j, bytes) else str(j) for j in raw]
