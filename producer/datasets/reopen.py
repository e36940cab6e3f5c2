"""Reopening a dataset: requeue its failed rq jobs and replay its dead-lettered jobs, and
reopen a failed or finished dataset so it resumes and is exported again.

Dead letters go through the queue's one replay path (shared/deadletter.py): per job one
atomic script re-adds the job, drops its failed record, removes its dead letters, counts the
replay against `queue.max_replays` and, here, clears the row's finished and failed bits.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import structlog
from rq import Queue
from rq.job import Job as RqJob
from rq.serializers import JSONSerializer

from producer.client import TeacherClient
from producer.datasets.jobs import with_queue
from producer.datasets.lease import leased
from producer.datasets.records import DatasetRecord, find_dataset
from producer.datasets.rq_plumbing import EXPORT_QUEUE, INGEST_QUEUE, enqueue_step, step_alive
from shared import keys
from shared.deadletter import (
    IN_FLIGHT,
    REPLAYED,
    SUCCEEDED,
    TOO_OFTEN,
    by_job,
    read_dead_letters,
    replay_job,
)
from shared.settings import Settings

log = structlog.get_logger("teacherq.datasets")

_COUNTS = {
    REPLAYED: "replayed",
    SUCCEEDED: "already_ok",
    IN_FLIGHT: "skipped_in_flight",
    TOO_OFTEN: "skipped_max_replays",
}


def _replay_dead_letters(client: TeacherClient, rec: DatasetRecord) -> dict[str, int]:
    """Replay the dataset's dead-lettered jobs (the newest dead letter of each, from the
    original fields it keeps), one atomic step per job; dead letters of jobs that succeeded
    since are removed. Returns counts: replayed, already_ok, skipped_in_flight,
    skipped_max_replays (replayed `queue.max_replays` times already), skipped_no_payload."""
    ds, q, r = rec.dataset_id, client.queue, client.r
    prefix = f"{ds}:"
    letters = [
        letter
        for letter in read_dead_letters(r, q)
        if letter.job_id.startswith(prefix) and letter.job_id[len(prefix) :].isdigit()
    ]
    bitmaps = (keys.dataset_finished_key(q, ds), keys.dataset_failed_key(q, ds))
    counts = Counter[str]()
    pipe = r.pipeline(transaction=False)  # each replay is one script: atomic on its own
    for job_id, dead in by_job(letters).items():
        if not dead[-1].has_payload:
            counts["skipped_no_payload"] += 1  # its entry's fields were not kept
            continue
        row = int(job_id.rsplit(":", 1)[1])
        replay_job(
            r,
            q,
            dead,
            max_replays=client.settings.queue.max_replays,
            drop_if_succeeded=True,
            clear_bits=(bitmaps, row),
            pipeline=pipe,
        )
    for verdict, _replays in pipe.execute():
        counts[_COUNTS[int(verdict)]] += 1
    return dict(counts)


def replay_dataset(
    client_or_settings: TeacherClient | Settings, dataset_id: str, *, queue: str | None = None
) -> dict[str, Any]:
    """Requeue the dataset's failed rq jobs (FailedJobRegistry of the ingest and export queues)
    and replays its dead-lettered jobs; a failed or finished dataset goes back to
    `ingesting` or `ingested`, so it resumes and is exported again. Holds the dataset lease
    meanwhile (waiting for a running step's slice to end). Returns what was done."""
    client = (
        client_or_settings
        if isinstance(client_or_settings, TeacherClient)
        else TeacherClient(client_or_settings)
    )
    rec = find_dataset(client.r, dataset_id, queue)
    if rec.spec.queue != client.queue:
        client = TeacherClient(with_queue(client.settings, rec.spec.queue), client=client.r)
    failed_jobs = []
    for name in (INGEST_QUEUE, EXPORT_QUEUE):
        registry = Queue(name, connection=client.r, serializer=JSONSerializer).failed_job_registry
        for job_id in registry.get_job_ids():
            job = RqJob.fetch(job_id, connection=client.r, serializer=JSONSerializer)
            meta = job.meta or {}
            if meta.get("dataset") == dataset_id and meta.get("queue") == rec.spec.queue:
                failed_jobs.append((registry, job))
    with leased(client, dataset_id) as (lease, rec):
        dead = _replay_dead_letters(client, rec) if rec.ingest_started_at is not None else {}
        target = "ingesting" if rec.ingested_at is None else "ingested"
        reopen = rec.state == "failed" or (
            dead.get("replayed", 0) > 0 and rec.state in ("done", "exporting")
        )
        if reopen:
            lease.write({"state": target, "error": "", "updated_at": time.time()})
    # Requeued only now: they would wait for the lease anyway.
    for registry, job in failed_jobs:
        registry.requeue(job)
    if reopen and not failed_jobs and not step_alive(client.r, rec.rq_job):
        enqueue_step(client.r, "ingest" if target == "ingesting" else "finalize", rec.spec)
    summary = {
        "dataset_id": dataset_id,
        "queue": rec.spec.queue,
        "rq_jobs_requeued": [job.id for _, job in failed_jobs],
        "dead_letters": dead,
        "state": target if reopen else rec.state,
    }
    log.info("dataset.replayed", **summary)
    return summary
