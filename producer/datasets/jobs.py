"""The rq entry points of dataset jobs. rq runs them in a forked work-horse and finds them by
the dotted paths in `producer.datasets.rq_plumbing` (the package's names, re-exported from here)."""

from __future__ import annotations

from typing import Any

from producer.client import TeacherClient
from producer.datasets.export import finalize_slice
from producer.datasets.ingest import ingest_slice
from producer.datasets.lease import leased
from shared.settings import Settings, load_settings


def with_queue(settings: Settings, queue: str) -> Settings:
    """The settings with another queue name (`Settings.with_queue`)."""
    return settings.with_queue(queue)


def _job_client(queue: str) -> TeacherClient:
    # rq job entry points run in a forked work-horse: settings come from the worker's
    # environment like any teacherq process; the queue comes from the job.
    settings = load_settings()
    return TeacherClient(with_queue(settings, queue))


def ingest_job(queue: str, dataset_id: str) -> dict[str, Any]:
    """rq entry point: ingest the next slice of the dataset's rows."""
    with _job_client(queue) as client, leased(client, dataset_id) as (lease, rec):
        if rec.state != "ingesting":
            return {"status": "skipped", "state": rec.state}
        return ingest_slice(client, lease, rec)


def finalize_job(queue: str, dataset_id: str) -> dict[str, Any]:
    """rq entry point: wait (one slice) for the dataset's rows to finish, then export."""
    with _job_client(queue) as client, leased(client, dataset_id) as (lease, rec):
        if rec.state not in ("ingested", "exporting"):
            return {"status": "skipped", "state": rec.state}
        return finalize_slice(client, lease, rec)
