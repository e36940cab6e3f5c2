"""Dataset progress: which rows have finished (and failed), kept in per-row bitmaps from the done
stream and from sweeps of the result records; the rate and ETA; listing snapshots."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import redis

from producer.client import TeacherClient
from producer.datasets.records import (
    DatasetRecord,
    XRead,
    dataset_queues,
    load_record,
    row_job_id,
)
from shared import keys

SWEEP_INTERVAL_S = 30.0
RESULTS_CHUNK = 1000
RATE_SAMPLES = 60


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
        self.finished = keys.dataset_finished_key(q, ds)
        self.failed = keys.dataset_failed_key(q, ds)
        self.record = keys.dataset_key(q, ds)
        self.rate = keys.dataset_rate_key(q, ds)
        self._last_sample = 0.0

    def poll(self, *, block_ms: int | None) -> None:
        """Read new completion notices (blocking up to block_ms) and mark this dataset's rows."""
        reply = cast(
            XRead,
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
        rejected_key = keys.dataset_rejected_key(self.queue, self.dataset_id)
        rejected = {int(i) for i in self.r.hkeys(rejected_key)}
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


def dataset_progress(r: redis.Redis, rec: DatasetRecord) -> dict[str, Any]:
    """A JSON-ready snapshot of one dataset: record, progress counts, rate and ETA."""
    q, ds = rec.spec.queue, rec.dataset_id
    pipe = r.pipeline(transaction=False)
    pipe.bitcount(keys.dataset_finished_key(q, ds))
    pipe.bitcount(keys.dataset_failed_key(q, ds))
    pipe.lrange(keys.dataset_rate_key(q, ds), 0, -1)
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
        for ds in cast(list[bytes], r.zrange(keys.datasets_index_key(q), 0, -1)):
            rec = load_record(r, q, ds.decode())
            if rec is not None:
                out.append(dataset_progress(r, rec))
    return out
