"""Redis under pressure, with a real valkey-server at a small `maxmemory` (noeviction) and real
consumer processes: a full Redis, dead consumers and retention never turn good work into
failures (issue #21).

Each test starts its own server (it is filled to its limit) through the helpers of
tests/conftest.py; "ballast" keys fill it and deleting them frees it again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from producer import QueueFull, TeacherClient, TeacherRequest
from shared import keys
from shared.settings import Settings, to_env
from shared.streams import Streams
from tests.helpers import REPO, fast, wait_for_consumers
from tests.processes import Valkey, terminate
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.integration

BALLAST = "ballast:"


class SmallRedis:
    """A valkey-server of one test, AOF on, noeviction, `maxmemory` small."""

    def __init__(self, data: Path, maxmemory: str) -> None:
        self.server = Valkey(data, "--maxmemory", maxmemory)
        self.url = self.server.url
        self.r = redis.Redis.from_url(self.url)
        self._n = 0

    def fill(self) -> int:
        """Write ballast until Redis refuses even a small write (OOM); returns the ballast keys
        written. (A large write can be refused for its own query buffer, hence the smaller
        pieces at the end.)"""
        written = 0
        for chunk in (16384, 1024, 64, 8):
            while True:
                try:
                    self.r.set(f"{BALLAST}{self._n}", b"x" * chunk)
                except redis.exceptions.OutOfMemoryError:
                    break
                self._n += 1
                written += 1
        return written

    def free(self) -> None:
        """Delete every ballast key."""
        for key in self.r.scan_iter(f"{BALLAST}*", count=1000):
            self.r.unlink(key)

    def full(self) -> bool:
        """True when Redis refuses a small write."""
        try:
            self.r.set("probe", b"x" * 64)
        except redis.exceptions.OutOfMemoryError:
            return True
        self.r.delete("probe")
        return False

    def stop(self) -> None:
        self.server.kill()


@pytest.fixture
def small_redis(tmp_path: Path) -> Iterator[SmallRedis]:
    """A valkey-server with maxmemory 8 MB (the tiny model's jobs and results fit many times)."""
    data = tmp_path / "small-redis"
    data.mkdir()
    server = SmallRedis(data, "8mb")
    yield server
    server.stop()


def on(settings: Settings, url: str, **consumer: object) -> Settings:
    """`settings` on the given Redis with the tests' fast consumer limits (`fast`), a longer
    hang limit (batches wait on a full Redis here) and the fields given."""
    s = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": url})})
    base = {"job_timeout_s": scaled(20.0), "stop_grace_s": 3.0}
    return fast(s, **{**base, **consumer})


def jobs(n: int, prefix: str = "j", length: int = 4) -> list[TeacherRequest]:
    return [
        TeacherRequest(
            input_ids=[(i * 7 + j) % 500 for j in range(length)], top_k=2, job_id=f"{prefix}-{i}"
        )
        for i in range(n)
    ]


# -- the result record: a dead letter never wins over a real result ---------------------------


def _record(status: str, job_id: str) -> dict:
    return {"v": "1", "status": status, "meta": json.dumps({"job_id": job_id, "error": None})}


def _wait_idle(r: redis.Redis, streams: Streams, ids: list, *, ms: int) -> None:
    """Wait until every entry in `ids` has been idle (since its last delivery) for `ms`."""

    def idle() -> bool:
        rows = r.xpending_range(streams.jobs, streams.group, "-", "+", 100)
        times = {row["message_id"]: row["time_since_delivered"] for row in rows}
        return all(times.get(i, -1) >= ms for i in ids)

    wait_until(idle, f"entries idle for {ms} ms", timeout=10)


def _blocked_on(r: redis.Redis, command: str) -> bool:
    """Whether some client of `r` is blocked in `command` (CLIENT LIST flag b)."""
    return any(c.get("cmd") == command and "b" in c.get("flags", "") for c in r.client_list())


def test_real_result_replaces_a_dead_letter_and_never_the_reverse(r, settings) -> None:
    """A dead letter written first is replaced by the real result (record and dead-letter
    entry), and a dead letter that comes after a real result is not written at all."""
    q = settings.queue.name
    streams = Streams(r, q)
    streams.ensure_group()
    from shared.deadletter import DeadLetter

    def dead_letter(job_id: str) -> DeadLetter:
        return DeadLetter.for_entry(
            "1-0",
            {b"job_id": job_id.encode()},
            reason="delivered 4 times",
            exception="TooManyDeliveries",
            deliveries=4,
            attempts=3,
            consumer="c",
        )

    dead = dead_letter("a")
    assert streams.complete(
        job_id="a",
        entry_id="",
        status="failed",
        record=_record("failed", "a"),
        ttl_s=60,
        dead_letter=dead,
    )
    assert r.xlen(keys.dead_stream(q)) == 1
    assert streams.complete(
        job_id="a", entry_id="", status="ok", record=_record("ok", "a"), ttl_s=60
    )
    assert r.hget(keys.result_key(q, "a"), "status") == b"ok"
    assert r.hget(keys.result_key(q, "a"), "dead_entry") is None
    assert r.xlen(keys.dead_stream(q)) == 0, "the dead letter is gone with its record"
    # The other order: the real result first; the late dead letter changes nothing.
    assert streams.complete(
        job_id="b", entry_id="", status="ok", record=_record("ok", "b"), ttl_s=60
    )
    assert not streams.complete(
        job_id="b",
        entry_id="",
        status="failed",
        record=_record("failed", "b"),
        ttl_s=60,
        dead_letter=dead_letter("b"),
    )
    assert r.hget(keys.result_key(q, "b"), "status") == b"ok"
    assert r.xlen(keys.dead_stream(q)) == 0
    # A cancellation (a failure without dead letter) is not replaced by a late result.
    assert streams.complete(
        job_id="c", entry_id="", status="failed", record=_record("failed", "c"), ttl_s=60
    )
    assert not streams.complete(
        job_id="c", entry_id="", status="ok", record=_record("ok", "c"), ttl_s=60
    )


# -- a full Redis ------------------------------------------------------------------------------


def test_group_and_refresh_work_while_redis_is_full(small_redis, settings) -> None:
    """With Redis at maxmemory: an existing group is no error, the in-flight refresh still
    resets idle times (and never takes back an entry another consumer took over), acks of
    skipped entries go through, and the submit script is refused as a whole."""
    from consumer.serve.claims import Claimer

    r = small_redis.r
    streams = Streams(r, settings.queue.name)
    streams.ensure_group()
    ids = [r.xadd(streams.jobs, {"n_tokens": 4, "x": i}) for i in range(3)]
    r.xreadgroup(streams.group, "me", {streams.jobs: ">"}, count=3)
    small_redis.fill()
    assert small_redis.full()
    streams.ensure_group()  # XGROUP CREATE is refused under OOM; the group exists: fine
    mine = Claimer(streams, "me", visibility_timeout_s=60, block_ms=10)
    _wait_idle(r, streams, ids, ms=200)
    r.xclaim(streams.jobs, streams.group, "other", min_idle_time=0, message_ids=[ids[2]])
    assert mine.touch([i.decode() for i in ids]) == 2, "refreshes its own two, not the third"
    rows = r.xpending_range(streams.jobs, streams.group, "-", "+", 10)
    owners = {row["message_id"]: row["consumer"] for row in rows}
    assert owners[ids[2]] == b"other"
    assert all(row["time_since_delivered"] < 150 for row in rows)
    streams.ack(ids[0].decode(), tokens=4)  # flagged allow-oom: acking frees memory
    assert r.xpending(streams.jobs, streams.group)["pending"] == 2
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        streams.submit("new", {"job_id": "new"}, tokens=4)
    assert not r.exists(keys.submitted_key(settings.queue.name, "new")), "refused as a whole"


def test_submit_refuses_or_blocks_above_the_memory_fraction(small_redis, settings) -> None:
    """Above queue.max_memory_fraction of maxmemory, submit raises QueueFull naming the queue,
    the figures and the remedy (backpressure=raise), or waits until there is room (block)."""
    s = on(settings, small_redis.url)
    q = s.queue.model_copy(update={"backpressure": "raise", "max_memory_fraction": 0.5})
    client = TeacherClient(s.model_copy(update={"queue": q}))
    client.submit(jobs(2, "before"))
    small_redis.fill()
    with pytest.raises(QueueFull) as err:
        client.submit(jobs(1, "refused"))
    text = str(err.value)
    assert q.name in text and "MiB of" in text and "max_memory_fraction=0.5" in text
    assert "maxmemory" in text and "delete_result_on_read" in text
    blocking = s.model_copy(update={"queue": q.model_copy(update={"backpressure": "block"})})
    client = TeacherClient(blocking)
    done: list[str] = []
    import threading

    t = threading.Thread(target=lambda: done.extend(client.submit(jobs(1, "waited"))))
    t.start()
    wait_until(lambda: _blocked_on(small_redis.r, "xread"), "submit waiting for room", timeout=30)
    assert not done, "blocked while Redis is above the fraction"
    small_redis.free()
    t.join(timeout=scaled(10))
    assert done == ["waited-0"]


def test_status_shows_memory(small_redis, settings) -> None:
    """`status --json` reports Redis used / limit (near 100 % once filled)."""
    s = on(settings, small_redis.url)
    env = {**os.environ, **to_env(s), "PYTHONPATH": str(REPO)}
    small_redis.fill()
    out = subprocess.run(
        [sys.executable, "-m", "producer.cli", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert out.returncode == 0, out.stderr
    mem = json.loads(out.stdout)["memory"]
    assert mem["limit_bytes"] == 8 * 2**20
    assert mem["used_bytes"] > mem["limit_bytes"] * 0.9
    assert mem["fraction"] > 0.9


# -- start-up ----------------------------------------------------------------------------------


def test_unsafe_redis_exits_78_before_the_model_loads(small_redis, settings, tmp_path) -> None:
    """AOF off: the consumer prints one or two lines, no traceback, and exits 78 without
    loading the model."""
    small_redis.r.config_set("appendonly", "no")
    s = on(settings, small_redis.url)
    env = {**os.environ, **to_env(s), "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "consumer"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert out.returncode == 78
    assert "AOF is off" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert len(out.stderr.strip().splitlines()) <= 2
    assert "model" not in out.stdout.lower() or "consumer.ready" not in out.stdout
    assert time.monotonic() - t0 < scaled(60)


def test_consumer_starts_and_stops_while_redis_is_full(small_redis, settings, start_consumer):
    """A consumer started while Redis is full stays up (the group exists: no crash loop),
    reports itself alive, and exits on SIGTERM within its grace period."""
    s = on(settings, small_redis.url)
    TeacherClient(s).streams.ensure_group()
    small_redis.fill()
    proc = start_consumer(s)  # waits for its heartbeat: it is written while Redis is full
    client = TeacherClient(s)
    [first] = [c["time"] for c in client.consumers().values()]
    # Alive through later beats, not only the first: no crash loop while Redis stays full.
    wait_until(
        lambda: (
            proc.poll() is not None
            or max(c["time"] for c in client.consumers().values()) > first + 1.0
        ),
        "a heartbeat a second after the first",
        timeout=30,
    )
    assert proc.poll() is None, proc.log_path.read_text()[-2000:]
    t0 = time.monotonic()
    assert terminate(proc) == 0
    assert time.monotonic() - t0 < s.consumer.stop_grace_s + 10


def _unique(settings: Settings) -> Settings:
    q = settings.queue.model_copy(update={"name": f"p{uuid.uuid4().hex[:8]}"})
    return settings.model_copy(update={"queue": q})


# -- retention ---------------------------------------------------------------------------------


def test_traces_have_their_own_ttl_and_sampling(r, settings) -> None:
    """Span records expire after queue.trace_ttl_s; at a sampling rate of 0.5 about half the
    traces are kept, whole, and two processes keep exactly the same ones."""
    from shared.trace_store import RedisSpanSink

    q = settings.queue.name
    trace_ids = [uuid.uuid4().hex for _ in range(400)]
    kept: list[set[str]] = []
    for process in range(2):
        sink = RedisSpanSink(r, q, ttl_s=120, sample_rate=0.5)
        for tid in trace_ids:
            sink(
                {
                    "trace_id": tid,
                    "span_id": f"s{process}",
                    "parent_span_id": None,
                    "name": "x",
                    "start_time": time.time(),
                    "duration_ms": 1.0,
                    "attrs": {"job_id": f"job-{tid}"},
                }
            )
        sink.close()
        kept.append({t for t in trace_ids if r.exists(keys.trace_key(q, t))})
    assert kept[0] == kept[1], "every process keeps the same traces"
    assert 140 <= len(kept[0]) <= 260, len(kept[0])  # binomial(400, 0.5): 6 sigma
    some = next(iter(kept[0]))
    assert r.llen(keys.trace_key(q, some)) == 2, "a kept trace has the spans of both processes"
    assert 0 < r.ttl(keys.trace_key(q, some)) <= 120
    assert 0 < r.ttl(keys.job_trace_key(q, f"job-{some}")) <= 120


def test_result_deleted_once_read(r, settings) -> None:
    """With queue.delete_result_on_read, `results` returns a record once and deletes it;
    results not finished yet are left alone."""
    q = settings.queue.model_copy(update={"delete_result_on_read": True})
    client = TeacherClient(settings.model_copy(update={"queue": q}))
    client.streams.complete(
        job_id="read-me", entry_id="", status="ok", record=_record("ok", "read-me"), ttl_s=60
    )
    first = client.results(["read-me", "not-yet"], strict=False)
    assert first[0] is not None and first[0].job_id == "read-me" and first[1] is None
    assert not r.exists(keys.result_key(q.name, "read-me"))
    assert client.results(["read-me"], strict=False) == [None]


# -- consumers while Redis fills up and frees again --------------------------------------------


def _computed_jobs(procs) -> int:
    """Jobs scored, summed over the consumers' `batch.done` log lines."""
    total = 0
    for p in procs:
        for line in p.log_path.read_text().splitlines():
            if '"batch.done"' in line:
                total += json.loads(line)["jobs"]
    return total


def _log_events(procs, event: str) -> int:
    return sum(p.log_path.read_text().count(f'"{event}"') for p in procs)


def full_redis_run(
    small_redis: SmallRedis,
    settings: Settings,
    start_consumer,
    *,
    n_jobs: int,
    full_s: float,
    cycles: int = 1,
) -> dict:
    """Two consumers work while Redis fills to maxmemory and stays full `full_s` seconds, then
    is freed, `cycles` times; asserts the invariants and returns the run's figures."""
    # Heartbeats every 0.3 s; dead after 10 silent beats, so a heartbeat thread starved of CPU
    # for a second on a loaded 2-core machine is not taken for a dead consumer.
    s = on(
        settings, small_redis.url, visibility_timeout_s=3.0, max_deliveries=2, dead_after_beats=10
    )
    client = TeacherClient(s)
    procs = [start_consumer(s), start_consumer(s)]
    wait_for_consumers(s, count=2)  # the second start returns once any one is ready
    t0 = time.monotonic()
    ids = client.submit(jobs(n_jobs, "full", length=40))
    client.wait(ids[:4], timeout=scaled(60))
    unfinished = []
    for _ in range(cycles):
        small_redis.fill()
        unfinished.append(sum(res is None for res in client.results(ids)))
        deadline = time.monotonic() + full_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            small_redis.fill()  # top up what acknowledgements and trimming freed meanwhile
        assert all(p.poll() is None for p in procs)
        beats = client.status()["consumers"]
        assert sum(c["alive"] for c in beats.values()) == 2, f"alive while full: {beats}"
        assert all(c.get("paused") for c in beats.values()), beats
        small_redis.free()
        wait_until(
            lambda: not any(c.get("paused") for c in client.status()["consumers"].values()),
            "consumers resumed once Redis has room",
            timeout=60,
        )
    assert unfinished[0] >= 20, "Redis filled while the consumers were working"
    results = client.wait(ids, timeout=scaled(600))
    assert all(res.ok for res in results), [res.error for res in results if not res.ok][:3]
    assert small_redis.r.xlen(keys.dead_stream(s.queue.name)) == 0
    assert _log_events(procs, "job.dead_lettered") == 0
    computed = _computed_jobs(procs)
    reclaims = _log_events(procs, "claim.reclaimed")
    assert computed == len(ids), f"no job computed twice ({computed}, {reclaims} reclaims)"
    assert _log_events(procs, "consumer.paused") >= cycles
    assert _log_events(procs, "consumer.resumed") >= cycles
    return {
        "jobs": len(ids),
        "unfinished_when_full": unfinished,
        "full_s": full_s,
        "cycles": cycles,
        "computed": computed,
        "reclaims": reclaims,
        "dead_letters": 0,
        "pauses": _log_events(procs, "consumer.paused"),
        "store_retries": _log_events(procs, "store.retry"),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def test_full_redis_turns_no_good_work_into_failures(
    small_redis, settings, start_consumer, request
) -> None:
    """Two consumers work while Redis fills to maxmemory and stays full for several visibility
    timeouts, then is freed: every job succeeds, none is dead-lettered, none is computed twice
    (their entries stay refreshed, nobody takes them over), and both consumers stay alive,
    paused while full and resumed after."""
    figures = full_redis_run(small_redis, settings, start_consumer, n_jobs=150, full_s=7.0)
    request.node.user_properties.append(("figures", json.dumps(figures)))


@pytest.mark.slow
def test_full_redis_repeatedly_for_long(small_redis, settings, start_consumer, request) -> None:
    """The same, with three cycles of 20 s at maxmemory (over 6 visibility timeouts each)."""
    figures = full_redis_run(
        small_redis, settings, start_consumer, n_jobs=600, full_s=20.0, cycles=3
    )
    request.node.user_properties.append(("figures", json.dumps(figures)))


def test_dead_consumer_reclaimed_by_heartbeat_and_pruned(settings, start_consumer, r) -> None:
    """A consumer killed mid-batch is found dead by its heartbeat within seconds — far below
    the visibility timeout (120 s here) — its entries are finished by another consumer, and
    its name and heartbeat record are then pruned; names of consumers stopped cleanly too."""
    s = on(settings, settings.redis.url or "", visibility_timeout_s=120.0)
    client = TeacherClient(s)
    stopped = start_consumer(s)
    assert terminate(stopped) == 0
    ids = client.submit(jobs(8, "dead"))
    victim = start_consumer(on(s, s.redis.url or "", crash_at="compute:1"), wait=False)
    assert victim.wait(timeout=scaled(120)) == 137
    t0 = time.monotonic()
    survivor = start_consumer(s)
    results = client.wait(ids, timeout=scaled(60))
    assert all(res.ok for res in results)
    assert time.monotonic() - t0 < scaled(60), "taken over long before the visibility timeout"
    stream, group = keys.jobs_stream(s.queue.name), s.queue.group
    deadline = time.monotonic() + scaled(10)
    while time.monotonic() < deadline:
        names = {c["name"].decode() for c in r.xinfo_consumers(stream, group)}
        beats = set(client.consumers())
        if len(names) == 1 and len(beats) == 1:
            break
        time.sleep(0.2)
    assert len(names) == 1 and names == beats, (names, beats)
    assert _log_events([survivor], "consumer.pruned") >= 1
    assert r.xpending(stream, group)["pending"] == 0


def test_pod_name_is_kept_across_a_restart(settings, start_consumer, r) -> None:
    """Under Kubernetes (KUBERNETES_SERVICE_HOST set) a consumer is named after its pod
    (HOSTNAME). Killed mid-batch and restarted as the same pod, it takes back its own pending
    entries at once (long before the visibility timeout), is not pruned as the dead
    predecessor it replaces, and the group keeps that one name."""
    url = settings.redis.url or ""
    s = on(settings, url, visibility_timeout_s=120.0, dead_after_beats=1000)
    pod = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "HOSTNAME": "teacherq-consumer-0"}
    client = TeacherClient(s)
    ids = client.submit(jobs(6, "pod"))
    victim = start_consumer(on(s, url, crash_at="compute:1"), extra_env=pod, wait=False)
    assert victim.wait(timeout=scaled(120)) == 137
    stream, group = keys.jobs_stream(s.queue.name), s.queue.group
    held = r.xpending_range(stream, group, "-", "+", 100)
    assert held and {p["consumer"] for p in held} == {b"teacherq-consumer-0"}
    t0 = time.monotonic()
    start_consumer(s, extra_env=pod)
    assert all(res.ok for res in client.wait(ids, timeout=scaled(60)))
    assert time.monotonic() - t0 < scaled(60), "its own entries were not taken back at start"
    names = {c["name"].decode() for c in r.xinfo_consumers(stream, group)}
    assert names == {"teacherq-consumer-0"} == set(client.consumers())
    assert r.xpending(stream, group)["pending"] == 0


def test_prune_spares_a_consumer_that_beat_again_since_judged_dead(r, settings) -> None:
    """A consumer judged dead (stopped) is restarted under the same name and beats before the
    reaper's prune runs: the prune (given the record it judged by) leaves it in the group
    and keeps its heartbeat; judged again from the stale record later, it is pruned."""
    from consumer.serve.liveness import Reaper

    q = settings.queue.name
    streams = Streams(r, q)
    streams.ensure_group()
    beats = keys.consumers_key(q)
    r.xgroup_createconsumer(streams.jobs, streams.group, "pod-0")
    r.hset(beats, "pod-0", json.dumps({"state": "stopped", "time": time.time() - 100}))
    reaper = Reaper(
        r,
        stream=streams.jobs,
        group=streams.group,
        consumers_key=beats,
        me="pod-1",
        dead_after_s=1.0,
        visibility_timeout_s=60.0,
    )
    (judged,) = reaper.dead()
    assert judged.name == "pod-0" and judged.pending == 0
    fresh = json.dumps({"state": "ready", "time": time.time()})
    r.hset(beats, "pod-0", fresh)  # back, under the same name
    args = [streams.group, "pod-0", judged.record]
    assert reaper._prune(keys=[streams.jobs, beats], args=args) == 0
    assert r.hget(beats, "pod-0") == fresh.encode()
    assert [c["name"] for c in r.xinfo_consumers(streams.jobs, streams.group)] == [b"pod-0"]
    r.hset(beats, "pod-0", json.dumps({"state": "stopped", "time": time.time() - 100}))
    assert reaper.sweep() == [] and reaper.pruned == 1
    assert r.hget(beats, "pod-0") is None
    assert r.xinfo_consumers(streams.jobs, streams.group) == []


def test_takeover_from_a_live_owner_counts_no_delivery(r, settings) -> None:
    """An entry idle past the visibility timeout is taken over; if its owner is alive by its
    heartbeat (so only its refresh failed), the takeover keeps the delivery count; from an
    owner without a live heartbeat it counts one more delivery."""
    from consumer.serve.claims import Claimer

    streams = Streams(r, settings.queue.name)
    streams.ensure_group()
    beats = keys.consumers_key(settings.queue.name)
    ids = [r.xadd(streams.jobs, {"n_tokens": 4, "x": i}) for i in range(2)]
    r.xreadgroup(streams.group, "live", {streams.jobs: ">"}, count=1)
    r.xreadgroup(streams.group, "gone", {streams.jobs: ">"}, count=1)
    now = time.time()
    r.hset(beats, "live", json.dumps({"state": "busy", "time": now}))
    r.hset(beats, "gone", json.dumps({"state": "busy", "time": now}))
    _wait_idle(r, streams, ids, ms=600)  # both entries idle past the 0.5 s visibility timeout
    r.hset(beats, "live", json.dumps({"state": "busy", "time": time.time()}))
    taker = Claimer(
        streams,
        "taker",
        visibility_timeout_s=0.5,
        block_ms=10,
        heartbeat_interval_s=60.0,
        dead_after_beats=3,
    )
    taker._next_scan = float("inf")  # only the visibility-timeout path in this test
    got = taker.next_entries(1) + taker.next_entries(1)
    assert sorted(eid for eid, _ in got) == sorted(ids)
    counts = taker.delivery_counts(ids)
    assert counts[ids[0]] == 1, "taken from a live owner: no delivery counted"
    assert counts[ids[1]] == 1, "the heartbeat of 'gone' is fresh too (60 s intervals)"
    r.xack(streams.jobs, streams.group, ids[0])
    # Now 'gone' is silent past 3 intervals of 0.1 s: dead.
    r.hset(beats, "gone", json.dumps({"state": "busy", "time": time.time() - 10}))
    r.xclaim(
        streams.jobs, streams.group, "gone", min_idle_time=0, message_ids=[ids[1]], justid=True
    )
    _wait_idle(r, streams, ids[1:], ms=600)
    taker2 = Claimer(
        streams,
        "taker2",
        visibility_timeout_s=0.5,
        block_ms=10,
        heartbeat_interval_s=0.1,
        dead_after_beats=3,
    )
    got = taker2.next_entries(1)
    assert [eid for eid, _ in got] == [ids[1]]
    assert taker2.delivery_counts([ids[1]])[ids[1]] == 2, "its owner died: one more delivery"
    assert taker2.stats.reclaimed_from_dead == 1


def test_sigterm_while_results_wait_for_room(small_redis, settings, start_consumer) -> None:
    """A consumer whose results are refused (Redis full) exits on SIGTERM within its stop
    grace, leaving those entries pending; once Redis has room another consumer finishes
    them: every job succeeds, none is dead-lettered."""
    s = on(settings, small_redis.url, stop_grace_s=2.0)
    client = TeacherClient(s)
    proc = start_consumer(s)
    ids = client.submit(jobs(150, "term", length=40))
    client.wait(ids[:4], timeout=scaled(60))
    small_redis.fill()
    # The consumer has met the full Redis: it paused claiming, or a result write was refused.
    wait_until(
        lambda: any(e in proc.log_path.read_text() for e in ('"consumer.paused"', '"store.retry"')),
        "the consumer meeting the full Redis",
        timeout=60,
    )
    t0 = time.monotonic()
    assert terminate(proc) == 0
    assert time.monotonic() - t0 < s.consumer.stop_grace_s + 10
    small_redis.free()
    start_consumer(s)
    results = client.wait(ids, timeout=scaled(180))
    assert all(res.ok for res in results)
    assert small_redis.r.xlen(keys.dead_stream(s.queue.name)) == 0
