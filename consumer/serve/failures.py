"""Failing for good, on the consumer side: a job that must not, or can no longer, be computed.

The record itself (`DeadLetter`) and its replay live in shared/deadletter.py; here the
consumer writes it together with the job's failed result, so that waiters get the error.
"""

from __future__ import annotations

import structlog

from consumer.serve.heartbeat import Heartbeat
from consumer.serve.metrics import ConsumerMetrics
from consumer.serve.replica import LoadedModel
from consumer.serve.writer import ResultWriter, WriteTask
from shared.deadletter import DeadLetter
from shared.messages import TeacherResult, entry_tokens

log = structlog.get_logger("teacherq.consumer")


class DeadLetters:
    """Moves entries to the dead-letter stream and gives their waiters the error."""

    def __init__(
        self,
        *,
        writer: ResultWriter,
        metrics: ConsumerMetrics,
        loaded: LoadedModel,
        consumer: str,
        heartbeat: Heartbeat,
    ) -> None:
        self.writer = writer
        self.heartbeat = heartbeat
        self.metrics = metrics
        self.loaded = loaded
        self.consumer = consumer

    def send(
        self,
        entry_id: str,
        fields: dict[bytes, bytes],
        *,
        reason: str,
        exc_type: str,
        deliveries: int,
        attempts: int = 0,
    ) -> None:
        """Move an entry to the dead-letter stream with why, and give waiters the error —
        unless the job already has a result record (then nothing is written or counted).

        `deliveries` is how often the entry was delivered; `attempts` how often it was
        actually computed (0 for invalid input)."""
        letter = DeadLetter.for_entry(
            entry_id,
            fields,
            reason=reason,
            exception=exc_type,
            deliveries=deliveries,
            attempts=attempts,
            consumer=self.consumer,
        )
        job_id = letter.job_id
        result = TeacherResult(job_id=job_id, model_version=self.loaded.version, error=reason)
        task = WriteTask(
            result=result,
            entry_id=entry_id,
            tokens=entry_tokens(fields),
            status="failed",
            dead_letter=letter,
        )
        # Written on the loop's thread: while Redis holds it (full, replicas missing) a batch
        # in hand is not hanging.
        with self.heartbeat.clock_stopped():
            wrote = self.writer.write_now(task)
        if not wrote:
            # A dead letter never wins over a real result: the job has a record (the script
            # writes the dead letter only with the first record), or our stop's grace ran out.
            log.info("job.dead_letter_skipped", job_id=job_id, entry_id=entry_id)
            return
        self.metrics.dead_lettered(reason=exc_type)
        self.metrics.job_failed(reason=exc_type)
        log.warning("job.dead_lettered", job_id=job_id, entry_id=entry_id, reason=reason)
