"""Store results and acknowledge entries on background threads.

The device moves on to the next batch while results of the previous one are uploaded to
object storage and written to Redis. Each job's write is one unit: upload the bulk arrays (if
any), then one atomic script writes the record, announces it and XACKs. A failure retries with
backoff until it succeeds or the process dies — in which case the entry, never acknowledged,
is redelivered: nothing acknowledged is ever lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import redis
import structlog

from consumer.faults import FaultInjector
from shared.deadletter import DeadLetter
from shared.messages import TeacherResult
from shared.results import encode_record
from shared.storage import ObjectStore, TransientStorageError
from shared.streams import Streams
from shared.tracing import span

log = structlog.get_logger("teacherq.writer")


@dataclass(frozen=True)
class WriteTask:
    """One job's result (or failure) to persist, with its stream entry."""

    result: TeacherResult
    entry_id: str
    tokens: int
    status: str = "ok"
    dead_letter: DeadLetter | None = None
    trace: dict | None = None
    batch_id: str = ""


class ResultWriter:
    """A small thread pool that persists results; `flush()` waits for all submitted writes."""

    def __init__(
        self,
        *,
        streams: Streams,
        store: ObjectStore | None,
        queue: str,
        inline_max_bytes: int,
        ttl_s: int,
        threads: int,
        faults: FaultInjector,
        on_done: Callable[[WriteTask, bool], None] | None = None,
    ) -> None:
        self.streams = streams
        self.store = store
        self.queue = queue
        self.inline_max_bytes = inline_max_bytes
        self.ttl_s = ttl_s
        self.faults = faults
        self.on_done = on_done
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tq-writer")
        self._futures: list[Future] = []

    def submit(self, task: WriteTask) -> None:
        """Persist in the background."""
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(self._pool.submit(self._write_with_retry, task))

    def write_now(self, task: WriteTask) -> bool:
        """Persist in this thread (dead letters, duplicates); True if this call wrote."""
        return self._write_with_retry(task)

    def flush(self) -> None:
        """Block until every submitted write has finished."""
        for f in self._futures:
            f.result()
        self._futures.clear()

    def in_flight(self) -> int:
        """Writes not finished yet."""
        return sum(not f.done() for f in self._futures)

    def close(self) -> None:
        """Finish pending writes and stop the threads."""
        self.flush()
        self._pool.shutdown(wait=True)

    def _write_with_retry(self, task: WriteTask) -> bool:
        delay = 0.05
        while True:
            try:
                wrote = self._write(task)
                if self.on_done:
                    self.on_done(task, wrote)
                return wrote
            except (
                redis.ConnectionError,
                redis.TimeoutError,
                redis.exceptions.OutOfMemoryError,
                TransientStorageError,
            ) as exc:
                # Transient by policy: Redis restarting or full (noeviction: it refuses writes
                # until consumers drain it), a storage hiccup. The entry stays pending until
                # this succeeds. Any other storage error (a missing bucket, bad credentials) is
                # a configuration error and is raised: the consumer stops loudly.
                log.warning("store.retry", job_id=task.result.job_id, error=str(exc), delay_s=delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _write(self, task: WriteTask) -> bool:
        job_id = task.result.job_id
        with span("store", carrier=task.trace, job_id=job_id, batch_id=task.batch_id):
            record = encode_record(
                task.result,
                queue=self.queue,
                store=self.store if task.status == "ok" else None,
                inline_max_bytes=self.inline_max_bytes,
            )
        self.faults.reached("stored")
        with span("ack", carrier=task.trace, job_id=job_id, batch_id=task.batch_id) as s:
            wrote = self.streams.complete(
                job_id=job_id,
                entry_id=task.entry_id,
                status=task.status,
                record=record,
                ttl_s=self.ttl_s,
                tokens=task.tokens,
                dead_letter=task.dead_letter,
            )
            s.set(wrote=wrote)
        self.faults.reached("acked")
        return wrote
