"""teacherq past one Redis: a real Valkey Cluster (three primaries, a replica each, formed by
hand from the valkey-server the other tests run) and a real Sentinel-watched pair.

What is proven: queues spread over shards each keep every key (and so every script and
transaction) on their own shard; a consumer per queue serves it; a primary killed with -9
mid-run is replaced by its replica (automatic failover) and, with
`redis.min_replicas_acked=1`, every job is still done exactly once and none is lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from producer import TeacherClient
from shared import keys
from shared.queue_metrics import queue_figures
from shared.redis_client import await_replicas, connect, connect_async
from shared.settings import Settings
from tests.helpers import (
    assert_exactly_once,
    cluster_settings,
    fast,
    job_set,
    queues_on_distinct_shards,
)
from tests.processes import Valkey, ValkeyCluster, ValkeySentinel, stop_all
from tests.timing import scaled

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """Three primaries with one replica each; a killed primary's replica takes over in ~2 s."""
    c = ValkeyCluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield c
    finally:
        c.stop()


def test_queue_keys_scripts_and_transactions_stay_on_one_shard(cluster, tmp_path) -> None:
    """Each queue's keys live on the primary of its hash tag; submit (a transaction of Lua
    scripts) and cancel work through a cluster client, and the three queues are on three
    different primaries."""
    names = queues_on_distinct_shards(3, "shard")
    primaries = {cluster.primary_of(keys.jobs_stream(q)).port for q in names}
    assert len(primaries) == 3
    for q in names:
        client = TeacherClient(cluster_settings(cluster.url, q, tmp_path))
        ids = client.submit(job_set(4, seed=1))
        assert client.submit(job_set(4, seed=1)) == ids  # idempotent: nothing added
        node = redis.Redis(port=cluster.primary_of(keys.jobs_stream(q)).port)
        assert node.xlen(keys.jobs_stream(q)) == 4  # on the primary of its slot
        client.cancel(ids[0])
        assert node.hget(keys.result_key(q, ids[0]), "status") is not None
        # The exporter's figures, read through the cluster client from the queue's shard.
        figures = queue_figures(client.r, q, client.settings.queue.group, live_after_s=15)
        assert (figures["lag"], figures["in_flight"]) == (4, 0)
        assert figures["pending_tokens"] == sum(r.num_tokens for r in job_set(4, seed=1))


def test_min_replicas_acked_refuses_when_no_replica_holds_the_write(tmp_path) -> None:
    """WAIT is real: a standalone server without replicas cannot acknowledge a submit that
    asks for one replica; the error names the setting."""

    server = Valkey(tmp_path)
    try:
        s = Settings(
            redis={"url": server.url, "min_replicas_acked": 1, "replica_ack_timeout_s": 0.3},
            queue={"name": "lonely"},
        )
        with pytest.raises(Exception, match="MIN_REPLICAS_ACKED=1"):
            TeacherClient(s).submit(job_set(1))
    finally:
        server.stop()


def _wait_some_done(client: TeacherClient, at_least: int, timeout: float = scaled(120)) -> None:
    deadline = time.monotonic() + timeout
    while client.r.xlen(keys.done_stream(client.queue)) < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} jobs done"
        time.sleep(0.1)


def _until(check, timeout: float = scaled(60)) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "no failover"
        time.sleep(0.2)


def test_primary_killed_mid_run_loses_nothing(cluster, start_consumer, tmp_path) -> None:
    """Two queues on two shards, a consumer each; the primary of the first is killed -9
    while jobs are being done and submitted; its replica takes over; every job of both
    queues is done exactly once."""
    names = queues_on_distinct_shards(2, "kill")
    settings = [cluster_settings(cluster.url, q, tmp_path / q) for q in names]
    clients = [TeacherClient(s) for s in settings]
    for s in settings:
        start_consumer(s)
    first = [c.submit(job_set(10, seed=2)) for c in clients]
    _wait_some_done(clients[0], 2)
    victim = cluster.primary_of(keys.jobs_stream(names[0]))
    # Submitting goes on across the failover: redis-py retries while no primary serves the
    # slot, and WAIT holds the submit until the replaced primary is back as a replica.
    late: list[list[str]] = []
    failed: list[BaseException] = []

    def submit_late() -> None:
        try:
            late.append(clients[0].submit(job_set(6, 3)))
        except Exception as exc:  # noqa: BLE001 - reported by the assert below, with its type
            failed.append(exc)

    submitter = threading.Thread(target=submit_late)
    victim.kill()
    submitter.start()
    _until(lambda: cluster.primary_of(keys.jobs_stream(names[0])).port != victim.port)
    victim.restart()  # rejoins as a replica of the promoted one: writes can be acked again
    cluster.wait_ok()
    submitter.join(timeout=scaled(120))
    assert not failed, f"a submit across the failover raised {failed[0]!r}"
    assert late, "a submit across the failover did not return"
    for client, ids in zip(clients, [first[0] + late[0], first[1]], strict=True):
        client.wait(ids, timeout=scaled(180))
        assert_exactly_once(client, ids)


def _replica_of(cluster: ValkeyCluster, primary: Valkey) -> Valkey:
    for node in cluster.nodes:
        info = cluster.client(node).info("replication")
        if info["role"] == "slave" and int(info["master_port"]) == primary.port:
            return node
    raise LookupError(f"no replica of {primary.port}")


def test_replica_wait_follows_a_primary_that_changed_under_a_cached_slot_map(
    cluster, tmp_path
) -> None:
    """The replica wait (`await_replicas`: a mark and WAIT sent straight to the queue's
    primary) from a client whose slot map predates a failover: the old primary, back as a
    replica, answers the mark with MOVED. The wait reads the slot map again and reaches the new
    primary. (It raised MovedError: a consumer stopped with its result unstored and a submit
    across a failover failed.) The failover is a real one (CLUSTER FAILOVER on the replica)."""
    [q] = queues_on_distinct_shards(1, "moved")
    s = cluster_settings(cluster.url, q, tmp_path)
    r = connect(s.redis)
    await_replicas(r, q, s.redis)  # the client now holds the slot map, and a connection
    old = cluster.primary_of(keys.jobs_stream(q))
    new = _replica_of(cluster, old)
    cluster.client(new).execute_command("CLUSTER FAILOVER")
    _until(lambda: cluster.primary_of(keys.jobs_stream(q)).port == new.port)
    cluster.wait_replicas(1)  # the old primary is a replica in sync with the new one
    await_replicas(r, q, s.redis)
    # The mark the wait wrote is on the new primary: the call reached it.
    mark = redis.Redis(port=new.port).get(keys.replication_mark_key(q))
    assert mark is not None and float(mark) > time.time() - scaled(60)
    # A submit from a client that also predates the failover goes through.
    client = TeacherClient(s)
    assert len(client.submit(job_set(2, seed=7))) == 2


@pytest.mark.slow
def test_two_primaries_killed_in_turn_three_queues_lose_nothing(
    cluster, start_consumer, tmp_path
) -> None:
    """Three queues on the three shards, a consumer each, jobs submitted throughout; the
    primary of the first queue is killed -9, then (after it is back as a replica) the primary
    of the second: every job of every queue is done exactly once."""
    names = queues_on_distinct_shards(3, "long")
    settings = [cluster_settings(cluster.url, q, tmp_path / q) for q in names]
    clients = [TeacherClient(s) for s in settings]
    for s in settings:
        start_consumer(s)
    ids = [c.submit(job_set(20, seed=10 + i)) for i, c in enumerate(clients)]
    for round_, q in enumerate(names[:2]):
        _wait_some_done(clients[round_], 3)
        victim = cluster.primary_of(keys.jobs_stream(q))
        victim.kill()
        _until(lambda q=q, v=victim: cluster.primary_of(keys.jobs_stream(q)).port != v.port)
        victim.restart()
        cluster.wait_ok()
        for i, c in enumerate(clients):
            ids[i] += c.submit(job_set(5, seed=100 + 10 * round_ + i))
    for client, queue_ids in zip(clients, ids, strict=True):
        client.wait(queue_ids, timeout=scaled(300))
        assert_exactly_once(client, queue_ids)


def test_connect_cluster_client_reaches_every_shard(cluster) -> None:
    """`connect` in cluster mode: one client, keys of every shard."""
    s = Settings(redis={"url": cluster.url, "mode": "cluster"})
    r = connect(s.redis)
    for q in queues_on_distinct_shards(3, "any"):
        r.set(keys.pending_tokens_key(q), 1)
        assert r.get(keys.pending_tokens_key(q)) == b"1"


def test_connect_async_cluster_client_reaches_every_shard(cluster) -> None:
    """`connect_async` in cluster mode: one asyncio client, keys of every shard."""

    async def roundtrip() -> list[bytes | None]:
        r = connect_async(Settings(redis={"url": cluster.url, "mode": "cluster"}).redis)
        got = []
        for q in queues_on_distinct_shards(3, "async"):
            await r.set(keys.pending_tokens_key(q), 2)
            got.append(await r.get(keys.pending_tokens_key(q)))
        await r.aclose()
        return got

    assert asyncio.run(roundtrip()) == [b"2"] * 3


def test_asyncio_client_submits_cancels_and_reads_memory_on_a_cluster(cluster, tmp_path) -> None:
    """AsyncTeacherClient on a cluster: submit (a transaction of Lua scripts, sent by EVAL in
    a cluster pipeline) with min_replicas_acked=1, the memory check on the queue's shard, an
    unknown id refused, a cancel recorded, on queues of different primaries."""
    from producer import AsyncTeacherClient, TeacherRequest
    from shared.errors import UnknownJob

    async def run(q: str) -> list:
        s = cluster_settings(cluster.url, q, tmp_path, min_replicas_acked=1)
        async with AsyncTeacherClient(s, trace_process=None) as client:
            ids = await client.submit(
                [TeacherRequest(input_ids=[1, 2, 3]), TeacherRequest(input_ids=[4, 5, 6, 7])]
            )
            assert await client._memory_full() is None
            with pytest.raises(UnknownJob):
                await client.cancel("j-doesnotexist")
            await client.cancel(ids[0])
            [cancelled] = await client.results(ids[:1])
            return [cancelled.error, await client.r.xlen(keys.jobs_stream(q))]

    for q in queues_on_distinct_shards(2, "aio"):
        error, queued = asyncio.run(run(q))
        assert error == "cancelled by the user" and queued == 2


def test_sentinel_failover_loses_nothing(tmp_path, start_consumer) -> None:
    """A primary and a replica watched by three sentinels; the client and the consumer find
    the primary through a sentinel URL; the primary is killed -9 mid-run; the sentinels
    promote the replica; every job is done exactly once."""
    pair = ValkeySentinel(tmp_path / "sentinel")
    procs = []
    try:
        s = Settings(
            redis={
                "url": pair.url,
                "mode": "sentinel",
                "sentinel_master": pair.service,
                "min_replicas_acked": 1,
            },
            queue={"name": "sq"},
            storage={"url": f"file://{tmp_path / 'objects'}"},
            consumer={"block_ms": 200},
            log={"format": "json"},
        )
        s = fast(s, visibility_timeout_s=5.0, job_timeout_s=30.0)
        client = TeacherClient(s)

        async def async_write() -> bytes | None:  # connect_async finds the primary too
            r = connect_async(s.redis)
            await r.set("probe", "1")
            got = await r.get("probe")
            await r.aclose()
            return got

        assert asyncio.run(async_write()) == b"1"
        procs.append(start_consumer(s))
        ids = client.submit(job_set(10, seed=4))
        _wait_some_done(client, 2)
        old = pair.master_port()
        pair.primary.kill()
        _until(lambda: pair.master_port() != old)
        pair.primary.restart()  # the sentinels turn it into a replica of the promoted one
        pair.wait_replicated()  # until then no write can reach min_replicas_acked=1
        ids += client.submit(job_set(6, seed=5))  # lands on the promoted replica
        client.wait(ids, timeout=scaled(180))
        assert_exactly_once(client, ids)
    finally:
        stop_all(procs)  # before its Redis: a consumer left without one drains for its grace
        pair.stop()


def test_preflight_where_config_is_refused_starts_and_says_what_is_unchecked(tmp_path) -> None:
    """A managed-style server that refuses CONFIG: the check does not refuse (policy
    'refuse'), reports both durability settings as unchecked, and still checks commands."""
    from structlog.testing import capture_logs

    from consumer.serve.preflight import check_redis

    server = Valkey(tmp_path, "--rename-command", "CONFIG", "")
    try:
        with capture_logs() as logs:
            found = check_redis(redis.Redis.from_url(server.url), policy="refuse")
        assert "appendonly" not in found
        notes = [e["problem"] for e in logs if e["event"] == "preflight.unchecked"]
        assert len(notes) == 1
        assert "appendonly" in notes[0] and "maxmemory-policy" in notes[0]
    finally:
        server.stop()


def test_preflight_checks_every_cluster_node(cluster) -> None:
    """On a cluster every node's durability settings are read (all AOF, noeviction here)."""
    from structlog.testing import capture_logs

    from consumer.serve.preflight import UnsafeRedis, check_redis

    r = connect(Settings(redis={"url": cluster.url, "mode": "cluster"}).redis)
    with capture_logs() as logs:
        found = check_redis(r, policy="refuse")
    assert found["appendonly"] == "yes"
    assert not [e for e in logs if e["event"] == "preflight.unchecked"]
    replica = cluster.client(cluster.nodes[-1])  # not the node the URL names
    replica.config_set("appendonly", "no")
    try:
        with pytest.raises(UnsafeRedis, match=f"{cluster.nodes[-1].port}: AOF is off"):
            check_redis(r, policy="refuse")
    finally:
        replica.config_set("appendonly", "yes")


def test_memory_is_read_on_the_queues_shard(cluster) -> None:
    """Backpressure and `status` read INFO memory of the primary holding the queue: three
    shards with three maxmemory values, each queue sees its own."""
    from shared.memory import read_memory

    r = connect(Settings(redis={"url": cluster.url, "mode": "cluster"}).redis)
    names = queues_on_distinct_shards(3, "mem")
    primaries = [cluster.client(cluster.primary_of(keys.jobs_stream(q))) for q in names]
    try:
        for i, p in enumerate(primaries):
            p.config_set("maxmemory", f"{i + 1}gb")
        limits = [read_memory(r, key=keys.jobs_stream(q)).limit for q in names]
        assert limits == [2**30, 2 * 2**30, 3 * 2**30]
    finally:
        for p in primaries:
            p.config_set("maxmemory", "0")
