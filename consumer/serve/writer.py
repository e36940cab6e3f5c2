"""Store results and acknowledge entries on background threads.

The device moves on to the next batch while results of the previous one are uploaded to
object storage and written to Redis. Each job's write is one unit: upload the bulk arrays (if
any), then one atomic script writes the record, announces it and XACKs. A transient failure (an
outage, a failover, Redis full) retries with backoff until it succeeds or the process dies — in
which case the entry, never acknowledged, is redelivered: nothing acknowledged is ever lost. Any
other failure is kept and raised on the loop's thread (`check`, `submit`, `flush`): the
consumer stops loudly and the entry, still pending, is redelivered.

Memory pressure: while Redis is full (maxmemory, noeviction) writes are refused and retried;
`under_pressure` tells the loop to stop taking new work meanwhile, and `submit` blocks while
`max_queued` writes are unfinished, so results waiting for room never pile up in the process.
After a stop request (`abandon_after`) a write still refused past the grace deadline is given
up: its entry stays pending, unacknowledged, and is redelivered once Redis has room — a
consumer told to stop exits within its grace period whatever Redis's state.

Replicas (`redis.min_replicas_acked`): after each write, `ReplicaAcks` waits for the queue's
shard's replicas, and when they cannot answer either holds the write (retried) or lets it stand
marked, as `redis.replica_ack_policy` says (consumer/serve/replica_ack.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import redis
import structlog

from consumer.group.faults import FaultInjector
from consumer.serve.replica_ack import UNREPLICATED_FIELD, ReplicaAcks
from shared.deadletter import DeadLetter
from shared.errors import NotReplicated, ResultNotStored
from shared.messages import TeacherResult
from shared.results import encode_record
from shared.settings import RedisSettings
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
        max_queued: int = 64,
        redis_cfg: RedisSettings | None = None,
    ) -> None:
        self.streams = streams
        self.store = store
        self.queue = queue
        self.inline_max_bytes = inline_max_bytes
        self.ttl_s = ttl_s
        self.faults = faults
        self.on_done = on_done
        self.max_queued = max_queued
        # With redis.min_replicas_acked: WAIT after each write, and the replica-ack policy.
        self.acks = (
            ReplicaAcks(streams.r, queue, redis_cfg)
            if redis_cfg is not None and redis_cfg.min_replicas_acked > 0
            else None
        )
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tq-writer")
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._storing: dict[str, int] = {}  # job id -> unfinished writes of it
        self._entries: set[str] = set()  # entry ids of unfinished writes
        self._refused_since: float | None = None  # first OOM refusal since the last success
        self._deadline: float | None = None  # give up retrying after this (monotonic)
        self.abandoned = 0
        self._failure: ResultNotStored | None = None  # the first write that failed for good

    @property
    def under_pressure(self) -> bool:
        """True while writes are being refused because Redis is full."""
        return self._refused_since is not None

    def storing(self, job_id: str) -> bool:
        """Whether a write of this job's result is queued or under way here."""
        with self._lock:
            return job_id in self._storing

    def storing_entry(self, entry_id: str) -> bool:
        """Whether a write that acknowledges this entry is queued or under way here."""
        with self._lock:
            return entry_id in self._entries

    @property
    def abandoning(self) -> bool:
        """Whether a stop's grace deadline is set."""
        return self._deadline is not None

    def abandon_after(self, grace_s: float) -> None:
        """Stop requested: writes still failing `grace_s` from now are given up (their
        entries stay pending and are redelivered)."""
        self._deadline = time.monotonic() + grace_s

    def submit(self, task: WriteTask) -> None:
        """Persist in the background; blocks while `max_queued` writes are unfinished. Raises
        the error of an earlier write that failed for good (see `check`)."""
        self.wait_for_room()
        self._mark(task, +1)
        self._futures.append(self._pool.submit(self._write_with_retry, task))

    def _mark(self, task: WriteTask, delta: int) -> None:
        job_id = task.result.job_id
        with self._lock:
            n = self._storing.get(job_id, 0) + delta
            if n > 0:
                self._storing[job_id] = n
            else:
                self._storing.pop(job_id, None)
            if delta > 0:
                self._entries.add(task.entry_id)
            else:
                self._entries.discard(task.entry_id)

    def write_now(self, task: WriteTask) -> bool:
        """Persist in this thread (dead letters, duplicates); True if this call wrote."""
        self._mark(task, +1)
        return self._write_with_retry(task)

    def check(self) -> None:
        """Raise the error of a background write that failed for good (not a transient error:
        a missing bucket, bad credentials, a Redis reply we do not expect), so the consumer
        stops loudly. Its entry stays pending, unacknowledged, and is redelivered (to another
        consumer, or to this one restarted under its name)."""
        if self._failure is not None:
            raise self._failure

    def flush(self) -> None:
        """Block until every submitted write has finished; raises as `check` does."""
        wait(self._futures)
        self._futures.clear()
        self.check()

    def in_flight(self) -> int:
        """Writes not finished yet."""
        return sum(not f.done() for f in self._futures)

    def close(self) -> None:
        """Finish pending writes and stop the threads (no raise: `flush` or `check` before)."""
        wait(self._futures)
        self._futures.clear()
        self._pool.shutdown(wait=True)

    def full(self) -> bool:
        """Whether `submit` would block now (`max_queued` writes unfinished)."""
        return sum(not f.done() for f in self._futures) >= self.max_queued

    def wait_for_room(self) -> None:
        """Block until fewer than `max_queued` writes are unfinished; raises as `check` does."""
        self._futures = [f for f in self._futures if not f.done()]
        while len(self._futures) >= self.max_queued:
            wait(self._futures, return_when=FIRST_COMPLETED)
            self._futures = [f for f in self._futures if not f.done()]
        self.check()

    def _write_with_retry(self, task: WriteTask) -> bool:
        try:
            return self._retry(task)
        except Exception as exc:
            # Kept for the loop (`check`): a future's error that nobody reads would leave the
            # entry pending under a live consumer, refreshed by its heartbeat, never redone.
            error = f"{type(exc).__name__}: {exc}"
            log.error("store.failed", job_id=task.result.job_id, error=error)
            failure = ResultNotStored(
                f"the result of job {task.result.job_id} could not be stored ({error}); "
                "its entry stays pending and is redelivered"
            )
            if self._failure is None:
                self._failure = failure
            raise failure from exc
        finally:
            self._mark(task, -1)
            if self.acks is not None:  # done or given up: no longer held for replicas
                self.acks.release(task.result.job_id, acknowledged=False)

    def _retry(self, task: WriteTask) -> bool:
        delay = 0.05
        while True:
            try:
                wrote = self._write(task)
                self._refused_since = None
                if self.on_done:
                    self.on_done(task, wrote)
                return wrote
            except (
                redis.ConnectionError,
                redis.TimeoutError,
                redis.exceptions.OutOfMemoryError,
                TransientStorageError,
                NotReplicated,
                # NOSCRIPT after `run_script`'s own quick retries: a failover still under way
                # (sentinel clients may reach old and new primary for a moment). The script
                # did not run and the write is idempotent: again, with this loop's backoff.
                redis.exceptions.NoScriptError,
            ) as exc:
                # Transient by policy: Redis restarting or full (noeviction: it refuses writes
                # until consumers drain it), a storage hiccup. The entry stays pending until
                # this succeeds. Any other storage error (a missing bucket, bad credentials) is
                # a configuration error and is raised: the consumer stops loudly.
                if isinstance(exc, redis.exceptions.OutOfMemoryError):
                    self._refused_since = self._refused_since or time.monotonic()
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self.abandoned += 1
                    log.warning(
                        "store.abandoned",
                        job_id=task.result.job_id,
                        entry_id=task.entry_id,
                        error=str(exc),
                    )
                    return False
                if not isinstance(exc, NotReplicated):  # ReplicaAcks logs the wait once
                    log.warning(
                        "store.retry", job_id=task.result.job_id, error=str(exc), delay_s=delay
                    )
                time.sleep(delay)
                # A refusal for memory costs Redis one rejected call: retry at least every
                # second, so the write (and the consumer's pause) ends soon after room appears.
                oom = isinstance(exc, redis.exceptions.OutOfMemoryError)
                delay = min(delay * 2, 1.0 if oom else 5.0)

    def _write(self, task: WriteTask) -> bool:
        job_id = task.result.job_id
        # Degraded (redis.replica_ack_policy=degrade, the shard short of replicas): written
        # without WAIT, the record marked.
        unacknowledged = self.acks is not None and self.acks.unacknowledged()
        with span("store", carrier=task.trace, job_id=job_id, batch_id=task.batch_id):
            record = encode_record(
                task.result,
                queue=self.queue,
                store=self.store if task.status == "ok" else None,
                inline_max_bytes=self.inline_max_bytes,
            )
            if unacknowledged:
                record[UNREPLICATED_FIELD] = "0"
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
            if unacknowledged:
                if wrote:  # a record already there (a duplicate) was counted by its writer
                    self.acks.unreplicated(job_id)  # type: ignore[union-attr]
            elif self.acks is not None:  # under `wait`, retried (idempotently) until replicated
                s.set(replicated=self.acks.confirm(job_id))
            s.set(wrote=wrote)
        self.faults.reached("acked")
        return wrote
