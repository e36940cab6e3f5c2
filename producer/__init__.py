"""Trainer-facing side of teacherq: submit jobs, wait for teacher outputs.

    from producer import TeacherClient, TeacherRequest
    from producer import AsyncTeacherClient  # asyncio trainers

This package never imports torch or megatron (except `producer.optim`, imported explicitly).
"""

from producer.aio import AsyncTeacherClient
from producer.client import TeacherClient
from shared.errors import (
    InvalidCheckpoint,
    InvalidJob,
    JobFailed,
    QueueFull,
    TeacherqError,
    UnknownJob,
    WeightUpdateFailed,
)
from shared.messages import TeacherRequest, TeacherResult

__all__ = [
    "AsyncTeacherClient",
    "InvalidCheckpoint",
    "InvalidJob",
    "JobFailed",
    "QueueFull",
    "TeacherClient",
    "TeacherRequest",
    "TeacherResult",
    "TeacherqError",
    "UnknownJob",
    "WeightUpdateFailed",
]
