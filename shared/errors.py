"""teacherq's exception hierarchy; each class encodes a handling policy."""

from __future__ import annotations


class TeacherqError(Exception):
    """Base of every teacherq error."""


class InvalidJob(TeacherqError, ValueError):
    """The job itself is wrong: dead-letter at once, never retry. The message says what was
    wrong and what was expected."""


class InvalidCheckpoint(TeacherqError, ValueError):
    """A checkpoint cannot be served as it is; the message names the file and the problem."""


class TransientError(TeacherqError):
    """A Redis or object-store hiccup: retry with backoff."""


class ResultNotStored(TeacherqError):
    """A consumer could not store a job's result for a reason that retrying cannot fix (a
    broken object store, a Redis reply teacherq does not expect): the consumer stops, and the
    job's entry, never acknowledged, is redelivered."""


class QueueFull(TeacherqError):
    """Submit refused by backpressure: the queue holds too many pending tokens."""


class UnknownJob(TeacherqError, KeyError):
    """A job id this queue has never seen (a typo, or another queue): nothing was changed."""

    def __init__(self, job_ids: list[str], queue: str) -> None:
        more = f" and {len(job_ids) - 5} more" if len(job_ids) > 5 else ""
        shown = ", ".join(job_ids[:5]) + more
        super().__init__(f"unknown job id(s) on queue {queue}: {shown}")
        self.job_ids = job_ids
        self.queue = queue

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class JobFailed(TeacherqError):
    """Raised to a waiting client for a job that ended in the dead-letter stream."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"job {job_id} failed: {reason}")
        self.job_id = job_id
        self.reason = reason


class WeightUpdateFailed(TeacherqError):
    """A consumer could not load the weights of an update: the update is recorded as failed
    and every consumer keeps (or returns to) the weights it served before."""

    def __init__(
        self, *, generation: int, path: str | None, reason: str, consumer: str | None
    ) -> None:
        where = f" on consumer {consumer}" if consumer else ""
        target = repr(path) if path else "the configured model"
        super().__init__(
            f"weight update {generation} to {target} failed{where}: {reason}; "
            "consumers keep their previous weights"
        )
        self.generation = generation
        self.path = path
        self.reason = reason
        self.consumer = consumer


class NotReplicated(TransientError):
    """A write did not reach `redis.min_replicas_acked` replicas in time; it may still be
    there, and resending it is safe (every teacherq write is idempotent)."""
