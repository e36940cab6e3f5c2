"""Queue-level Prometheus metrics: what a queue holds, read from Redis at scrape time.

Served by `teacherq exporter --port P` (one process for any number of queues) and by the
leader of DP replica 0 of a consumer whose `consumer.metrics_port` is set. Every series has
one label, `queue` (no pid, no host: a restarted exporter continues the same series), and all
are gauges, so there are no `_created` series. Where several processes serve the same queue
(every consumer pod, say), aggregate with `max by (queue)`.

    teacherq_queue_lag                     entries not yet delivered to the consumer group
    teacherq_queue_in_flight               entries delivered and not acknowledged
    teacherq_queue_pending_tokens          tokens submitted and not yet acknowledged
    teacherq_queue_dead_letters            entries in the dead-letter stream
    teacherq_queue_live_consumers          consumers whose heartbeat is fresh
    teacherq_queue_oldest_pending_seconds  age of the oldest job not acknowledged (0: none)
    teacherq_queue_shard_replicas          replicas in sync with the queue's shard primary
    teacherq_queue_replica_ack_waiting_seconds  how long result writes have waited for
                                           replica acks (0: not waiting)
    teacherq_queue_replica_ack_held_results  results held waiting for replica acks
    teacherq_queue_unreplicated_writes     results live consumers stored without replica acks
    teacherq_queue_up                      1 if the last scrape could read the queue, else 0
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any, cast

import redis
import structlog
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared import keys
from shared.replication import replica_ack_figures, shard_replicas
from shared.streams import Entry

log = structlog.get_logger("teacherq.queue_metrics")

METRICS = {
    "lag": "Jobs in the stream not yet delivered to the consumer group (the backlog).",
    "in_flight": "Jobs delivered to a consumer and not yet acknowledged.",
    "pending_tokens": "Tokens submitted and not yet acknowledged (what backpressure limits).",
    "dead_letters": "Entries in the dead-letter stream.",
    "live_consumers": "Consumers whose heartbeat is fresh and who have not stopped.",
    "oldest_pending_seconds": "Age of the oldest job submitted and not acknowledged; 0: none.",
    "shard_replicas": "Replicas in sync with the primary holding the queue (its shard).",
    "replica_ack_waiting_seconds": "How long result writes have waited for the replica "
    "acknowledgement redis.min_replicas_acked asks for; 0: not waiting.",
    "replica_ack_held_results": "Results held by consumers waiting for replica acknowledgement.",
    "unreplicated_writes": "Results live consumers stored without replica acknowledgement "
    "(redis.replica_ack_policy=degrade), since they started.",
}


def _entry_ms(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def queue_figures(
    r: redis.Redis, queue: str, group: str, *, live_after_s: float
) -> dict[str, float]:
    """The figures of METRICS for one queue (several small reads, each of one key)."""
    stream = keys.jobs_stream(queue)
    sec, usec = r.time()
    now_ms = sec * 1000 + usec // 1000
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet
        groups = []
    g = next((x for x in groups if x["name"] in (group, group.encode())), None)
    if g is None:  # nothing delivered yet: everything in the stream is backlog
        lag: float = float(r.xlen(stream))
        in_flight = 0
        undelivered = r.xrange(stream, count=1)
    else:
        lag = math.nan if g.get("lag") is None else float(g["lag"])
        in_flight = int(g["pending"])
        last = g["last-delivered-id"]
        last = last.decode() if isinstance(last, bytes) else str(last)
        undelivered = r.xrange(stream, min=f"({last}", count=1)
    oldest = [_entry_ms(entry_id) for entry_id, _ in cast(list[Entry], undelivered or [])]
    if in_flight:
        summary = r.xpending(stream, group)
        if summary.get("min"):
            oldest.append(_entry_ms(summary["min"]))
    live: list[dict[str, Any]] = []
    for raw in cast(dict[bytes, bytes], r.hgetall(keys.consumers_key(queue))).values():
        try:
            beat: dict[str, Any] = json.loads(raw)
        except ValueError:
            continue
        fresh = now_ms / 1000 - float(beat.get("time", 0)) < live_after_s
        if fresh and beat.get("state") != "stopped":
            live.append(beat)
    try:
        replicas: int | None = shard_replicas(r, queue)
    except redis.ResponseError:  # INFO refused (a managed service)
        replicas = None
    acks = replica_ack_figures(live, now=now_ms / 1000, replicas=replicas)
    return {
        "lag": lag,
        "in_flight": float(in_flight),
        "pending_tokens": float(int(r.get(keys.pending_tokens_key(queue)) or 0)),
        "dead_letters": float(r.xlen(keys.dead_stream(queue))),
        "live_consumers": float(len(live)),
        "oldest_pending_seconds": max(0.0, (now_ms - min(oldest)) / 1000) if oldest else 0.0,
        "shard_replicas": math.nan if replicas is None else float(replicas),
        "replica_ack_waiting_seconds": float(acks["waiting_s"]),
        "replica_ack_held_results": float(acks["held_results"]),
        "unreplicated_writes": float(acks["unreplicated_writes"]),
    }


class QueueCollector(Collector):
    """A Prometheus collector reading `queues` from Redis at every scrape. A queue that
    cannot be read (Redis down) reports `teacherq_queue_up 0` and no other series."""

    def __init__(
        self, r: redis.Redis, queues: Sequence[str], *, group: str, live_after_s: float
    ) -> None:
        self.r = r
        self.queues = list(queues)
        self.group = group
        self.live_after_s = live_after_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One family per metric, one sample per queue."""
        families = {
            name: GaugeMetricFamily(f"teacherq_queue_{name}", doc, labels=["queue"])
            for name, doc in METRICS.items()
        }
        up = GaugeMetricFamily(
            "teacherq_queue_up",
            "1 if the last scrape could read the queue, else 0.",
            labels=["queue"],
        )
        for q in self.queues:
            try:
                figures = queue_figures(self.r, q, self.group, live_after_s=self.live_after_s)
            except redis.RedisError as exc:
                log.warning("queue_metrics.unreadable", queue=q, error=str(exc))
                up.add_metric([q], 0.0)
                continue
            up.add_metric([q], 1.0)
            for name, value in figures.items():
                families[name].add_metric([q], value)
        yield from families.values()
        yield up
