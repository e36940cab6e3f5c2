"""teacherq's exception hierarchy; each class encodes a handling policy."""

from __future__ import annotations


class TeacherqError(Exception):
    """Base of every teacherq error."""


class InvalidJob(TeacherqError, ValueError):  # noqa: N818 - the policy name reads better
    """The job itself is wrong: dead-letter at once, never retry. The message says what was
    wrong and what was expected."""


class TransientError(TeacherqError):
    """A Redis or object-store hiccup: retry with backoff."""


class QueueFull(TeacherqError):
    """Submit refused by backpressure: the queue holds too many pending tokens."""


class JobFailed(TeacherqError):
    """Raised to a waiting client for a job that ended in the dead-letter stream."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"job {job_id} failed: {reason}")
        self.job_id = job_id
        self.reason = reason
