"""The replica acknowledgement of a consumer's result writes (`redis.min_replicas_acked`).

After each result write the writer asks `ReplicaAcks.confirm`: WAIT for N replicas of the
queue's shard. When they do not answer within `replica_ack_timeout_s` (the shard has fewer
replicas than N, typically after its primary failed over), `redis.replica_ack_policy` says
what happens:

- `wait`: `confirm` raises NotReplicated and the writer retries the write (idempotent) until a
  replica is back. The consumer is *waiting*: since when and how many results it holds go
  into its heartbeat record (`teacherq status`, `/get_loads`, the queue metrics), one line is
  logged when the wait starts (`store.replica_wait`) and one when it ends
  (`store.replica_wait_over`); the retries themselves log at debug level.
- `degrade`: the write stands without the acknowledgement, its record is marked
  (`replicated` = "0": `TeacherResult.replicated` is False), logged (`store.unreplicated`) and
  counted. Later writes skip WAIT and are marked likewise while the shard has fewer than N
  replicas (looked up at most once a second), and are acknowledged again as soon as it has
  them (`store.replica_ack_resumed`).

A degraded write can still be lost with the primary that took it; its job is then delivered
again (the entry's acknowledgement went with it) and computed again, so no job is lost unless
its submit was lost too. Submits always wait (the producer raises NotReplicated).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import structlog

from shared import keys
from shared.errors import NotReplicated
from shared.redis_client import await_replicas, run_script
from shared.replication import shard_replicas
from shared.settings import RedisSettings

log = structlog.get_logger("teacherq.store")

UNREPLICATED_FIELD = "replicated"
"""Result-record field set to "0" on a write made without the replica acknowledgement."""

# Marks a record written before its WAIT failed (under `degrade`); only if it still exists,
# so an expired result is not brought back as a bare marker.
_MARK_RECORD = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], '{UNREPLICATED_FIELD}', '0')
end
return 1
"""

RECHECK_S = 1.0  # a degraded writer looks at the shard's replicas at most this often


class ReplicaAcks:
    """WAIT after each write, the waiting/degraded state it leaves, and the policy."""

    def __init__(
        self,
        client: redis.Redis,
        queue: str,
        cfg: RedisSettings,
        *,
        on_unreplicated: Callable[[], None] = lambda: None,
    ) -> None:
        self.r = client
        self.queue = queue
        self.cfg = cfg
        self.on_unreplicated = on_unreplicated  # counts a write made without the replicas
        self._lock = threading.Lock()
        self._held: set[str] = set()  # jobs whose write waits for replicas now
        self._held_during = 0  # jobs held since the wait started
        self.waiting_since: float | None = None  # wall time the wait started
        self.degraded_since: float | None = None  # wall time writes went unacknowledged
        self.unreplicated_writes = 0
        self._looked = (-RECHECK_S, 0)  # (monotonic time, replicas) of the last look
        self._mark = client.register_script(_MARK_RECORD)

    def unacknowledged(self) -> bool:
        """Whether the next write goes without WAIT (degraded, and the shard still short of
        replicas); the writer then marks its record (`UNREPLICATED_FIELD`)."""
        if self.degraded_since is None:
            return False
        t, replicas = self._looked
        if time.monotonic() - t >= RECHECK_S:
            replicas = self._replicas_now() or 0  # unknown: stay degraded, look again later
            self._looked = (time.monotonic(), replicas)
        if replicas < self.cfg.min_replicas_acked:
            return True
        with self._lock:
            if self.degraded_since is not None:
                log.info(
                    "store.replica_ack_resumed",
                    queue=self.queue,
                    replicas=replicas,
                    degraded_s=round(time.time() - self.degraded_since, 1),
                    unreplicated_writes=self.unreplicated_writes,
                )
                self.degraded_since = None
        return False

    def unreplicated(self, job_id: str) -> None:
        """A write made without the acknowledgement (degraded): log and count it."""
        with self._lock:
            self.unreplicated_writes += 1
        self.on_unreplicated()
        log.info("store.unreplicated", queue=self.queue, job_id=job_id)

    def confirm(self, job_id: str) -> bool:
        """WAIT for the replicas after this job's write. True: acknowledged. False: not, and
        under `degrade` the record is now marked. Under `wait` raises NotReplicated (the
        writer retries), and the job counts as held until a later call for it succeeds."""
        try:
            await_replicas(self.r, self.queue, self.cfg)
        except NotReplicated as exc:
            if self.cfg.replica_ack_policy == "degrade":
                self._degrade(exc)
                run_script(self._mark, keys=[keys.result_key(self.queue, job_id)], args=[])
                self.unreplicated(job_id)
                return False
            self._hold(job_id, exc)
            raise
        self.release(job_id)
        return True

    def release(self, job_id: str, *, acknowledged: bool = True) -> None:
        """The job's write is acknowledged (or given up: not `acknowledged`) and held no
        longer; the first acknowledged write after a wait ends the wait."""
        with self._lock:
            self._held.discard(job_id)
            if not acknowledged or self.waiting_since is None or self._held:
                return
            since, held, self.waiting_since, self._held_during = (
                self.waiting_since,
                self._held_during,
                None,
                0,
            )
        log.info(
            "store.replica_wait_over",
            queue=self.queue,
            waited_s=round(time.time() - since, 1),
            results_held=held,
        )

    def _replicas_now(self) -> int | None:
        try:
            return shard_replicas(self.r, self.queue)
        except redis.RedisError:
            return None

    def _hold(self, job_id: str, exc: NotReplicated) -> None:
        with self._lock:
            started = self.waiting_since is None
            if job_id not in self._held:
                self._held_during += 1
            self._held.add(job_id)
            if started:
                self.waiting_since = time.time() - self.cfg.replica_ack_timeout_s
        if started:
            self._warn(
                "store.replica_wait",
                f"{exc}; results are held until a replica is back "
                "(TEACHERQ_REDIS__REPLICA_ACK_POLICY=degrade writes them unacknowledged)",
            )
        else:
            log.debug("store.replica_wait_retry", queue=self.queue, job_id=job_id)

    def _degrade(self, exc: NotReplicated) -> None:
        with self._lock:
            started = self.degraded_since is None
            if started:
                self.degraded_since = time.time() - self.cfg.replica_ack_timeout_s
                self._looked = (time.monotonic(), 0)
        if started:
            self._warn(
                "store.replica_ack_degraded",
                f"{exc}; TEACHERQ_REDIS__REPLICA_ACK_POLICY=degrade: results are written "
                "without it, marked replicated=false, until the shard has the replicas",
            )

    def _warn(self, event: str, problem: str) -> None:
        """The one line a wait or a degraded spell starts with."""
        log.warning(
            event,
            queue=self.queue,
            replicas=self._replicas_now(),
            min_replicas_acked=self.cfg.min_replicas_acked,
            problem=problem,
        )

    def describe(self) -> dict[str, Any]:
        """The heartbeat record's `replica_ack` (shared/replication.py sums them)."""
        with self._lock:
            return {
                "min_replicas_acked": self.cfg.min_replicas_acked,
                "policy": self.cfg.replica_ack_policy,
                "waiting_since": self.waiting_since,
                "held": len(self._held),
                "degraded_since": self.degraded_since,
                "unreplicated_writes": self.unreplicated_writes,
            }
