"""Trainer-facing side of teacherq: submit jobs, wait for teacher outputs.

    from producer import TeacherClient, TeacherRequest

This package never imports torch or megatron (except `producer.optim`, imported explicitly).
"""

from producer.client import TeacherClient
from shared.errors import InvalidJob, JobFailed, QueueFull
from shared.messages import TeacherRequest, TeacherResult

__all__ = [
    "InvalidJob",
    "JobFailed",
    "QueueFull",
    "TeacherClient",
    "TeacherRequest",
    "TeacherResult",
]
