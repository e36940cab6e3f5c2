"""Start-up checks of the Redis server a consumer is about to trust with its work.

They run before the model is loaded (and, on global rank 0, before torch and megatron are even
imported), so a refusal costs seconds and prints one line; `python -m consumer` exits with
78 (EX_CONFIG), which supervisors treat as "do not restart".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
import structlog

if TYPE_CHECKING:
    from shared.settings import Settings

log = structlog.get_logger("teacherq.preflight")

# Every command teacherq sends (Redis 7.2 command set; Valkey 7.2+ has all of them).
REQUIRED_COMMANDS = (
    "xadd", "xreadgroup", "xack", "xautoclaim", "xclaim", "xpending", "xinfo", "xtrim",
    "xrange", "xrevrange", "xread", "xgroup", "xlen", "eval", "evalsha", "script", "hset",
    "hget", "hgetall", "expire", "incrby", "decrby", "set", "get", "del", "exists",
)  # fmt: skip


class UnsafeRedis(RuntimeError):
    """The server would lose acknowledged work or lacks a command; the message says what."""


def check_redis(client: redis.Redis, *, policy: str) -> dict[str, str]:
    """Check durability settings and commands; refuse (policy 'refuse') or warn ('warn').

    Returns what was found (server name/version, AOF, eviction policy) for the logs.
    """
    info = client.info("server")
    found = {
        "server": "valkey" if "valkey_version" in info else "redis",
        "version": str(info.get("valkey_version") or info.get("redis_version")),
    }
    problems = []
    try:
        found["appendonly"] = str(client.config_get("appendonly").get("appendonly", "?"))
        found["maxmemory-policy"] = str(
            client.config_get("maxmemory-policy").get("maxmemory-policy", "?")
        )
    except redis.ResponseError as exc:  # managed services often disable CONFIG
        problems.append(f"cannot read the server config ({exc}); durability not verified")
    else:
        if found["appendonly"] != "yes":
            problems.append(
                "AOF is off (appendonly no): a Redis restart would lose acknowledged jobs; "
                "set appendonly yes, appendfsync everysec"
            )
        if found["maxmemory-policy"] != "noeviction":
            problems.append(
                f"maxmemory-policy is {found['maxmemory-policy']}: Redis may evict jobs or "
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
    for problem in problems:
        if policy == "refuse":
            raise UnsafeRedis(problem + " (or set TEACHERQ_CONSUMER__DURABLE_REDIS=warn)")
        log.warning("preflight.unsafe_redis", problem=problem)
    return found


def preflight(client: redis.Redis, settings: Settings) -> str:
    """A consumer's start-up checks, run before the model loads: Redis durability and
    commands, then the jobs stream's group (an existing group is fine, also while Redis is
    full). Returns "" when the consumer may start, else the one-line reason it must not."""
    from shared.streams import Streams

    try:
        check_redis(client, policy=settings.consumer.durable_redis)
    except UnsafeRedis as exc:
        return str(exc)
    Streams(client, settings.queue.name, settings.queue.group).ensure_group()
    return ""
