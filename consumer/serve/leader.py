"""The leader's loop: claim jobs from the stream, score them, store results, acknowledge.

Only the leader rank of a replica talks to Redis. Per batch it:
1. takes entries from the claimer (own pending list, then idle entries of dead consumers,
   then new ones) — on a prefetch thread (consumer/serve/prefetch.py), so the next batch is claimed
   while the device computes;
2. admits them (consumer/serve/intake.py): invalid entries and entries delivered more than
   `max_deliveries` times go to the dead-letter stream at once (consumer/serve/failures.py);
   jobs that already have a result are acknowledged without recomputing;
3. packs the rest into token-budgeted micro-batches, and the group scores each
   (consumer/serve/batch_runner.py, agreeing on failure through consumer/group/agreement.py); a
   failed batch is split and each job retried alone, and a job that fails alone is dead-lettered;
4. hands each result to background writers (consumer/serve/writer.py): bulk arrays to object
   storage, then one atomic script writes the record, announces it and XACKs. A crash
   anywhere before that means a redelivery, never a loss.
Between batches it applies control commands and idle sleep (consumer/serve/control.py) and trims
the stream (consumer/serve/retention.py). consumer/serve/assemble.py builds the Leader
(`build_leader`); consumer/serve/service.py calls it.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable

import redis
import structlog

from consumer.forward.peers import ReplicaBroken
from consumer.forward.prefix import plan_shared_microbatches
from consumer.group.batching import broadcast_batch
from consumer.serve.parts import LeaderParts
from consumer.serve.prefetch import Prefetcher
from consumer.serve.preflight import check_redis
from consumer.serve.writer import WriteTask
from shared import weights
from shared.queue_metrics import QueueCollector
from shared.settings import SettingsError
from shared.streams import Entry
from shared.tracing import new_id, now

log = structlog.get_logger("teacherq.consumer")


class Leader:
    """The Redis-facing loop of one replica."""

    def __init__(
        self,
        parts: LeaderParts,
        *,
        ready_phases: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """Run the parts `build_leader` (consumer/serve/assemble.py) built and connected."""
        self.s = settings = parts.settings
        self._ready_phases = ready_phases  # seconds per start-up phase, for consumer.ready
        self.c = settings.consumer
        self.r = parts.client
        self.stop = parts.stop
        self.faults = parts.faults
        self.queue = settings.queue.name
        self.loaded = parts.loaded
        self.counters = parts.counters
        self.streams = parts.streams
        self.name = parts.name
        self.claimer = parts.claimer
        self.heartbeat = parts.heartbeat
        self.writer = parts.writer
        self.memory = parts.memory
        self.metrics = parts.metrics
        self.dead_letters = parts.dead_letters
        self.intake = parts.intake
        self.runner = parts.runner
        self.control = parts.control
        self.janitor = parts.janitor
        # The leader's own hooks: what the heartbeat records, what a finished write counts.
        self.heartbeat.describe = self._describe
        self.writer.on_done = self._written
        self.heartbeat.on_beat += [self._sample_memory, self._notice_stop]
        if self.writer.acks is not None:  # writes made without their replicas are counted
            self.writer.acks.on_unreplicated = self.metrics.unreplicated_write
        self._model_published = False
        self._counter_lock = threading.Lock()
        self._busy_streak = False  # work at hand since the queue last ran dry
        # The streak's start (perf_counter), and the busy and idle seconds counted before it.
        self._streak = (0.0, 0.0, 0.0)

    def _describe(self) -> dict:
        c = self.counters
        return {
            "model_version": self.loaded.version,
            "model_generation": self.loaded.generation,
            "model_path": self.loaded.path,
            "layout": self.loaded.scorer.layout.describe(),
            "jobs_done": c.jobs_done,
            "jobs_failed": c.jobs_failed,
            "tokens": c.tokens,
            "reclaimed": self.claimer.stats.reclaimed,
            "device_idle_fraction": c.idle_fraction,
            "prefix_tokens_saved": c.prefix_tokens_saved,
            "deleted_entries": self.claimer.stats.deleted,
            # With redis.min_replicas_acked: waiting for replicas, or writing without them.
            **({"replica_ack": self.writer.acks.describe()} if self.writer.acks else {}),
        }

    def run(self) -> None:
        """Serve until stopped; every claimed entry is finished, stored and acked first."""
        check_redis(self.r, policy=self.c.durable_redis)
        self.streams.ensure_group()
        self._publish_model()
        if self.c.metrics_port:  # before ready: a port that cannot be served stops the start
            self._serve_metrics()
        # Ready from the first beat: a supervisor (or `teacherq status`) waiting for this
        # replica sees it now, not one heartbeat interval later.
        self.heartbeat.state = "ready"
        self.heartbeat.start()
        phases = self._ready_phases() if self._ready_phases is not None else {}
        log.info(
            "consumer.ready", consumer=self.name, model_version=self.loaded.version, phases_s=phases
        )
        self.metrics.tick("ready")
        fetcher = Prefetcher(
            self._fetch,
            depth=self.c.prefetch_batches,
            stop=self.stop,
            serial=lambda: self.claimer.last_was_redelivery,
        )
        try:
            self._loop(fetcher)
            self.writer.flush()  # a write that failed for good stops the consumer loudly
        finally:
            self.heartbeat.state = "draining"
            fetcher.close()
            self.writer.close()
            layout = self.loaded.scorer.layout
            if not isinstance(sys.exc_info()[1], ReplicaBroken):  # no one left to tell
                broadcast_batch(None, src=layout.leader_rank, group=layout.replica_group)
            self.heartbeat.stop("stopped")
            self.metrics.tick("stopped")
            self.metrics.close()
            log.info(
                "consumer.stopped",
                consumer=self.name,
                device_idle_fraction=self.counters.idle_fraction,
                **vars(self.counters),
            )

    def _publish_model(self) -> None:
        """Publish the model for clients; while Redis is full this is retried from the
        heartbeat thread instead of failing the start-up."""
        try:
            self.control.publish_model()
            self._model_published = True
        except redis.exceptions.OutOfMemoryError as exc:
            log.warning("consumer.publish_deferred", error=str(exc))

    def _sample_memory(self) -> None:
        """Heartbeat hook: Redis memory into the heartbeat record and the metrics."""
        fields = self.memory.sample()
        paused = self.memory.paused
        self.heartbeat.extra.update(redis_memory=fields, paused=paused)
        self.metrics.redis_memory(fields, paused=paused)
        if not self._model_published:
            self._publish_model()

    def _notice_stop(self) -> None:
        """Heartbeat hook: once stop is requested, writes Redis still refuses after the grace
        period are given up (the loop may be waiting on them), so the consumer exits."""
        if self.stop.requested and not self.writer.abandoning:
            self.writer.abandon_after(self.c.stop_grace_s)

    def _serve_metrics(self) -> None:
        """Serve /metrics and /healthz on `consumer.metrics_port` (+ the data-parallel rank: one
        port per replica of a launch, so leaders never clash), the queue's figures on the first
        replica's; a port that cannot be bound is a settings error naming it."""
        dp_rank = self.loaded.scorer.layout.dp_rank
        if dp_rank == 0:  # the queue's figures once per launch
            collector = QueueCollector(
                self.r, [self.queue], group=self.streams.group, live_after_s=self.c.live_after_s
            )
            self.metrics.registry.register(collector)
        port = self.c.metrics_port + dp_rank
        try:
            self.metrics.serve(port)
        except OSError as exc:
            replica = f" (metrics_port + data-parallel rank {dp_rank})" if dp_rank else ""
            raise SettingsError(
                f"TEACHERQ_CONSUMER__METRICS_PORT: cannot serve metrics on port {port}{replica}: "
                f"{exc.strerror or exc}; choose a free port, or 0 to serve none"
            ) from None

    def _loop(self, fetcher: Prefetcher) -> None:
        """Take claimed entries and process them until stopped and empty-handed."""
        runner = self.runner
        while True:
            if runner.has_inflight and not fetcher.ahead:
                runner.finish_inflight()  # claiming inline blocks: nothing may wait on it
                self._count_idle()
            # With a batch in flight, only take entries already claimed: if there are none,
            # store that batch's results now rather than after a blocking read.
            wait_s = 0.0 if runner.has_inflight else self.c.block_ms / 1000
            entries = fetcher.get(timeout_s=wait_s)
            if entries is None:  # stopped and nothing left in hand
                runner.finish_inflight()
                self._count_idle()
                return
            if not entries and runner.has_inflight:
                # None claimed yet: store the oldest batch's results, then look again, so the
                # device keeps the rest while the next entries may still arrive.
                runner.finish_oldest()
                self._count_idle()
                continue
            if entries:
                self._work(entries)
                fetcher.processed()
            elif self.stop.requested:
                self._busy_streak = False
                self.heartbeat.state = "draining"
            else:
                self._busy_streak = False  # the queue ran dry: waiting now is not idling
                self.heartbeat.state = "sleeping" if self.control.asleep else "ready"
                self.control.maybe_sleep()
            self.metrics.tick(self.heartbeat.state)
            self.writer.check()
            self.control.check()
            self.janitor.maybe_trim()

    def _work(self, entries: list[Entry]) -> None:
        """Process claimed entries; the first after the queue ran dry starts a busy streak."""
        if not self._busy_streak:
            self._streak = (time.perf_counter(), self.counters.busy_s, self.counters.idle_s)
        self.control.wake()
        self.heartbeat.state = "busy"
        self.metrics.tick("busy")
        self._process_until_done(entries)
        self._busy_streak = True
        self._count_idle()
        self.control.worked()

    def _count_idle(self) -> None:
        """The device's idle seconds: those before this busy streak, plus the streak's time up
        to its last finished batch that no batch was in flight (claiming, decoding, checks,
        storing results while nothing was queued). Batches overlap calls (some stay in
        flight), so the device's busy time is set against the streak's whole span."""
        if not self._busy_streak:
            return
        start, busy0, idle0 = self._streak
        span = max(0.0, self.runner.last_finish - start)
        self.counters.idle_s = idle0 + max(0.0, span - (self.counters.busy_s - busy0))

    def _batch_size(self) -> int:
        """Jobs per read: a share of the configured total across live replicas, if set."""
        total = self.c.max_in_flight_total
        if total is None:
            return self.c.batch_max_jobs
        live = weights.live_replicas(
            self.r, self.queue, fresh_s=self.c.live_after_s, states=("ready", "busy")
        )
        return max(1, min(self.c.batch_max_jobs, math.ceil(total / max(len(live), 1))))

    def _fetch(self) -> list[Entry]:
        """Claim entries (called on the prefetch thread, or inline without prefetch)."""
        read0 = now()
        if self.memory.paused:
            # Redis (nearly) full: take no new work — nothing computed that cannot be stored;
            # look again after a blocking read's time.
            time.sleep(self.c.block_ms / 1000)
            return []
        while True:
            try:
                entries = self.claimer.next_entries(self._batch_size())
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Redis restarting: wait for it; the loop resumes on its own.
                log.warning("claim.redis_unavailable", error=str(exc))
                if self.stop.requested:
                    return []
                time.sleep(1.0)
        if entries:
            self.intake.read(entries, read0=read0, read1=now())
            self.heartbeat.hold([eid.decode() for eid, _ in entries])
            self.faults.reached("read")
        return entries

    def _process_until_done(self, entries: list[Entry]) -> None:
        """Process claimed entries, riding out a Redis outage: the entries stay pending to us,
        and processing them again is safe (finished jobs are skipped, writes are idempotent)."""
        delay = 0.1
        while True:
            try:
                self._process(entries)
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("redis.unavailable", error=str(exc), retry_in_s=delay)
                time.sleep(delay)
                self.runner.waited_for_redis()
                delay = min(delay * 2, 5.0)

    def _process(self, entries: list[Entry]) -> None:
        claimed_at = time.time()
        deliveries = self.claimer.delivery_counts([eid for eid, _ in entries])
        jobs = self.intake.admit(entries, deliveries=deliveries, claimed_at=claimed_at)
        # Entries delivered before were in flight when something died: run each alone, with
        # nothing else in flight or unstored, so a poison job cannot take innocent
        # batch-mates down with it again, nor charge them a delivery.
        suspects = [j for j in jobs if deliveries.get(j.entry_id.encode(), 1) > 1]
        fresh = [j for j in jobs if deliveries.get(j.entry_id.encode(), 1) <= 1]
        groups = plan_shared_microbatches(
            fresh,
            token_budget=self.c.token_budget,
            min_prefix_tokens=self.c.min_shared_prefix or None,
        )
        for group in groups + [[j] for j in suspects]:
            counts = {j.entry_id: deliveries.get(j.entry_id.encode(), 1) for j in group}
            if group[0] in suspects:  # alone on the device, every result before it stored
                self.runner.settle()
            # One id per micro-batch: each has its own trace.
            self.runner.score_and_store(
                group, batch_id=new_id(), claimed_at=claimed_at, deliveries=counts
            )
        if suspects:  # stored before the prefetcher may claim more (see Prefetcher)
            self.runner.settle()

    def _written(self, task: WriteTask, wrote: bool) -> None:
        """A write finished (on a writer thread): count it and let the heartbeat let go."""
        self.heartbeat.release(task.entry_id)
        with self._counter_lock:
            if task.status == "ok":
                self.counters.jobs_done += wrote
                self.counters.tokens += task.tokens if wrote else 0
                if wrote:
                    self.metrics.job_done(tokens=task.tokens)
            else:
                self.counters.jobs_failed += wrote
