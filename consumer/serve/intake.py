"""Intake: turn claimed stream entries into the jobs this replica should compute.

Invalid entries and entries delivered more than `max_deliveries` times are dead-lettered at
once; a job that wants a newer model generation goes back on the stream; a job that already
has a result record (or appears twice in one read) is acknowledged without computing.
"""

from __future__ import annotations

import time

import redis
import structlog

from consumer.serve.failures import DeadLetters
from consumer.serve.heartbeat import Heartbeat
from consumer.serve.metrics import ConsumerMetrics
from consumer.serve.replica import Counters, LoadedModel
from consumer.serve.writer import ResultWriter
from shared import keys
from shared.errors import InvalidJob
from shared.messages import Job, Limits, decode_job
from shared.streams import Entry, Streams
from shared.tracing import record

log = structlog.get_logger("teacherq.consumer")

# A read that held nothing to compute but jobs left for a newer model generation pauses this
# long before the next: the requeued entries come straight back in the next read, and until
# the update lands this replica would otherwise spin on them.
NEWER_PAUSE_S = 0.1


class Intake:
    """Decides, entry by entry, what happens to claimed work before it reaches the device."""

    def __init__(
        self,
        *,
        client: redis.Redis,
        streams: Streams,
        heartbeat: Heartbeat,
        metrics: ConsumerMetrics,
        counters: Counters,
        dead_letters: DeadLetters,
        loaded: LoadedModel,
        limits: Limits,
        max_deliveries: int,
        consumer: str,
        writer: ResultWriter,
    ) -> None:
        self.r = client
        self.streams = streams
        self.queue = streams.queue
        self.heartbeat = heartbeat
        self.metrics = metrics
        self.counters = counters
        self.dead_letters = dead_letters
        self.loaded = loaded
        self.limits = limits
        self.max_deliveries = max_deliveries
        self.consumer = consumer
        self.writer = writer
        # When each claimed entry was read (span clock): set on the prefetch thread, popped
        # by the loop.
        self._read_times: dict[bytes, tuple[float, float]] = {}

    def read(self, entries: list[Entry], *, read0: float, read1: float) -> None:
        """Note when entries were read (the read began at `read0`, returned at `read1`)."""
        for eid, _ in entries:
            self._read_times[eid] = (read0, read1)

    def admit(
        self, entries: list[Entry], *, deliveries: dict[bytes, int], claimed_at: float
    ) -> list[Job]:
        """The jobs to compute among `entries`; every other entry is settled here. Safe to call
        again with the same entries (after a Redis outage)."""
        jobs: list[Job] = []
        left_for_newer = 0
        for eid, fields in entries:
            entry_id = eid.decode()
            count = deliveries.get(eid, 1)
            # get, not pop: the caller may run the same entries again.
            read0, read1 = self._read_times.get(eid, (claimed_at, claimed_at))
            try:
                job = decode_job(entry_id, fields, limits=self.limits)
            except InvalidJob as exc:
                self.dead_letters.send(
                    entry_id, fields, reason=str(exc), exc_type="InvalidJob", deliveries=count
                )
                continue
            if count > self.max_deliveries and not self._finished_or_storing(job):
                reason = (
                    f"delivered {count} times, more than consumer.max_deliveries="
                    f"{self.max_deliveries} (the job crashed, hung or timed out each time)"
                )
                self.dead_letters.send(
                    entry_id,
                    fields,
                    reason=reason,
                    exc_type="TooManyDeliveries",
                    deliveries=count,
                    attempts=count - 1,
                )
                continue
            if (job.request.min_model_generation or 0) > self.loaded.generation:
                self._leave_for_newer(job)
                left_for_newer += 1
                continue
            self._claimed(job, read0=read0, read1=read1, deliveries=count)
            jobs.append(job)
        for eid, _ in entries:
            self._read_times.pop(eid, None)
        todo = self.skip_finished(jobs)
        if left_for_newer and not todo:
            self._pause()  # once a read, not once a job
        return todo

    def _pause(self) -> None:
        """Wait before the next read: this one held only jobs for a newer generation."""
        time.sleep(NEWER_PAUSE_S)

    def _finished_or_storing(self, job: Job) -> bool:
        """A job with a result record, or whose result this consumer is storing, is never
        dead-lettered, whatever its delivery count: `skip_finished` settles it."""
        return self.writer.storing(job.job_id) or bool(
            self.r.exists(keys.result_key(self.queue, job.job_id))
        )

    def skip_finished(self, jobs: list[Job]) -> list[Job]:
        """Acknowledge, without computing, jobs that already have a result record (done,
        failed or cancelled) or that appear twice in this read (a retried XADD); leave to the
        writer the jobs whose result it is storing (waiting for room in a full Redis)."""
        if not jobs:
            return jobs
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.exists(keys.result_key(self.queue, job.job_id))
        todo, seen = [], set()
        for job, exists in zip(jobs, pipe.execute(), strict=True):
            if self.writer.storing(job.job_id):
                # Our own write of this job acknowledges its entry; another entry of the same
                # job is a duplicate.
                seen.add(job.job_id)
                if not self.writer.storing_entry(job.entry_id):
                    self.streams.ack(job.entry_id, tokens=job.counted_tokens)
                    self.heartbeat.release(job.entry_id)
                log.info("job.being_stored", job_id=job.job_id, entry_id=job.entry_id)
                continue
            if exists or job.job_id in seen:
                self.streams.ack(job.entry_id, tokens=job.counted_tokens)
                self.heartbeat.release(job.entry_id)
                self.counters.duplicates_skipped += 1
                self.metrics.duplicate_skipped()
                log.info("job.duplicate_skipped", job_id=job.job_id, entry_id=job.entry_id)
            else:
                seen.add(job.job_id)
                todo.append(job)
        return todo

    def _claimed(self, job: Job, *, read0: float, read1: float, deliveries: int) -> None:
        """The job's queue_wait and claim spans (in its own trace), and the wait metric."""
        trace = job.request.trace
        # A blocking read waited for the job to arrive: its claim starts no earlier than that.
        claim0 = min(max(read0, job.submitted_at), read1)
        if job.submitted_at > 0:
            record(
                "queue_wait",
                start_time=job.submitted_at,
                end_time=claim0,
                carrier=trace,
                job_id=job.job_id,
                entry_id=job.entry_id,
                deliveries=deliveries,
            )
            self.metrics.job_claimed(queue_wait_s=claim0 - job.submitted_at, deliveries=deliveries)
        record(
            "claim",
            start_time=claim0,
            end_time=read1,
            carrier=trace,
            job_id=job.job_id,
            consumer=self.consumer,
        )

    def _leave_for_newer(self, job: Job) -> None:
        """A job wants a newer model generation than ours: put it back on the stream (a fresh
        entry, then XACK this one) for a newer replica — or for us after our next update."""
        self.streams.requeue(job.entry_id, job.fields)
        self.heartbeat.release(job.entry_id)
        log.info(
            "job.left_for_newer",
            job_id=job.job_id,
            wants=job.request.min_model_generation,
            serving=self.loaded.generation,
        )
