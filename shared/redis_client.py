"""Redis clients: how every teacherq process turns `RedisSettings` into a connection.

`connection_plan(cfg)` holds the mode rules (standalone, cluster, sentinel) independent of sync
or asyncio; `connect(cfg)` builds the sync client from it (`PatientCluster` for a cluster: it
resends commands with backoff across a failover) and `connect_async(cfg)` the asyncio one;
`run_script` queues a Lua script on any client or pipeline (`EVAL` in a cluster pipeline; a
NOSCRIPT reply is met by calling again), and
`await_replicas` is the one `WAIT` (`redis.min_replicas_acked`). With no URL set, clients reach
the embedded server (`shared.redis_server`) and look up its port again on every reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import redis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import Script
from redis.exceptions import ClusterDownError
from redis.retry import Retry
from redis.sentinel import Sentinel

from shared import keys
from shared.errors import NotReplicated
from shared.memory import MemoryInfo, memory_from_info
from shared.redis_server import ensure_embedded, recorded_url
from shared.settings import RedisSettings


class EmbeddedConnection(redis.Connection):
    """A connection to the embedded server that looks up its port in `server.json` each time
    it (re)connects: a restarted server on another port is found again."""

    def __init__(self, *, home: Path, **kwargs: object) -> None:
        self.home = home
        super().__init__(**kwargs)

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self._sock:
            url = recorded_url(self.home)
            if url:
                self.port = int(url.rsplit(":", 1)[1].split("/")[0])
        super().connect_check_health(check_health, retry_socket_connect)


@dataclass(frozen=True)
class ConnectionPlan:
    """How to reach the configured Redis, independent of sync or asyncio: `connect` and
    `connect_async` both build their client from one plan, so the mode rules live here once.

    mode `standalone`: `url` as given (or the embedded server's); `cluster`: `url` names any
    node, redis-py discovers the others and routes each key to its shard; `sentinel`:
    `sentinels` are (host, port) of the sentinels named in the URL (comma-separated hosts are
    allowed), `service` the monitored master, `master_options` the database and password the
    URL gives for the master."""

    mode: str
    url: str
    options: dict[str, Any]  # client options every mode shares
    retries: int
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    master_options: dict[str, Any] = field(default_factory=dict)
    home: Path | None = None  # the embedded server's home (standalone, no URL)


def connection_plan(cfg: RedisSettings) -> ConnectionPlan:
    """The connection plan for `cfg` (starts the embedded server when no URL is set)."""
    options: dict[str, Any] = {
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": 5.0,
        "health_check_interval": 30,
        "client_name": f"teacherq-{os.getpid()}",
    }
    if cfg.url is None:
        home = Path(cfg.home)
        url, _ = ensure_embedded(home)
        return ConnectionPlan("standalone", url, options, retries=5, home=home)
    # A failover (cluster or sentinel) takes a few seconds: retry longer than a restart needs.
    retries = 5 if cfg.mode == "standalone" else 12
    if cfg.mode != "sentinel":
        return ConnectionPlan(cfg.mode, cfg.url, options, retries=retries)
    parts = urlsplit(cfg.url)
    sentinels = []
    for hostport in parts.netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = hostport.rpartition(":")
        sentinels.append((host or hostport, int(port) if host else 26379))
    master: dict[str, Any] = {"db": int(parts.path.strip("/") or 0)}
    if parts.password:
        master["password"] = unquote(parts.password)
        if parts.username:
            master["username"] = unquote(parts.username)
    if parts.scheme == "rediss":
        master["ssl"] = True
    return ConnectionPlan(
        "sentinel",
        cfg.url,
        options,
        retries=retries,
        sentinels=tuple(sentinels),
        service=cfg.sentinel_master,
        master_options=master,
    )


# How long a client keeps resending a command while a shard has no reachable primary: a
# cluster failover takes about twice cluster-node-timeout (15 s by default) plus an election.
FAILOVER_PATIENCE = Retry(
    ExponentialBackoff(cap=2.0, base=0.1),
    retries=25,
    supported_errors=(redis.ConnectionError, redis.TimeoutError, ClusterDownError),
)

# What a command sent straight to one cluster node (past RedisCluster's own redirect handling)
# meets while a failover settles: the node is gone, the shard has no primary yet, or the node
# is back as a replica of the promoted one and answers MOVED (AskError is MOVED's base class;
# TRYAGAIN comes during a slot migration). Each means: read the slot map again and resend.
NODE_FAILOVER_PATIENCE = Retry(
    ExponentialBackoff(cap=2.0, base=0.1),
    retries=FAILOVER_PATIENCE.get_retries(),
    supported_errors=(
        redis.ConnectionError,
        redis.TimeoutError,
        ClusterDownError,
        redis.exceptions.AskError,
        redis.exceptions.TryAgainError,
    ),
)


class PatientCluster(RedisCluster):
    """A cluster client that rides out a failover. redis-py's RedisCluster resends a command
    that met a dead node at once (with a fresh slot map), so all its attempts are spent in
    the milliseconds before the replica is promoted; this one resends with backoff for up to
    ~45 s (FAILOVER_PATIENCE). Every teacherq command is idempotent, so a resend is safe.
    Transactions (single-slot MULTI/EXEC pipelines) back off inside redis-py already."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return FAILOVER_PATIENCE.call_with_retry(
            lambda: super(PatientCluster, self).execute_command(*args, **kwargs),
            lambda _error: None,
        )


def connect(cfg: RedisSettings) -> redis.Redis:
    """A client for the configured Redis (`redis.mode`): the URL if set, else the embedded
    server. A cluster client has the same command methods as `redis.Redis` and is typed as
    one; each queue's keys share one slot, so every script and pipeline teacherq sends runs
    on one shard."""
    plan = connection_plan(cfg)
    # Brief outages (a restart, a failover) are retried with backoff inside the client; every
    # teacherq write is idempotent, so a resent command is harmless.
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=plan.retries)
    errors = [redis.ConnectionError, redis.TimeoutError]
    if plan.mode == "cluster":
        cluster = PatientCluster.from_url(plan.url, retry=retry, **plan.options)
        return cast(redis.Redis, cluster)  # same command surface (see the docstring)
    if plan.mode == "sentinel":
        sentinel = Sentinel(list(plan.sentinels), **plan.options)
        return sentinel.master_for(
            plan.service,
            retry=retry,
            retry_on_error=errors,
            **plan.options,
            **plan.master_options,
        )
    extra: dict[str, object] = {}
    if plan.home is not None:
        extra = {"connection_class": EmbeddedConnection, "home": plan.home}
    return redis.Redis.from_url(
        plan.url, retry=retry, retry_on_error=errors, **plan.options, **extra
    )


# Calls a script gets while the server answers NOSCRIPT (the last error is raised), and the
# pause before the second (doubled each time: 0.35 s in all).
_SCRIPT_ATTEMPTS = 4
_SCRIPT_RETRY_S = 0.05


def run_script(
    script: Script, *, keys: Sequence[Any], args: Sequence[Any], client: Any = None
) -> Any:
    """Run a registered Lua script on `client` (its own client if None) or queue it on a
    pipeline. A cluster pipeline refuses EVALSHA (it could not load a missing script on the
    right shard mid-pipeline), so there the script's text is sent with EVAL; elsewhere redis-py
    sends EVALSHA and loads the script once where needed.

    NOSCRIPT can outlive redis-py's one reload: during a failover its SCRIPT LOAD and the
    EVALSHA after it may reach different servers. A script that got NOSCRIPT did not run, so
    the call is made again, after a short pause, up to `_SCRIPT_ATTEMPTS` times. (A queued
    pipeline call raises nothing here: `execute_scripted` covers those.)"""
    if isinstance(client, ClusterPipeline):
        return client.execute_command("EVAL", script.script, len(keys), *keys, *args)
    pause = _SCRIPT_RETRY_S
    for attempt in range(1, _SCRIPT_ATTEMPTS + 1):
        try:
            return script(keys=keys, args=args, client=client)
        except redis.exceptions.NoScriptError:
            if attempt == _SCRIPT_ATTEMPTS:
                raise
        time.sleep(pause)
        pause *= 2
    raise AssertionError("unreachable")


async def run_script_async(
    script: Any, *, keys: Sequence[Any], args: Sequence[Any], client: Any = None
) -> Any:
    """`run_script` for redis.asyncio (an AsyncScript; a client or a pipeline)."""
    if isinstance(client, AsyncClusterPipeline):
        return client.execute_command("EVAL", script.script, len(keys), *keys, *args)
    pause = _SCRIPT_RETRY_S
    for attempt in range(1, _SCRIPT_ATTEMPTS + 1):
        try:
            return await script(keys=keys, args=args, client=client)
        except redis.exceptions.NoScriptError:
            if attempt == _SCRIPT_ATTEMPTS:
                raise
        await asyncio.sleep(pause)
        pause *= 2
    raise AssertionError("unreachable")


def execute_scripted(client: redis.Redis, fill: Callable[[Any], None]) -> list[Any]:
    """Run a transaction of scripts that `fill` queues on a fresh pipeline; once more if Redis
    answered NOSCRIPT. redis-py checks and loads a pipeline's scripts just before sending it,
    so NOSCRIPT means the server lost its script cache in between (restarted, e.g. from its
    AOF): filling a new pipeline loads them again. Every scripted write teacherq makes is
    idempotent, so a transaction that ran in part is safe to run whole."""
    for attempt in range(2):
        pipe = client.pipeline(transaction=True)
        fill(pipe)
        try:
            return cast(list[Any], pipe.execute())
        except redis.exceptions.NoScriptError:
            if attempt:
                raise
    raise AssertionError("unreachable")


async def execute_scripted_async(
    client: AsyncRedis, fill: Callable[[Any], Awaitable[None]]
) -> list[Any]:
    """`execute_scripted` for redis.asyncio."""
    for attempt in range(2):
        async with client.pipeline(transaction=True) as pipe:
            await fill(pipe)
            try:
                return cast(list[Any], await pipe.execute())
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
    raise AssertionError("unreachable")


async def read_memory_async(client: AsyncRedis, key: str) -> MemoryInfo:
    """`read_memory` for redis.asyncio: INFO memory of the primary holding `key` on a
    cluster (the queue's shard), of the server otherwise."""
    if isinstance(client, AsyncRedisCluster):
        node = client.get_node_from_key(key)
        return memory_from_info(await client.info("memory", target_nodes=node))
    return memory_from_info(await client.info("memory"))


# Sets the queue's replication mark; flagged allow-oom so a consumer can confirm its
# acknowledgements while Redis is full (the value replaces one of the same size).
_MARK = "#!lua flags=allow-oom\nredis.call('SET', KEYS[1], ARGV[1])\nreturn 1\n"


def await_replicas(client: redis.Redis, queue: str, cfg: RedisSettings) -> None:
    """Block until `cfg.min_replicas_acked` replicas hold every write made so far to the
    queue's shard (no-op at 0); raise `NotReplicated` after `cfg.replica_ack_timeout_s`.

    WAIT counts the writes of the connection it is sent on, and a pooled client may have sent
    the caller's write on another one: so a fresh write (the queue's replication mark) and the
    WAIT go out together on one connection of the shard's primary. Replication is one ordered
    stream, so replicas that hold the mark hold every earlier write too."""
    n = cfg.min_replicas_acked
    if n <= 0:
        return
    mark = keys.replication_mark_key(queue)

    def mark_and_wait() -> int:
        node: Any = client
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(mark).redis_connection
        pipe = node.pipeline(transaction=False)
        pipe.eval(_MARK, 1, mark, str(time.time()))
        pipe.execute_command("WAIT", n, int(cfg.replica_ack_timeout_s * 1000))
        return int(pipe.execute()[1])

    def refresh(_error: Exception) -> None:
        if isinstance(client, RedisCluster):  # the shard's primary may have changed
            with contextlib.suppress(redis.RedisError):
                client.nodes_manager.initialize()

    acked = NODE_FAILOVER_PATIENCE.call_with_retry(mark_and_wait, refresh)
    if acked < n:
        raise NotReplicated(
            f"queue {queue}: a write reached {acked} of TEACHERQ_REDIS__MIN_REPLICAS_ACKED={n} "
            f"replicas within {cfg.replica_ack_timeout_s:g}s (replicas down or lagging?)"
        )


class PatientAsyncCluster(AsyncRedisCluster):
    """`PatientCluster` for redis.asyncio: resends a command with backoff across a failover."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        patience = AsyncRetry(
            ExponentialBackoff(cap=2.0, base=0.1),
            retries=FAILOVER_PATIENCE.get_retries(),
            supported_errors=(redis.ConnectionError, redis.TimeoutError, ClusterDownError),
        )

        async def fail(_error: Exception) -> None:
            return None

        return await patience.call_with_retry(
            lambda: super(PatientAsyncCluster, self).execute_command(*args, **kwargs), fail
        )


def connect_async(cfg: RedisSettings, *, max_connections: int = 64) -> AsyncRedis:
    """`connect` for redis.asyncio: the same plan (mode, URL, options), asyncio classes.

    On a standalone server the pool blocks (never fails) past `max_connections`, so thousands
    of concurrent tasks share a bounded number of connections, and the client owns its pool
    (closing the client closes it). Starting the embedded server, when no URL is set, blocks:
    call this outside the event loop (or in `asyncio.to_thread`)."""
    plan = connection_plan(cfg)
    retry = AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=plan.retries)
    errors = [redis.ConnectionError, redis.TimeoutError]
    if plan.mode == "cluster":
        cluster = PatientAsyncCluster.from_url(plan.url, retry=retry, **plan.options)
        return cast(AsyncRedis, cluster)  # same command surface, as in `connect`
    if plan.mode == "sentinel":
        sentinel = AsyncSentinel(list(plan.sentinels), **plan.options)
        return sentinel.master_for(
            plan.service,
            retry=retry,
            retry_on_error=errors,
            **plan.options,
            **plan.master_options,
        )
    # The embedded server's port is re-read on reconnect only by the sync client
    # (EmbeddedConnection); an asyncio client keeps the port it started with.
    pool = BlockingConnectionPool.from_url(
        plan.url,
        max_connections=max_connections,
        timeout=None,
        retry=retry,
        retry_on_error=errors,
        **plan.options,
    )
    return AsyncRedis.from_pool(pool)
