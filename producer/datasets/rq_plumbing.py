"""rq plumbing for dataset jobs: the ingest and export queues, enqueueing a dataset's next step,
the failure callback, and the worker that runs them."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal, cast

import redis
from rq import Callback, Queue, Retry, Worker
from rq.exceptions import NoSuchJobError
from rq.job import Job as RqJob
from rq.serializers import JSONSerializer

from producer.client import TeacherClient
from producer.datasets.records import DatasetRecord, DatasetSpec
from shared import keys
from shared.log import get_logger
from shared.redis_client import connect
from shared.settings import Settings, SettingsError

log = get_logger("teacherq.datasets")

INGEST_QUEUE = "teacherq-ingest"
EXPORT_QUEUE = "teacherq-export"
# The functions rq imports to run a job, by the dotted paths stored in the job. They are the
# package's names (re-exported from their modules), so jobs already in Redis keep resolving
# whichever module of the package holds the function.
INGEST_JOB = "producer.datasets.ingest_job"
FINALIZE_JOB = "producer.datasets.finalize_job"
ON_JOB_FAILURE = "producer.datasets.on_job_failure"


def _retry(spec: DatasetSpec) -> Retry:
    return Retry(max=len(spec.retry_intervals), interval=list(spec.retry_intervals))


def enqueue_step(r: redis.Redis, kind: Literal["ingest", "finalize"], spec: DatasetSpec) -> str:
    """Enqueue the dataset's next rq job and record its id; returns the rq job id."""
    ingest = kind == "ingest"
    q = Queue(INGEST_QUEUE if ingest else EXPORT_QUEUE, connection=r, serializer=JSONSerializer)
    job_id = uuid.uuid4().hex
    # One MULTI: the job and the record naming it as the dataset's current job exist together
    # (the failure callback ignores jobs that are not current: stale duplicates).
    with r.pipeline() as pipe:
        q.enqueue(
            INGEST_JOB if ingest else FINALIZE_JOB,
            spec.queue,
            spec.dataset_id,
            retry=_retry(spec),
            on_failure=Callback(ON_JOB_FAILURE),
            # A slice plus room for a slow read or, for finalize, the export itself.
            job_timeout=int(spec.slice_s + (600 if ingest else 4 * 3600)),
            result_ttl=24 * 3600,
            failure_ttl=30 * 24 * 3600,
            meta={"dataset": spec.dataset_id, "queue": spec.queue, "kind": kind},
            description=f"{kind} {spec.queue}/{spec.dataset_id}",
            job_id=job_id,
            pipeline=pipe,
        )
        pipe.hset(keys.dataset_key(spec.queue, spec.dataset_id), "rq_job", job_id)
        pipe.execute()
    return job_id


def continue_step(
    client: TeacherClient, kind: Literal["ingest", "finalize"], rec: DatasetRecord, **info: Any
) -> dict[str, Any]:
    """Enqueue the continuation of a step whose slice ended; returns the job's result."""
    job_id = enqueue_step(client.r, kind, rec.spec)
    log.info(f"dataset.{kind}.continued", dataset=rec.dataset_id, next_job=job_id, **info)
    return {"status": "continued", "next_job": job_id, **info}


_ALIVE = ("queued", "started", "scheduled", "deferred")


def step_alive(r: redis.Redis, rq_job: str | None) -> bool:
    """Whether the dataset's recorded rq job will still run (a started job whose worker died
    counts: rq retries it)."""
    if not rq_job:
        return False
    try:
        job = RqJob.fetch(rq_job, connection=r, serializer=JSONSerializer)
    except NoSuchJobError:
        return False
    return str(job.get_status(refresh=False).value) in _ALIVE


def on_job_failure(
    job: RqJob, connection: redis.Redis, exc_type: type, exc: BaseException, _tb: Any
) -> None:
    """rq failure callback (also for abandoned jobs): mark the dataset failed once the job has
    no retries left, so `teacherq datasets` shows it and replay can pick it up."""
    meta = job.meta or {}
    queue, ds = meta.get("queue"), meta.get("dataset")
    if not queue or not ds:
        return
    if job.retries_left:
        log.warning("dataset.job_retry", dataset=ds, kind=meta.get("kind"), error=repr(exc))
        return
    current = cast(bytes | None, connection.hget(keys.dataset_key(queue, ds), "rq_job"))
    if current is None or current.decode() != job.id:
        return  # a stale duplicate: the dataset has moved on to another job
    connection.hset(
        keys.dataset_key(queue, ds),
        mapping={
            "state": "failed",
            "error": f"{exc_type.__name__}: {exc}"[:2000],
            "updated_at": time.time(),
        },
    )
    log.error("dataset.failed", dataset=ds, kind=meta.get("kind"), error=repr(exc))


class DatasetWorker(Worker):
    """rq's forking Worker that notices a killed worker's job within seconds, not minutes.

    rq keeps a running job alive in its StartedJobRegistry with heartbeats every
    `job_monitoring_interval` and a TTL of that plus 60 s; a worker's maintenance pass then
    retries (or fails) jobs whose TTL ran out. A shorter margin makes a crashed ingest resume
    about 15 s after the crash instead of over a minute; a job wrongly taken for dead is safe,
    because the retry waits for the dataset lease.
    """

    heartbeat_margin_s = 10

    def bootstrap(self, *args: Any, **kwargs: Any) -> None:
        """rq registers the worker before it installs its SIGTERM/SIGINT handlers (after
        starting its scheduler): a stop in between killed the worker still registered. Until
        rq's handlers take over, a stop is recorded and the loop leaves at its first check,
        deregistering as a warm shutdown does.

        The scheduler process is forked in that window and inherits this handler until it
        installs its own. A stop it receives there (the worker stopping it on the way out) is
        the scheduler's: recorded on the worker's copy, it was lost, the scheduler ran on and
        the worker waited for it forever."""
        worker_pid = os.getpid()

        def stop_early(signum: int, frame: object) -> None:
            if os.getpid() != worker_pid and self.scheduler is not None:
                self.scheduler.request_stop()  # we are the forked scheduler
                return
            self._stop_requested = True

        signal.signal(signal.SIGTERM, stop_early)
        signal.signal(signal.SIGINT, stop_early)
        super().bootstrap(*args, **kwargs)

    def unsubscribe(self) -> None:
        """Leave the worker's command channel and end its pubsub thread without waiting on it.

        rq sends UNSUBSCRIBE, then stops the thread, and redis-py's `stop()` waits for it with
        no limit. A thread that read the UNSUBSCRIBE reply before it was told to stop goes back
        to waiting for a subscription, up to rq's 60 s: the worker took a minute to exit after
        SIGTERM. Told to stop first, the thread ends on that reply; a thread that does not
        (Redis gone) is a daemon, ended with the process."""
        thread = self.pubsub_thread
        if not thread:
            return
        thread.stop(timeout=0)  # clears its run flag, returns at once
        with contextlib.suppress(redis.RedisError):
            self.pubsub.unsubscribe()
        thread.join(timeout=1)
        self.pubsub.close()

    def get_heartbeat_ttl(self, job: RqJob, working_time: float = 0.0) -> int:
        """TTL of the job's next heartbeat."""
        interval = self.job_monitoring_interval
        if job.timeout and job.timeout > 0:
            interval = int(min(job.timeout - working_time, interval))
        return int(interval) + self.heartbeat_margin_s


def run_worker(
    settings: Settings,
    *,
    burst: bool = False,
    name: str | None = None,
    queues: Sequence[str] = (INGEST_QUEUE, EXPORT_QUEUE),
) -> bool:
    """Run an rq worker (with its scheduler, for retry intervals) on the dataset queues, on the
    same Redis as TeacherClient; returns whether it ran any job."""
    if settings.redis.mode == "cluster":
        raise SettingsError(
            "TEACHERQ_REDIS__MODE=cluster: the rq worker (dataset ingest and export) needs one "
            "Redis (rq's keys carry no hash tag); run datasets on a standalone or sentinel Redis"
        )
    conn = connect(settings.redis)
    rq_queues = [Queue(n, connection=conn, serializer=JSONSerializer) for n in queues]
    worker = DatasetWorker(
        rq_queues,
        connection=conn,
        serializer=JSONSerializer,
        name=name,
        # The dequeue blocks worker_ttl - 15 s; maintenance (which finds dead workers' jobs)
        # only runs between dequeues, so keep both short.
        worker_ttl=20,
        job_monitoring_interval=5,
        maintenance_interval=5,
    )
    return bool(worker.work(burst=burst, with_scheduler=True, logging_level="INFO"))
