"""Start-up checks of the Redis server a consumer is about to trust with its work.

They run before the model is loaded (and, on global rank 0, before torch and megatron are even
imported), so a refusal costs seconds and prints one line; `python -m consumer` exits with
78 (EX_CONFIG), which supervisors treat as "do not restart".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
import structlog
from redis.cluster import ClusterNode, RedisCluster

if TYPE_CHECKING:
    from shared.settings import Settings

log = structlog.get_logger("teacherq.preflight")

# Every command teacherq sends (Redis 7.2 command set; Valkey 7.2+ has all of them), packed
# eight to a line (kept by fmt: skip).
REQUIRED_COMMANDS = (
    "xadd", "xreadgroup", "xack", "xautoclaim", "xclaim", "xpending", "xinfo", "xtrim",
    "xrange", "xrevrange", "xread", "xgroup", "xlen", "eval", "evalsha", "script", "hset",
    "hget", "hgetall", "expire", "incrby", "decrby", "set", "get", "del", "exists",
)  # fmt: skip


class UnsafeRedis(RuntimeError):
    """The server would lose acknowledged work or lacks a command; the message says what."""


def check_redis(client: redis.Redis, *, policy: str) -> dict[str, str]:
    """Check durability settings and commands; refuse (policy 'refuse') or warn ('warn').

    On a cluster every node is checked (a replica becomes a primary on failover). Where
    CONFIG GET is refused (managed Redis services often disable it) the durability settings
    cannot be read: that is logged as unchecked (`preflight.unchecked`), not refused — the
    service's own settings are then the operator's to verify. Returns what was found
    (server name/version, AOF, eviction policy) for the logs.
    """
    info = client.info("server")
    found = {
        "server": "valkey" if "valkey_version" in info else "redis",
        "version": str(info.get("valkey_version") or info.get("redis_version")),
    }
    problems: list[str] = []
    unchecked: list[str] = []
    for where, node in _nodes(client):
        try:
            aof = str(node.config_get("appendonly").get("appendonly", "?"))
            policy_found = str(node.config_get("maxmemory-policy").get("maxmemory-policy", "?"))
        except redis.ResponseError as exc:
            unchecked.append(
                f"{where}CONFIG GET refused ({exc}): cannot check appendonly (must be yes, "
                "appendfsync everysec) nor maxmemory-policy (must be noeviction)"
            )
            continue
        found["appendonly"], found["maxmemory-policy"] = aof, policy_found
        if aof != "yes":
            problems.append(
                f"{where}AOF is off (appendonly no): a Redis restart would lose acknowledged "
                "jobs; set appendonly yes, appendfsync everysec"
            )
        if policy_found != "noeviction":
            problems.append(
                f"{where}maxmemory-policy is {policy_found}: Redis may evict jobs or "
                "results under memory pressure; set maxmemory-policy noeviction"
            )
    known = {str(name).lower() for name in client.command()}
    missing = [c for c in REQUIRED_COMMANDS if c not in known]
    if missing:
        raise UnsafeRedis(
            f"{found['server']} {found['version']} lacks commands teacherq needs: {missing} "
            "(teacherq needs the Redis 7.2 command set)"
        )
    log.info("preflight.redis", **found)
    for note in unchecked:
        log.warning("preflight.unchecked", problem=note)
    for problem in problems:
        if policy == "refuse":
            raise UnsafeRedis(problem + " (or set TEACHERQ_CONSUMER__DURABLE_REDIS=warn)")
        log.warning("preflight.unsafe_redis", problem=problem)
    return found


def _nodes(client: redis.Redis) -> list[tuple[str, redis.Redis]]:
    """(label, client) of every server to check: each node of a cluster, else the one."""
    if not isinstance(client, RedisCluster):
        return [("", client)]
    out = []
    # CLUSTER NODES lists the replicas too (the client itself only tracks primaries).
    for addr, info in client.cluster_nodes().items():
        if "fail" in str(info.get("flags", "")) or not info.get("connected", True):
            continue
        host, port = addr.rsplit(":", 1)
        node = client.get_node(host, int(port)) or ClusterNode(host, int(port))
        out.append((f"node {addr}: ", client.get_redis_connection(node)))
    return out


def check_replicas(client: redis.Redis, settings: Settings) -> int | None:
    """With `redis.min_replicas_acked = N`: one warning when the queue's shard has fewer
    than N replicas now (no write can be acknowledged) or exactly N (none to spare: after
    a failover of its primary, writes wait or degrade until a replica is added). Returns
    the shard's replicas (None: not checked)."""
    from shared.replication import shard_replicas

    n = settings.redis.min_replicas_acked
    if n <= 0:
        return None
    try:
        have = shard_replicas(client, settings.queue.name)
    except redis.RedisError as exc:
        log.warning("preflight.replicas_unchecked", problem=f"INFO replication failed: {exc}")
        return None
    policy = settings.redis.replica_ack_policy
    if have < n:
        log.warning(
            "preflight.replicas_short",
            problem=f"queue {settings.queue.name}'s shard has {have} replicas in sync and "
            f"TEACHERQ_REDIS__MIN_REPLICAS_ACKED={n}: no result write can be acknowledged "
            f"until more join (replica_ack_policy={policy})",
        )
    elif have == n:
        log.warning(
            "preflight.replicas_no_spare",
            problem=f"queue {settings.queue.name}'s shard has {have} replicas and "
            f"TEACHERQ_REDIS__MIN_REPLICAS_ACKED={n}: none to spare, so after a failover "
            f"result writes {'wait' if policy == 'wait' else 'go unacknowledged'} until a "
            f"replica is added (run {n + 1} replicas per primary)",
        )
    return have


def preflight(client: redis.Redis, settings: Settings) -> str:
    """A consumer's start-up checks, run before the model loads: Redis durability and
    commands, then the jobs stream's group (an existing group is fine, also while Redis is
    full), the shard's replicas against `redis.min_replicas_acked` (a warning). Returns ""
    when the consumer may start, else the one-line reason it must not."""
    from shared.streams import Streams

    try:
        check_redis(client, policy=settings.consumer.durable_redis)
    except UnsafeRedis as exc:
        return str(exc)
    Streams(client, settings.queue.name, settings.queue.group).ensure_group()
    check_replicas(client, settings)  # a warning at most: replicas come and go
    return ""
