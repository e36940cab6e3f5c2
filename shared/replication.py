"""Replica acknowledgement of a queue's writes (`redis.min_replicas_acked`), as others see it.

A consumer with `min_replicas_acked = N` finishes a job only once its write reached N
replicas of the queue's shard (WAIT). When the shard has fewer replicas than that (its
primary failed over and the old one is not back yet), the writes either wait
(`redis.replica_ack_policy = wait`) or go on unacknowledged and marked (`degrade`). Each
consumer records where it stands in its heartbeat (`replica_ack`, see
consumer/serve/replica_ack.py); this module reads the shard's replicas from Redis and sums
the consumers' records for `teacherq status`, `/get_loads` and the queue metrics.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
from redis.cluster import RedisCluster

from shared import keys


def shard_replicas(r: redis.Redis, queue: str) -> int:
    """Replicas in sync with the primary holding `queue` now (INFO replication: those whose
    state is `online`); on a cluster, of the queue's shard."""
    node: Any = r
    if isinstance(r, RedisCluster):
        node = r.get_redis_connection(r.get_node_from_key(keys.jobs_stream(queue)))
    info = node.info("replication")
    return sum(
        1
        for name, v in info.items()
        if name.startswith("slave") and isinstance(v, dict) and v.get("state") == "online"
    )


def replica_ack_figures(
    records: Iterable[dict[str, Any]], *, now: float, replicas: int | None
) -> dict[str, Any]:
    """The queue's replica-acknowledgement state from consumers' heartbeat records: `records`
    are the live consumers' (waiting and held results are theirs now), plus `replicas`, the
    shard's count (None: unread). `unreplicated_writes` sums what those consumers wrote
    without acknowledgement since they started."""
    acks = [rec["replica_ack"] for rec in records if rec.get("replica_ack")]
    waiting = [a["waiting_since"] for a in acks if a.get("waiting_since")]
    degraded = [a["degraded_since"] for a in acks if a.get("degraded_since")]
    return {
        "replicas": replicas,
        "min_replicas_acked": max((int(a["min_replicas_acked"]) for a in acks), default=0),
        "policy": sorted({a["policy"] for a in acks}) or None,
        "waiting_since": min(waiting) if waiting else None,
        "waiting_s": round(max(0.0, now - min(waiting)), 3) if waiting else 0.0,
        "held_results": sum(int(a.get("held", 0)) for a in acks),
        "degraded_since": min(degraded) if degraded else None,
        "unreplicated_writes": sum(int(a.get("unreplicated_writes", 0)) for a in acks),
    }
