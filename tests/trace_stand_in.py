"""A consumer stand-in that records the spans the real one does (without a model), for the
tests of tracing and `teacherq trace`: `fake_consume` in this process or a child
(`run_fake_consumer`), and `traced_jobs`, which submits jobs and has them scored so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import redis

from producer import TeacherClient, TeacherRequest
from shared import tracing
from shared.keys import throughput_stream
from shared.messages import Limits, TeacherResult, decode_job
from shared.results import encode_record
from shared.settings import Settings
from shared.streams import Streams
from shared.trace_store import RedisSpanSink
from shared.tracing import new_id, record, span
from tests.helpers import REPO
from tests.timing import scaled

JOB_PHASES = ["submit", "queue_wait", "claim", "pack", "forward", "head", "store", "ack"]


def fake_consume(
    redis_url: str, queue: str, *, count: int, name: str = "fake", trace: bool = True
) -> list[str]:
    """Score `count` jobs like the worker does (log-probs of zeros), recording its spans when
    `trace`. Returns the batch ids. Runs until `count` jobs were completed."""
    r = redis.Redis.from_url(redis_url)
    streams = Streams(r, queue)
    streams.ensure_group()
    sink = None
    if trace:
        sink = RedisSpanSink(r, queue)
        tracing.configure_sink(sink, process=f"consumer {name}")
    batches: list[str] = []
    done = 0
    while done < count:
        t_read0 = tracing.now()
        reply = r.xreadgroup(streams.group, name, {streams.jobs: ">"}, count=count, block=5000)
        t_read1 = tracing.now()
        if not reply:
            continue
        entries = reply[0][1]
        jobs = [decode_job(eid.decode(), f, limits=Limits()) for eid, f in entries]
        batch_id = new_id()
        batches.append(batch_id)
        tokens = sum(j.request.num_tokens for j in jobs)
        with span(
            "batch",
            root=True,
            batch_id=batch_id,
            job_ids=[j.job_id for j in jobs],
            jobs=len(jobs),
            tokens=tokens,
            consumer=name,
        ) as b:
            p0 = b.elapsed()
            outputs = [np.zeros(j.request.num_tokens - 1, np.float32) for j in jobs]
            time.sleep(0.002)
            p1 = b.elapsed()
            b.child("pack", start_s=p0, end_s=p1, jobs=len(jobs))
            time.sleep(0.01)  # "forward"
            f1 = b.elapsed()
            time.sleep(0.004)  # "head"
            h1 = b.elapsed()
            for rank in (0, 1):
                rs = b.child(f"rank{rank}", start_s=p1, end_s=h1, rank=rank)
                rs.child("forward", start_s=0, end_s=f1 - p1)
                rs.child("head", start_s=f1 - p1, end_s=h1 - p1)
        for job, logprobs in zip(jobs, outputs, strict=True):
            carrier = job.request.trace
            if trace:
                claim0 = max(t_read0, job.submitted_at)
                ids = {"job_id": job.job_id}
                record(
                    "queue_wait",
                    start_time=job.submitted_at,
                    end_time=claim0,
                    carrier=carrier,
                    **ids,
                )
                record(
                    "claim",
                    start_time=claim0,
                    end_time=t_read1,
                    carrier=carrier,
                    consumer=name,
                    **ids,
                )
                link = {**ids, "batch_id": batch_id}
                for phase, lo, hi in (("pack", p0, p1), ("forward", p1, f1), ("head", f1, h1)):
                    record(
                        phase,
                        start_time=b.start_wall + lo,
                        end_time=b.start_wall + hi,
                        carrier=carrier,
                        **link,
                    )
            result = TeacherResult(job_id=job.job_id, model_version="fake", logprobs=logprobs)
            with span("store", carrier=carrier, job_id=job.job_id, batch_id=batch_id):
                rec = encode_record(result, queue=queue, store=None, inline_max_bytes=1 << 20)
            with span("ack", carrier=carrier, job_id=job.job_id, batch_id=batch_id):
                streams.complete(
                    job_id=job.job_id,
                    entry_id=job.entry_id,
                    status="ok",
                    record=rec,
                    ttl_s=3600,
                    tokens=job.counted_tokens,
                )
            done += 1
        r.xadd(throughput_stream(queue), {"jobs": len(jobs), "tokens": tokens, "consumer": name})
    if sink is not None:
        sink.close()
        tracing.configure_sink(None)
    return batches


def run_fake_consumer(settings: Settings, count: int) -> subprocess.Popen:
    """`fake_consume` in a child process (started now; it blocks until jobs arrive)."""
    code = (
        "import json; from shared.log import configure_logging; "
        "configure_logging(fmt='json', level='warning', rank=0); "  # logs to stderr, binds rank
        "from tests.trace_stand_in import fake_consume; "
        f"print(json.dumps(fake_consume({settings.redis.url!r}, {settings.queue.name!r}, "
        f"count={count})))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True
    )


def traced_jobs(settings: Settings, producer_sink: RedisSpanSink, n: int) -> tuple[list, list]:
    """Submit n jobs from this process and let a fake consumer process score them in one
    batch; returns (job ids, batch ids) once every span is in Redis."""
    client = TeacherClient(settings)
    ids = client.submit([TeacherRequest(input_ids=list(range(3 + i))) for i in range(n)])
    producer_sink.flush()
    proc = run_fake_consumer(settings, n)
    out, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 0, out
    client.wait(ids, timeout=scaled(30), progress=False)
    return ids, json.loads(out)
