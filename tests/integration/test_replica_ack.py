"""A shard that loses its last replica (redis.min_replicas_acked=1): the waiting writes are
shown, and `redis.replica_ack_policy` decides what happens, on a real Valkey Cluster.

- one replica per primary, policy `wait`: after the queue's primary is killed -9 and its
  replica takes over, `status`, the queue metrics and `/get_loads`' source say writes wait
  (since when, results held); the consumer outlives its hang watchdog meanwhile, logs the
  wait once when it starts and once when it ends, and every job completes once the old
  primary is back as a replica;
- policy `degrade`: every job completes within the ack timeout plus a batch, its result
  marked `replicated=False`, counted; once a replica is back, writes are acknowledged again;
- two replicas per primary: the failover leaves one, every write is acknowledged.
Nothing is lost in any case. `ReplicaAcks` itself is checked first on a standalone server
whose replica comes and goes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from rich.console import Console

from producer import TeacherClient
from producer.status import render
from shared import keys
from shared.queue_metrics import queue_figures
from shared.replication import shard_replicas
from shared.settings import RedisSettings, Settings
from tests.helpers import (
    assert_exactly_once,
    cluster_settings,
    fast,
    job_set,
    queues_on_distinct_shards,
)
from tests.processes import Valkey, ValkeyCluster, stop_all
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.integration

ACK_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """Three primaries with one replica each."""
    c = ValkeyCluster(tmp_path_factory.mktemp("cluster1"))
    try:
        yield c
    finally:
        c.stop()


def _fail_over(cluster: ValkeyCluster, queue: str):
    """Kill the queue's primary with -9 and wait until another node serves its slot."""
    victim = cluster.primary_of(keys.jobs_stream(queue))
    victim.kill()
    wait_until(
        lambda: cluster.primary_of(keys.jobs_stream(queue)).port != victim.port,
        timeout=60,
        what="a replica taking over",
    )
    return victim


def _dir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def _events(proc) -> list[dict]:
    out = []
    for line in Path(proc.log_path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _settings(cluster: ValkeyCluster, queue: str, tmp_path: Path, **redis: object) -> Settings:
    return cluster_settings(
        cluster.url, queue, tmp_path, replica_ack_timeout_s=ACK_TIMEOUT_S, **redis
    )


def _producer(settings: Settings) -> TeacherClient:
    """A client submitting without replica acks: the test submits while the shard has none."""
    return TeacherClient(
        settings.model_copy(
            update={"redis": settings.redis.model_copy(update={"min_replicas_acked": 0})}
        )
    )


def test_replica_acks_wait_degrade_and_resume_on_a_standalone_server(tmp_path) -> None:
    """ReplicaAcks against a real primary whose one replica is stopped and started again:
    `wait` raises and holds the job (its state says since when, how many), the first
    acknowledged write ends the wait; `degrade` marks the stored record, counts it, and
    writes unacknowledged until the replica is back."""
    from consumer.serve.replica_ack import ReplicaAcks
    from shared.errors import NotReplicated
    from shared.results import decode_record

    primary = Valkey(_dir(tmp_path / "p"))
    replica = Valkey(_dir(tmp_path / "r"), "--replicaof", "127.0.0.1", str(primary.port))
    r = redis.Redis.from_url(primary.url)
    try:

        def online() -> bool:
            return shard_replicas(r, "q") == 1  # connected and in sync

        wait_until(online, timeout=30, what="replica in sync")
        cfg = RedisSettings(url=primary.url, min_replicas_acked=1, replica_ack_timeout_s=1.5)
        acks = ReplicaAcks(r, "q", cfg)
        assert acks.confirm("a") and acks.describe()["waiting_since"] is None
        replica.stop()
        wait_until(lambda: not online(), timeout=30, what="replica gone")
        with pytest.raises(NotReplicated, match="MIN_REPLICAS_ACKED=1"):
            acks.confirm("a")
        with pytest.raises(NotReplicated):
            acks.confirm("b")
        state = acks.describe()
        assert state["held"] == 2 and state["waiting_since"] <= time.time()
        acks.release("b", acknowledged=False)  # given up (a stop): held no longer, still waiting
        assert acks.describe()["held"] == 1 and acks.describe()["waiting_since"] is not None

        degrade = ReplicaAcks(r, "q", cfg.model_copy(update={"replica_ack_policy": "degrade"}))
        r.hset(keys.result_key("q", "c"), mapping={"meta": json.dumps({"job_id": "c"})})
        assert degrade.confirm("c") is False  # the record stands, marked
        assert decode_record(r.hgetall(keys.result_key("q", "c")), store=None).replicated is False
        assert degrade.unacknowledged() and degrade.describe()["unreplicated_writes"] == 1
        assert not r.exists(keys.result_key("q", "gone"))
        assert degrade.confirm("gone") is False
        assert not r.exists(keys.result_key("q", "gone"))  # an expired record stays expired

        replica = Valkey(_dir(tmp_path / "r2"), "--replicaof", "127.0.0.1", str(primary.port))
        wait_until(online, timeout=30, what="replica back")
        assert acks.confirm("a") and acks.describe()["waiting_since"] is None
        wait_until(lambda: not degrade.unacknowledged(), timeout=10, what="resumed")
        assert degrade.describe()["degraded_since"] is None
    finally:
        replica.stop()
        primary.stop()


def test_wait_shows_the_waiting_writes_and_completes_once_a_replica_is_back(
    cluster, start_consumer, tmp_path
) -> None:
    """Policy `wait`, one replica per primary: the queue's primary killed -9; writes of jobs
    submitted after the failover wait; status and the queue metrics say so within seconds;
    the consumer is not taken for hung (its job_timeout_s is short, the wait longer); the old
    primary restarted as a replica lets every job complete, each exactly once."""
    [q] = queues_on_distinct_shards(1, "wait")
    s = _settings(cluster, q, tmp_path)
    # The loop blocks on the writers early (two unfinished writes), and its watchdog is short.
    s = fast(s, visibility_timeout_s=5.0, max_queued_writes=2, job_timeout_s=3.0)
    proc = start_consumer(s)
    client = _producer(s)
    ids = client.submit(job_set(4, seed=21))
    client.wait(ids, timeout=scaled(120))
    victim = _fail_over(cluster, q)
    ids += client.submit(job_set(8, seed=22))

    def waiting() -> dict | None:
        rep = client.status()["replication"]
        return rep if rep["waiting_since"] is not None and rep["held_results"] else None

    rep = wait_until(waiting, timeout=60, what="status showing the wait")
    assert rep["replicas"] == 0 and rep["min_replicas_acked"] == 1 and rep["policy"] == ["wait"]
    console = Console(record=True, width=200)
    console.print(render(client.status()))
    assert "0 replicas in sync, writes need 1: WAITING for replica acks" in console.export_text()
    # Longer than the watchdog's job_timeout_s, still waiting and alive.
    wait_until(
        lambda: client.status()["replication"]["waiting_s"] > 2 * 3.0,
        timeout=60,
        what="a wait past job_timeout_s",
    )
    assert proc.poll() is None, "the consumer exited while its writes waited"
    figures = queue_figures(client.r, q, s.queue.group, live_after_s=15)
    assert figures["shard_replicas"] == 0 and figures["replica_ack_waiting_seconds"] > 0
    assert figures["replica_ack_held_results"] >= 1

    victim.restart()  # rejoins as a replica of the promoted node
    cluster.wait_ok()
    results = client.wait(ids, timeout=scaled(180))
    assert_exactly_once(client, ids)
    assert all(res.replicated for res in results)
    # Results are readable once stored; the consumer confirms their replication just after.
    rep = wait_until(
        lambda: (r := client.status()["replication"])["waiting_since"] is None and r,
        timeout=30,
        what="the wait over in status",
    )
    assert rep["replicas"] >= 1 and rep["held_results"] == 0
    events = [e["event"] for e in _events(proc)]
    assert events.count("store.replica_wait") == 1, events
    assert events.count("store.replica_wait_over") == 1
    assert "store.retry" not in events and "consumer.hung" not in events


@pytest.mark.slow
def test_degrade_completes_every_job_marked_and_resumes_acknowledged_writes(
    cluster, start_consumer, tmp_path
) -> None:
    """Policy `degrade`: after the failover every job completes within the ack timeout plus
    a batch, marked unreplicated and counted; with the old primary back as a replica, new
    jobs are stored with acknowledged writes again."""
    [q] = queues_on_distinct_shards(1, "degrade")
    s = _settings(cluster, q, tmp_path, replica_ack_policy="degrade")
    proc = start_consumer(s)
    client = _producer(s)
    first = client.submit(job_set(4, seed=31))
    client.wait(first, timeout=scaled(120))
    victim = _fail_over(cluster, q)
    t0 = time.monotonic()
    ids = client.submit(job_set(8, seed=32))
    client.wait(ids, timeout=scaled(ACK_TIMEOUT_S + 30))
    assert time.monotonic() - t0 < scaled(ACK_TIMEOUT_S + 30)
    # A record stored while its WAIT still ran is marked when the WAIT gives up, just after.
    rep = wait_until(
        lambda: (r := client.status()["replication"])["unreplicated_writes"] >= 8 and r,
        timeout=30,
        what="8 unreplicated writes counted",
    )
    assert not any(res.replicated for res in client.results(ids))
    assert rep["degraded_since"] is not None
    assert rep["waiting_since"] is None
    assert queue_figures(client.r, q, s.queue.group, live_after_s=15)["unreplicated_writes"] >= 8

    victim.restart()
    cluster.wait_ok()
    cluster.wait_replicas(1)
    later = client.submit(job_set(4, seed=33))
    assert all(res.replicated for res in client.wait(later, timeout=scaled(120)))
    assert_exactly_once(client, first + ids + later)
    events = [e["event"] for e in _events(proc)]
    assert events.count("store.replica_ack_degraded") == 1
    assert events.count("store.unreplicated") >= 8
    assert events.count("store.replica_ack_resumed") == 1


@pytest.mark.slow
def test_two_replicas_per_primary_ride_out_a_failover_with_acknowledged_writes(
    start_consumer, tmp_path
) -> None:
    """Two replicas per primary: the promoted replica keeps one, so no write waits and every
    result is acknowledged by a replica; the consumer's start-up check did not warn."""
    c = ValkeyCluster(tmp_path / "cluster2", replicas=2)
    procs = []
    try:
        [q] = queues_on_distinct_shards(1, "two")
        s = _settings(c, q, tmp_path)
        proc = start_consumer(s)
        procs.append(proc)
        client = _producer(s)
        ids = client.submit(job_set(6, seed=41))
        client.wait(ids, timeout=scaled(120))
        _fail_over(c, q)
        wait_until(
            lambda: c.replicas_of(c.primary_of(keys.jobs_stream(q))) >= 1,
            timeout=60,
            what="the remaining replica following the promoted primary",
        )
        ids += client.submit(job_set(8, seed=42))
        results = client.wait(ids, timeout=scaled(120))
        assert all(res.replicated for res in results)
        assert_exactly_once(client, ids)
        rep = client.status()["replication"]
        assert rep["unreplicated_writes"] == 0 and rep["replicas"] >= 1
        events = [e["event"] for e in _events(proc)]
        assert "store.replica_wait" not in events
        assert not {"preflight.replicas_short", "preflight.replicas_no_spare"} & set(events)
    finally:
        stop_all(procs)  # before its Redis: a consumer left without one drains for its grace
        c.stop()


def test_start_up_check_warns_when_the_shard_has_no_replica_to_spare(tmp_path) -> None:
    """One line when min_replicas_acked equals the shard's replicas (none to spare for a
    failover) and when it exceeds them (no write can be acknowledged); none at 0."""
    from structlog.testing import capture_logs

    from consumer.serve.preflight import check_replicas

    primary = Valkey(_dir(tmp_path / "p"))
    replica = Valkey(_dir(tmp_path / "r"), "--replicaof", "127.0.0.1", str(primary.port))
    try:
        r = redis.Redis.from_url(primary.url)
        wait_until(
            lambda: shard_replicas(r, "w") == 1,
            timeout=30,
            what="replica in sync",
        )

        def warnings(n: int) -> list[dict]:
            s = Settings(redis={"url": primary.url, "min_replicas_acked": n}, queue={"name": "w"})
            with capture_logs() as logs:
                check_replicas(r, s)
            return [e for e in logs if e["log_level"] == "warning"]

        assert warnings(0) == []
        [spare] = warnings(1)
        assert spare["event"] == "preflight.replicas_no_spare"
        assert "run 2 replicas" in spare["problem"]
        [short] = warnings(2)
        assert short["event"] == "preflight.replicas_short"
        assert "MIN_REPLICAS_ACKED=2" in short["problem"] and "1 replicas" in short["problem"]
    finally:
        replica.stop()
        primary.stop()
