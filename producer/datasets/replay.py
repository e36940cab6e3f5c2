"""Replaying a dataset: requeue its failed rq jobs and re-submit its dead-lettered jobs, and
reopen a failed or finished dataset so it resumes and is exported again."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any, cast

import redis
from rq import Queue
from rq.job import Job as RqJob
from rq.serializers import JSONSerializer

from producer.client import TeacherClient
from producer.datasets.jobs import with_queue
from producer.datasets.lease import leased
from producer.datasets.records import DatasetRecord, Entries, find_dataset
from producer.datasets.worker import EXPORT_QUEUE, INGEST_QUEUE, enqueue_step, step_alive
from shared import keys
from shared.log import get_logger
from shared.settings import Settings

log = get_logger("teacherq.datasets")

# KEYS: result, submitted marker, finished bitmap, failed bitmap. ARGV: row.
# 1: replay it (a failed result, or a previous replay that stopped between this and the
# re-add): record and marker are deleted and the row unmarked, so submit enqueues it again.
# 2: it succeeded since. 0: it is in flight (no record yet, marker present).
_REPLAY_CHECK = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'failed' or (not status and redis.call('EXISTS', KEYS[2]) == 0) then
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('SETBIT', KEYS[3], ARGV[1], 0)
  redis.call('SETBIT', KEYS[4], ARGV[1], 0)
  return 1
end
if status == 'ok' then return 2 end
return 0
"""


def _replay_dead_letters(client: TeacherClient, rec: DatasetRecord) -> dict[str, int]:
    """Re-add the dataset's dead-lettered jobs from the original fields kept in the dead
    letter (`orig:<field>`), newest dead letter per job; dead letters of jobs replayed or
    since succeeded are removed."""
    ds, q, r = rec.dataset_id, client.queue, client.r
    prefix = f"{ds}:".encode()
    entries: dict[bytes, Entries] = {}
    for entry_id, f in _xrange_all(r, client.streams.dead):
        raw_id = f.get(b"job_id", b"")
        if raw_id.startswith(prefix) and raw_id[len(prefix) :].isdigit():
            entries.setdefault(raw_id, []).append((entry_id, f))
    counts = Counter[str]()
    for job_id_b, dead in entries.items():
        job_id = job_id_b.decode()
        orig = {k[5:].decode(): v for k, v in dead[-1][1].items() if k.startswith(b"orig:")}
        if not {"v", "meta", "input_ids"} <= orig.keys():
            counts["skipped_no_payload"] += 1  # e.g. a batch failure records only the id
            continue
        row = job_id.rsplit(":", 1)[1]
        verdict = r.eval(
            _REPLAY_CHECK,
            4,
            keys.result_key(q, job_id),
            keys.submitted_key(q, job_id),
            keys.dataset_finished_key(q, ds),
            keys.dataset_failed_key(q, ds),
            row,
        )
        if verdict == 0:
            counts["skipped_in_flight"] += 1
            continue
        if verdict == 1:
            tokens = int(orig.pop("n_tokens", b"0") or 0)
            client.streams.submit(job_id, orig, tokens=tokens)
            counts["replayed"] += 1
        else:
            counts["already_ok"] += 1
        r.xdel(client.streams.dead, *[eid for eid, _ in dead])
    return dict(counts)


def _xrange_all(r: redis.Redis, stream: str) -> Iterator[tuple[bytes, dict[bytes, bytes]]]:
    start = "-"
    while True:
        batch = cast(Entries, r.xrange(stream, min=start, count=1000))
        if not batch:
            return
        yield from batch
        start = "(" + batch[-1][0].decode()


def replay_dataset(
    client_or_settings: TeacherClient | Settings, dataset_id: str, *, queue: str | None = None
) -> dict[str, Any]:
    """Requeue the dataset's failed rq jobs (FailedJobRegistry of the ingest and export queues)
    and re-submit its dead-lettered jobs; a failed or finished dataset goes back to
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
