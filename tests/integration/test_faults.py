"""Fault tolerance with real processes: consumers killed at every point of a job's life, Redis
killed and restarted, poison jobs, replay, bad stream entries, retention.

The invariants checked after every fault: each job has exactly one result, identical to a
fault-free run; nothing is left pending; the dead-letter stream holds exactly the poison jobs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis

from producer import QueueFull, TeacherClient, TeacherRequest
from shared import keys
from shared.settings import Settings, to_env
from tests.helpers import (
    REPO,
    ForgetsScripts,
    assert_exactly_once,
    fast,
    job_set,
    wait_for_consumers,
)
from tests.processes import Valkey, launch_consumer, terminate
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.integration

POISON = 777  # a token id that fault injection turns into a poison job


def assert_same_results(got, want) -> None:
    """Same outputs as the fault-free run. Ids are compared exactly; floats to 1e-6, since a
    redelivered job may ride in a batch of another size, and CPU GEMM kernels round the last
    bit differently for different row counts (the first stored result is never replaced)."""
    for a, b in zip(got, want, strict=True):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.arrays().keys() == b.arrays().keys()
        for name, arr in a.arrays().items():
            if arr.dtype.kind in "iu":
                np.testing.assert_array_equal(arr, b.arrays()[name], err_msg=f"{a.job_id} {name}")
            else:
                np.testing.assert_allclose(
                    arr, b.arrays()[name], rtol=0, atol=1e-5, err_msg=f"{a.job_id} {name}"
                )


@pytest.fixture(scope="module")
def fault_free(redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    """Results of the job set from an undisturbed consumer, on a queue of their own: computed
    once for the module's fault tests (the same jobs on the same teacher every time)."""
    tmp = tmp_path_factory.mktemp("fault-free")
    s = fast(
        Settings(
            redis={"url": redis_url, "home": str(tmp / "home")},
            queue={"name": f"ref-{uuid.uuid4().hex[:6]}"},
            storage={"url": f"file://{tmp / 'objects'}"},
            consumer={"block_ms": 200},
            log={"format": "json"},
        )
    )
    proc = launch_consumer(s, tmp, tmp / "consumer.log")
    try:
        wait_for_consumers(s, count=1, proc=proc)
        client = TeacherClient(s)
        reqs = job_set()
        results = client.wait(client.submit(reqs), timeout=scaled(120))
    finally:
        terminate(proc)
    return reqs, results


@pytest.mark.parametrize("point", ["read:2", "compute:2", "stored:3", "acked:3"])
def test_consumer_dies_at_each_point(point, settings, start_consumer, fault_free) -> None:
    reqs, want = fault_free
    s = fast(settings)
    client = TeacherClient(s)
    ids = client.submit(reqs)
    crashing = start_consumer(fast(settings, crash_at=point), wait=False)
    assert crashing.wait(timeout=scaled(120)) == 137, (
        "the consumer should die at the injected point"
    )
    # A fresh consumer (another name) takes over what the dead one held.
    start_consumer(s)
    got = client.wait(ids, timeout=scaled(120))
    assert_same_results(got, want)
    assert_exactly_once(client, ids)


def test_kill_9_at_a_random_moment(settings, start_consumer, fault_free) -> None:
    reqs, want = fault_free
    s = fast(settings)
    client = TeacherClient(s)
    ids = client.submit(reqs)
    victim = start_consumer(s)
    time.sleep(random.uniform(0.0, 1.5))
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=scaled(10))
    start_consumer(s)
    assert_same_results(client.wait(ids, timeout=scaled(120)), want)
    assert_exactly_once(client, ids)


class Supervisor:
    """Restarts consumer processes that exit, like a container restart policy."""

    def __init__(self, start, settings: Settings) -> None:
        self.start, self.settings = start, settings
        self.procs: list[subprocess.Popen] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Supervisor:
        self.procs.append(self.start(self.settings, wait=False))
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            if self.procs[-1].poll() is not None:
                self.procs.append(self.start(self.settings, wait=False))

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_batches_stay_in_flight_while_results_are_stored(
    in_flight, settings, start_consumer
) -> None:
    """`consumer.batches_in_flight` batches stay launched while the host stores an older
    batch's results: in the consumer's log, at most `in_flight` + 1 batches are started and
    not yet stored, and with the queue full that many are; every job completes once. The
    device's idle share the consumer reports stays a share (overlapping batches once made
    it negative)."""
    s = fast(settings, batch_max_jobs=1, batches_in_flight=in_flight)
    s = s.model_copy(update={"log": s.log.model_copy(update={"level": "debug", "format": "json"})})
    client = TeacherClient(s)
    ids = client.submit(job_set(12, seed=5))  # queued before the consumer starts: it never waits
    proc = start_consumer(s)
    assert all(r.ok for r in client.wait(ids, timeout=scaled(120)))

    def events() -> list[dict]:
        lines = proc.log_path.read_text().splitlines()  # type: ignore[attr-defined]
        return [json.loads(line) for line in lines if line.startswith("{")]

    # A batch's `batch.done` line follows its results: the last one may be on its way.
    wait_until(
        lambda: sum(e.get("event") == "batch.done" for e in events()) >= 12,
        "a batch.done line for each of the 12 batches",
    )
    open_batches, most, idle = set(), 0, []
    for event in events():
        if event.get("event") == "batch.start":
            open_batches.add(event["batch_id"])
            most = max(most, len(open_batches))
        elif event.get("event") == "batch.done":
            open_batches.discard(event["batch_id"])
            idle.append(event["device_idle_fraction"])
    assert most == in_flight + 1, "launched, not yet stored: the ones left plus the newest"
    assert len(idle) == 12 and all(0.0 <= f < 1.0 for f in idle), idle
    terminate(proc)
    stopped = [
        json.loads(x) for x in proc.log_path.read_text().splitlines() if "consumer.stopped" in x
    ]  # type: ignore[attr-defined]
    assert len(stopped) == 1 and stopped[0]["idle_s"] >= 0.0 and stopped[0]["busy_s"] > 0.0
    assert_exactly_once(client, ids)


@pytest.mark.parametrize("mode", ["raise", "exit", "hang"])
def test_poison_jobs_dead_letter_after_k_attempts(mode, settings, start_consumer) -> None:
    # A fixed consumer name: a restarted consumer first drains its own pending list. Two
    # deliveries (not `fast`'s K): counting across a redelivery is what is proven, and each
    # delivery of an exiting or hanging poison costs a consumer start.
    k = 2
    s = fast(settings, poison=f"{mode}:{POISON}", name=f"stable-{mode}", max_deliveries=k)
    client = TeacherClient(s)
    good = [TeacherRequest(input_ids=[1, 2, 3, i], job_id=f"good-{i}") for i in range(6)]
    poison = TeacherRequest(input_ids=[5, POISON, 6], job_id="poison")
    ids = client.submit([*good[:3], poison, *good[3:]])
    with Supervisor(start_consumer, s) as sup:
        results = client.wait(ids, timeout=scaled(180))
    by_id = {r.job_id: r for r in results}
    assert all(by_id[g.job_id].ok for g in good), "good jobs keep flowing"
    assert by_id["poison"].error, "the waiter gets the error, not a timeout"
    [(_, dead)] = client.r.xrange(keys.dead_stream(s.queue.name))
    assert dead[b"job_id"] == b"poison"
    assert int(dead[b"attempts"]) == k
    if mode == "raise":
        assert dead[b"exception"] == b"InjectedFault"
        assert len(sup.procs) == 1  # a raising job never takes the consumer down
    else:
        assert dead[b"exception"] == b"TooManyDeliveries"
        assert len(sup.procs) >= k + 1  # each attempt killed (or hung) a consumer
    assert_exactly_once(client, ids, dead={"poison"})


def test_replay_round_trip(settings, start_consumer) -> None:
    s = fast(settings, poison=f"raise:{POISON}")
    client = TeacherClient(s)
    ok_id, bad_id = client.submit(
        [TeacherRequest(input_ids=[1, 2, 3]), TeacherRequest(input_ids=[4, POISON, 4])]
    )
    proc = start_consumer(s)
    ok, bad = client.wait([ok_id, bad_id], timeout=scaled(60))
    assert ok.ok and bad.error
    terminate(proc)

    from producer.dead_letter_replay import replay

    dry = replay(client, dry_run=True)
    assert [(d.job_id, d.action) for d in dry] == [(bad_id, "would replay")]
    assert client.r.xlen(keys.dead_stream(s.queue.name)) == 1  # dry run changed nothing
    # A consumer without the poison: the replayed job now succeeds.
    start_consumer(fast(settings))
    [done] = replay(client)
    assert done.action == "replayed"
    [again] = client.wait([bad_id], timeout=scaled(60))
    assert again.ok, again.error
    assert client.r.xlen(keys.dead_stream(s.queue.name)) == 0
    assert_exactly_once(client, [ok_id, bad_id, bad_id])  # failed once, then completed
    assert client.r.xpending(keys.jobs_stream(s.queue.name), "consumers")["pending"] == 0


def _write_dead_letter(r: redis.Redis, queue: str, job_id: str, reason: str) -> None:
    """A dead letter as a consumer writes it, for a job submitted with this id."""
    from shared.deadletter import DeadLetter
    from shared.messages import encode_job

    fields = encode_job(TeacherRequest(input_ids=[1, 2, 3]), job_id=job_id)
    raw = {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
    letter = DeadLetter.for_entry(
        "1-0", raw, reason=reason, exception="Boom", deliveries=1, attempts=1, consumer="t"
    )
    r.xadd(keys.dead_stream(queue), letter.to_fields())


def test_replay_skips_succeeded_and_counts_replays(settings, r) -> None:
    """Replay skips a job that already succeeded, counts each replay against
    queue.max_replays (skipping past it unless forced), and filters by reason."""
    from producer.dead_letter_replay import replay

    s = settings.model_copy(update={"queue": settings.queue.model_copy(update={"max_replays": 1})})
    client = TeacherClient(s)
    client.streams.ensure_group()
    q = s.queue.name
    for job_id in ("a", "b"):
        _write_dead_letter(r, q, job_id, "boom")
    r.hset(keys.result_key(q, "a"), mapping={"status": "ok"})
    decisions = {d.job_id: d.action for d in replay(client)}
    assert decisions["a"].startswith("skipped: already succeeded")
    assert decisions["b"] == "replayed"
    _write_dead_letter(r, q, "b", "boom again")
    [d] = [d for d in replay(client, job_ids=["b"])]
    assert d.action.startswith("skipped: replayed 1 times")
    [forced] = replay(client, job_ids=["b"], force=True)
    assert forced.action == "replayed"
    assert int(r.hget(keys.replays_key(q), "b")) == 2
    assert [d.job_id for d in replay(client, reason="nothing matches")] == []


@pytest.fixture
def own_redis(tmp_path: Path):
    """A valkey-server of this test's own (it gets killed), AOF everysec, fixed port."""
    data = tmp_path / "own-redis"
    data.mkdir()
    server = Valkey(data)
    yield server
    server.stop()


def test_a_transaction_meeting_an_empty_script_cache_runs_again(r: redis.Redis) -> None:
    """`execute_scripted`: a transaction answered NOSCRIPT (the server restarted between the
    pipeline's script check and its EXEC, as test_redis_killed_and_restarted provokes) is
    filled and sent once more; a second NOSCRIPT is raised."""
    import asyncio

    from redis.asyncio import Redis as AsyncRedis

    from shared.redis_client import execute_scripted, execute_scripted_async

    key = f"noscript-{uuid.uuid4().hex}"
    script = r.register_script("return redis.call('INCR', KEYS[1])")
    missing = "0" * 40  # the sha of no loaded script: what a flushed cache answers
    calls: list[int] = []

    def fill(pipe) -> None:
        calls.append(1)
        if len(calls) == 1:
            pipe.execute_command("EVALSHA", missing, 1, key)
        else:
            script(keys=[key], client=pipe)

    assert execute_scripted(r, fill) == [1] and len(calls) == 2

    def always_missing(pipe) -> None:
        pipe.execute_command("EVALSHA", missing, 1, key)

    with pytest.raises(redis.exceptions.NoScriptError):
        execute_scripted(r, always_missing)

    aio_calls: list[int] = []
    url = "redis://{host}:{port}/0".format(**r.connection_pool.connection_kwargs)

    async def fill_async(pipe) -> None:
        aio_calls.append(1)
        if len(aio_calls) == 1:
            pipe.execute_command("EVALSHA", missing, 1, key)
        else:
            pipe.incr(key)

    async def go() -> list:
        client = AsyncRedis.from_url(url)
        try:
            return await execute_scripted_async(client, fill_async)
        finally:
            await client.aclose()

    assert asyncio.run(go()) == [2] and len(aio_calls) == 2
    assert int(r.get(key)) == 2


def test_a_script_call_meeting_noscript_is_made_again(r: redis.Redis) -> None:
    """`run_script` / `run_script_async`: NOSCRIPT that outlives redis-py's one reload (in a
    failover its SCRIPT LOAD and EVALSHA can reach different servers; here the real server's
    script cache is flushed before each EVALSHA) is met by calling again, and the script runs
    once. After `_SCRIPT_ATTEMPTS` calls the NoScriptError is raised and nothing ran."""
    import asyncio

    from redis.asyncio import Redis as AsyncRedis

    from shared.redis_client import _SCRIPT_ATTEMPTS, run_script, run_script_async

    text = "return redis.call('INCR', KEYS[1])"
    url = "redis://{host}:{port}/0".format(**r.connection_pool.connection_kwargs)
    per_call = 2  # redis-py's EVALSHA, then (after its SCRIPT LOAD) EVALSHA once more

    client = ForgetsScripts.from_url(url)
    script = client.register_script(text)
    key = f"noscript-{uuid.uuid4().hex}"
    client.forget = per_call * 2  # two calls fail whole, the third runs
    assert run_script(script, keys=[key], args=[]) == 1 and client.forget == 0
    client.forget = per_call * _SCRIPT_ATTEMPTS
    with pytest.raises(redis.exceptions.NoScriptError):
        run_script(script, keys=[key], args=[])
    assert client.forget == 0 and int(r.get(key)) == 1, "the failed calls ran nothing"

    class ForgetsAsync(AsyncRedis):
        forget = 0

        async def evalsha(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
            if self.forget > 0:
                self.forget -= 1
                await self.script_flush()
            return await super().evalsha(*args, **kwargs)

    async def go() -> tuple[int, type[BaseException] | None]:
        aclient = ForgetsAsync.from_url(url)
        try:
            ascript = aclient.register_script(text)
            aclient.forget = per_call * 2
            value = await run_script_async(ascript, keys=[key], args=[])
            aclient.forget = per_call * _SCRIPT_ATTEMPTS
            try:
                await run_script_async(ascript, keys=[key], args=[])
            except redis.exceptions.NoScriptError as exc:
                return value, type(exc)
            return value, None
        finally:
            await aclient.aclose()

    assert asyncio.run(go()) == (2, redis.exceptions.NoScriptError)
    assert int(r.get(key)) == 2


def test_redis_killed_and_restarted(settings, own_redis, start_consumer) -> None:
    # own_redis before start_consumer: torn down after it, so the consumer stops with its
    # Redis still there (the other way it drained for its grace against a dead server).
    url = own_redis.url
    s = fast(settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": url})}))
    client = TeacherClient(s)
    start_consumer(s)
    acknowledged: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set() and i < 60:
            req = TeacherRequest(input_ids=[1, 2, 3, i % 400 + 4], job_id=f"p-{i:03d}")
            try:
                acknowledged.extend(client.submit([req]))
                i += 1
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.1)  # the server is down: the producer retries the same job id

    producer = threading.Thread(target=produce)
    producer.start()
    wait_until(lambda: len(acknowledged) >= 5, "some submits acknowledged", timeout=30)
    own_redis.kill()
    time.sleep(1.0)  # the outage's length (a fault held, not a wait for something to happen)
    own_redis.restart()  # same dir: the AOF brings back every acknowledged write
    producer.join(timeout=scaled(120))
    stop.set()
    assert len(acknowledged) == 60
    results = client.wait(acknowledged, timeout=scaled(180))
    assert all(res.ok for res in results)
    assert_exactly_once(client, acknowledged)


def test_a_delivery_whose_reply_was_lost_is_taken_again(settings, start_consumer) -> None:
    """A read that ran in Redis but whose reply never reached the consumer (Redis killed or
    failed over just after XREADGROUP, the client retrying the read) leaves an entry in the
    consumer's own pending list that it knows nothing of. No other consumer takes it while
    the owner's heartbeat is fresh, so a lone consumer must take it again itself, without
    counting a delivery (the job never ran): here the entry is enqueued and delivered to the
    running consumer's name in one transaction, as such a read leaves it."""
    from shared.messages import encode_job
    from shared.redis_client import execute_scripted

    s = fast(settings)
    proc = start_consumer(s)
    client = TeacherClient(s)
    [name] = client.consumers()
    streams = client.streams
    req = TeacherRequest(input_ids=[1, 2, 3, 4, 5], job_id="lost-reply")

    def enqueue_and_deliver(pipe) -> None:
        fields = encode_job(req, job_id=req.job_id)
        streams.submit(req.job_id, fields, tokens=req.num_tokens, client=pipe)
        pipe.xreadgroup(streams.group, name, {streams.jobs: ">"}, count=1)

    *_, delivered = execute_scripted(client.r, enqueue_and_deliver)
    assert len(delivered[0][1]) == 1, "the job went to the consumer's pending list unseen"
    [res] = client.wait(["lost-reply"], timeout=scaled(60))
    assert res.ok
    assert_exactly_once(client, ["lost-reply"])
    taken = [json.loads(line) for line in proc.log_path.read_text().splitlines() if line[:1] == "{"]
    assert any(
        e.get("event") == "claim.reclaimed" and e.get("owner") == name and e.get("owner_alive")
        for e in taken
    ), "taken again from its own pending list, as a live owner's (no delivery counted)"
    assert proc.poll() is None


def test_bad_entries_never_take_a_consumer_down(settings, start_consumer, r) -> None:
    from hypothesis import HealthCheck, given
    from hypothesis import settings as hsettings
    from hypothesis import strategies as st

    from shared.codec import encode_array

    proc = start_consumer(fast(settings))
    client = TeacherClient(settings)
    stream = keys.jobs_stream(settings.queue.name)
    value = st.one_of(
        st.binary(max_size=40),
        st.text(max_size=20),
        st.integers().map(str),
        st.just(b'{"top_k": -1}'),
        st.just(b'{"temperature": 0}'),
        st.just(encode_array(np.array([1, 10**6], dtype=np.int64))),
        st.just(encode_array(np.arange(10**5, dtype=np.int32))[:100]),
    )
    fields = st.dictionaries(
        st.sampled_from(["v", "job_id", "meta", "input_ids", "label_token_ids", "junk"]),
        value,
        min_size=1,
        max_size=6,
    )
    bad_ids: list[str] = []

    @hsettings(
        max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(fields)
    def write(entry: dict) -> None:
        job_id = f"bad-{len(bad_ids)}"
        entry = {**entry, "job_id": job_id, "v": entry.get("v", "1")}
        r.xadd(stream, entry)
        bad_ids.append(job_id)

    client.streams.ensure_group()
    write()
    good = client.submit([TeacherRequest(input_ids=[1, 2, 3, i]) for i in range(5)])
    results = client.wait(bad_ids + good, timeout=scaled(120))
    assert proc.poll() is None, "the consumer is still running"
    assert all(res.ok for res in results[len(bad_ids) :])
    failed = [res for res in results[: len(bad_ids)] if not res.ok]
    # Every bad entry failed with a reason (a few random ones may happen to be valid jobs).
    assert all(res.error for res in failed)
    dead = {f[b"job_id"].decode() for _, f in r.xrange(keys.dead_stream(settings.queue.name))}
    assert dead == {res.job_id for res in failed}
    assert r.xpending(stream, "consumers")["pending"] == 0


def test_janitor_trims_only_acknowledged_entries(settings, r) -> None:
    from consumer.serve.retention import trim_acknowledged

    stream = keys.jobs_stream(settings.queue.name)
    r.xgroup_create(stream, "g1", id="0", mkstream=True)
    r.xgroup_create(stream, "g2", id="0")
    ids = [r.xadd(stream, {"i": i}) for i in range(10)]
    r.xreadgroup("g1", "c", {stream: ">"}, count=10)  # g1 has seen all 10
    r.xack(stream, "g1", *ids[:6])  # ... and finished 6
    r.xreadgroup("g2", "c", {stream: ">"}, count=8)  # g2 has seen 8
    r.xack(stream, "g2", *ids[:8])  # ... and finished them
    trimmed = trim_acknowledged(r, stream)
    left = [eid for eid, _ in r.xrange(stream)]
    assert left == ids[6:], "entries pending in g1 (6..9) and undelivered to g2 (8, 9) stay"
    assert trimmed == 6
    r.xack(stream, "g1", *ids[6:])
    trim_acknowledged(r, stream)
    assert [eid for eid, _ in r.xrange(stream)] == ids[8:]  # g2 has not read 8 and 9 yet


def test_consumer_refuses_redis_without_aof(settings, own_redis, tmp_path) -> None:
    url = own_redis.url
    redis.Redis.from_url(url).config_set("appendonly", "no")
    s = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": url})})
    env = {**os.environ, **to_env(s), "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "consumer"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert out.returncode != 0
    assert "AOF is off" in out.stdout + out.stderr


def test_backpressure_raises_or_blocks(settings, start_consumer) -> None:
    q = settings.queue.model_copy(update={"max_pending_tokens": 20, "backpressure": "raise"})
    client = TeacherClient(settings.model_copy(update={"queue": q}))
    client.submit([TeacherRequest(input_ids=list(range(15)))])
    with pytest.raises(QueueFull, match="max_pending_tokens=20"):
        client.submit([TeacherRequest(input_ids=list(range(10)))])
    # Blocking mode: submit waits for the consumer to make room, then goes through.
    blocking = settings.model_copy(update={"queue": q.model_copy(update={"backpressure": "block"})})
    client = TeacherClient(blocking)
    start_consumer(blocking)
    ids = client.submit([TeacherRequest(input_ids=list(range(i, i + 15))) for i in range(5)])
    assert all(res.ok for res in client.wait(ids, timeout=scaled(60)))
