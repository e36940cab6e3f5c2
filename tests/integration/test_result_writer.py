"""The consumer's background result writer against a real Redis: a write whose script the
server lost is retried until stored; a write that fails for good is raised, never dropped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import redis

from consumer.group.faults import FaultInjector
from consumer.serve.writer import ResultWriter, WriteTask
from producer import TeacherClient
from shared import keys
from shared.errors import ResultNotStored
from shared.messages import TeacherResult
from shared.redis_client import _SCRIPT_ATTEMPTS
from shared.storage import ObjectStore
from shared.streams import Streams
from tests.helpers import ForgetsScripts, job_set
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.integration


def _writer(client: redis.Redis, settings) -> ResultWriter:  # type: ignore[no-untyped-def]
    streams = Streams(client, settings.queue.name)
    streams.ensure_group()
    return ResultWriter(
        streams=streams,
        store=ObjectStore.from_settings(settings.storage),
        queue=settings.queue.name,
        inline_max_bytes=1 << 20,
        ttl_s=600,
        threads=2,
        faults=FaultInjector(None),
    )


def _claimed_task(writer: ResultWriter, job_id: str) -> WriteTask:
    """A job submitted and read by consumer `c`, with a result to store for it."""
    streams = writer.streams
    streams.submit(job_id, {"job_id": job_id}, tokens=4)
    reply = streams.r.xreadgroup(streams.group, "c", {streams.jobs: ">"}, count=1)
    entry_id = reply[0][1][0][0].decode()
    result = TeacherResult(job_id=job_id, logprobs=np.array([-1.0, -2.5], dtype=np.float32))
    return WriteTask(result=result, entry_id=entry_id, tokens=4)


def _pending(writer: ResultWriter) -> int:
    return int(writer.streams.r.xpending(writer.streams.jobs, writer.streams.group)["pending"])


def test_a_write_whose_script_the_server_lost_is_retried_until_stored(redis_url, settings):
    """The server forgets the completion script between redis-py's load and its call more
    often than `run_script` calls again (a failover that lasts): the writer retries the write
    with its backoff, the record is stored and the entry acknowledged."""
    client = ForgetsScripts.from_url(redis_url)
    writer = _writer(client, settings)
    task = _claimed_task(writer, "j-noscript")
    # Two EVALSHA per call (redis-py reloads once): one more call than run_script makes.
    client.forget = 2 * _SCRIPT_ATTEMPTS + 2
    writer.submit(task)
    writer.flush()
    writer.close()
    assert client.forget == 0, "every script loss was met"
    record = client.hgetall(keys.result_key(settings.queue.name, "j-noscript"))
    assert record[b"status"] == b"ok"
    assert _pending(writer) == 0, "the entry is acknowledged"


def test_a_write_that_fails_for_good_is_raised_and_leaves_its_entry_pending(r, settings):
    """A Redis error that is no outage (the result key holds a string: WRONGTYPE) fails the
    write; the error is raised to the loop by `check` and by the next `submit`, never dropped
    with its future, and the entry stays pending for redelivery."""
    writer = _writer(r, settings)
    task = _claimed_task(writer, "j-wrongtype")
    r.set(keys.result_key(settings.queue.name, "j-wrongtype"), "not a hash")
    writer.submit(task)
    wait_until(lambda: writer.in_flight() == 0, "the write to finish")
    with pytest.raises(ResultNotStored, match="job j-wrongtype could not be stored.*WRONGTYPE"):
        writer.check()
    with pytest.raises(ResultNotStored, match="job j-wrongtype"):
        writer.submit(_claimed_task(writer, "j-next"))
    writer.close()
    assert _pending(writer) == 2, "neither entry is acknowledged"


def test_a_consumer_whose_result_store_breaks_stops_loudly_and_keeps_the_entry(
    settings, start_consumer, r
):
    """The object store breaks under a running consumer (its root directory replaced by a
    file: every upload fails, and retrying cannot help): the consumer logs `store.failed` for
    the job, ends with one line that names the job and the error (no traceback) and status 1,
    and the job's entry stays pending, unacknowledged, for a consumer that can store it."""
    s = settings.model_copy(
        update={"queue": settings.queue.model_copy(update={"inline_max_bytes": 0})}
    )
    proc = start_consumer(s)
    root = Path(s.storage.url.removeprefix("file://"))
    shutil.rmtree(root, ignore_errors=True)
    root.write_text("not a directory")
    client = TeacherClient(s)
    (job_id,) = client.submit(job_set(1, seed=7))
    assert proc.wait(timeout=scaled(120)) == 1, proc.log_path.read_text()[-2000:]
    failed = [
        json.loads(line)
        for line in proc.log_path.read_text().splitlines()
        if '"store.failed"' in line
    ]
    assert [f["job_id"] for f in failed] == [job_id]
    output = proc.log_path.read_text()
    assert "Traceback" not in output, output[-2000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"teacherq consumer: stopping: the result of job {job_id} could not")
    assert "Not a directory" in last
    streams = Streams(r, s.queue.name)
    assert r.xpending(streams.jobs, streams.group)["pending"] == 1
    assert not r.exists(keys.result_key(s.queue.name, job_id))
