"""The consumer loop: claim jobs from the stream, score them, store results, acknowledge.

Only the leader rank of a replica talks to Redis. Per iteration it:
1. reads entries: first its own pending list (ID 0, work it held before a restart), then new
   ones (`>`, XREADGROUP BLOCK), and periodically entries idle past the visibility timeout
   that died with other consumers (XAUTOCLAIM with a kept cursor);
2. decodes them; invalid entries and entries delivered too often go to the dead-letter stream
   at once; jobs that already have a result are acknowledged without recomputing;
3. packs the rest into token-budgeted micro-batches, broadcasts each to its TP peers, and scores;
4. writes each result (bulk arrays to object storage first), announces it and XACKs, in one
   atomic script — a crash anywhere before that means a redelivery, never a loss.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis
import structlog

from consumer.batching import BatchTensors, batch_from_jobs, broadcast_batch, plan_microbatches
from consumer.scoring import Scorer
from shared import keys
from shared.errors import InvalidJob
from shared.messages import Job, Limits, TeacherResult, decode_job, entry_tokens
from shared.results import encode_record
from shared.settings import Settings
from shared.storage import ObjectStore
from shared.streams import Streams
from shared.tracing import new_id, span

log = structlog.get_logger("teacherq.consumer")


@dataclass
class StopFlag:
    """Set by the first SIGTERM/SIGINT (finish the batch in hand, then exit); a second signal
    exits at once."""

    requested: bool = False
    signals: int = 0

    def install(self) -> None:
        """Route SIGTERM and SIGINT here."""
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signals += 1
        if self.signals > 1:
            log.warning("consumer.stop_now", signal=signum)
            os._exit(128 + signum)
        log.info("consumer.draining", signal=signum)
        self.requested = True


@dataclass
class Counters:
    """Running totals reported in heartbeats and logs."""

    jobs_done: int = 0
    jobs_failed: int = 0
    duplicates_skipped: int = 0
    tokens: int = 0
    batches: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class Leader:
    """The Redis-facing loop of one replica."""

    def __init__(
        self,
        *,
        settings: Settings,
        scorer: Scorer,
        client: redis.Redis,
        store: ObjectStore,
        model_version: str,
        stop: StopFlag,
    ) -> None:
        self.s = settings
        self.scorer = scorer
        self.r = client
        self.store = store
        self.model_version = model_version
        self.stop = stop
        self.queue = settings.queue.name
        self.streams = Streams(client, self.queue, settings.queue.group)
        self.name = settings.consumer.name or (
            f"{socket.gethostname()}-{os.getpid()}-dp{scorer.layout.dp_rank}"
        )
        self.limits = Limits(
            max_input_tokens=settings.queue.max_input_tokens,
            max_label_width=settings.queue.max_label_width,
            max_top_k=settings.queue.max_top_k,
            max_sample_n=settings.queue.max_sample_n,
            vocab_size=scorer.spec.vocab_size,
        )
        self.counters = Counters()
        self._claim_cursor = "0-0"
        self._last_claim = 0.0
        self._own_pending_done = False

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stopped; the batch in hand is always finished, stored and acked."""
        self.streams.ensure_group()
        self.r.hset(
            keys.model_key(self.queue),
            mapping={"vocab_size": self.scorer.spec.vocab_size, "version": self.model_version},
        )
        self._heartbeat("ready")
        log.info("consumer.ready", consumer=self.name, model_version=self.model_version)
        try:
            while not self.stop.requested:
                entries = self._next_entries()
                if entries:
                    self._heartbeat("busy")
                    self._process(entries)
                else:
                    self._heartbeat("ready")
        finally:
            broadcast_batch(None, src=self.scorer.layout.leader_rank, group=self._group)
            self._heartbeat("stopped")
            log.info("consumer.stopped", consumer=self.name, **vars(self.counters))

    @property
    def _group(self):
        return self.scorer.layout.tp_group

    def _heartbeat(self, state: str) -> None:
        record = {
            "state": state,
            "time": time.time(),
            "model_version": self.model_version,
            "layout": self.scorer.layout.describe(),
            "jobs_done": self.counters.jobs_done,
            "tokens": self.counters.tokens,
        }
        self.r.hset(keys.consumers_key(self.queue), self.name, json.dumps(record))

    # -- reading --------------------------------------------------------------------------

    def _next_entries(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        c = self.s.consumer
        if not self._own_pending_done:
            # Our own pending list first: entries this consumer name held before a restart.
            reply = self.r.xreadgroup(
                self.streams.group, self.name, {self.streams.jobs: "0"}, count=c.batch_max_jobs
            )
            entries = reply[0][1] if reply else []
            entries = [(eid, f) for eid, f in entries if f]  # trimmed entries come back empty
            if entries:
                return entries
            self._own_pending_done = True
        now = time.monotonic()
        if now - self._last_claim > c.visibility_timeout_s / 2:
            self._last_claim = now
            claimed = self._autoclaim()
            if claimed:
                return claimed
        reply = self.r.xreadgroup(
            self.streams.group,
            self.name,
            {self.streams.jobs: ">"},
            count=c.batch_max_jobs,
            block=c.block_ms,
        )
        return reply[0][1] if reply else []

    def _autoclaim(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Take over entries idle past the visibility timeout (their consumer died)."""
        c = self.s.consumer
        cursor, entries, deleted = self.r.xautoclaim(
            self.streams.jobs,
            self.streams.group,
            self.name,
            min_idle_time=int(c.visibility_timeout_s * 1000),
            start_id=self._claim_cursor,
            count=c.batch_max_jobs,
        )
        self._claim_cursor = cursor.decode() if isinstance(cursor, bytes) else cursor
        if deleted:
            log.warning("claim.deleted_entries", count=len(deleted), ids=deleted[:10])
        if entries:
            log.info("claim.reclaimed", count=len(entries))
        return [(eid, f) for eid, f in entries if f]

    def _delivery_counts(self, entry_ids: Sequence[bytes]) -> dict[bytes, int]:
        if not entry_ids:
            return {}
        lo, hi = min(entry_ids), max(entry_ids)
        rows = self.r.xpending_range(
            self.streams.jobs, self.streams.group, min=lo, max=hi, count=len(entry_ids) * 4
        )
        return {row["message_id"]: int(row["times_delivered"]) for row in rows}

    # -- processing -----------------------------------------------------------------------

    def _process(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        batch_id = new_id()
        claimed_at = time.time()
        deliveries = self._delivery_counts([eid for eid, _ in entries])
        jobs: list[Job] = []
        for eid, fields in entries:
            entry_id = eid.decode()
            try:
                job = decode_job(entry_id, fields, limits=self.limits)
            except InvalidJob as exc:
                self._dead_letter(
                    entry_id,
                    fields,
                    reason=str(exc),
                    exc_type="InvalidJob",
                    deliveries=deliveries.get(eid, 1),
                )
                continue
            if deliveries.get(eid, 1) > self.s.consumer.max_deliveries:
                self._dead_letter(
                    entry_id,
                    fields,
                    exc_type="TooManyDeliveries",
                    reason=f"delivered {deliveries[eid]} times, more than "
                    f"consumer.max_deliveries={self.s.consumer.max_deliveries}",
                    deliveries=deliveries[eid],
                )
                continue
            jobs.append(job)
        jobs = self._skip_finished(jobs)
        for group in plan_microbatches(jobs, token_budget=self.s.consumer.token_budget):
            self._score_and_store(group, batch_id=batch_id, claimed_at=claimed_at)

    def _skip_finished(self, jobs: list[Job]) -> list[Job]:
        """Acknowledge, without computing, jobs that already have a result record or that
        appear twice in this read (a retried XADD); the first entry of a job id computes it."""
        if not jobs:
            return jobs
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.exists(keys.result_key(self.queue, job.job_id))
        todo = []
        seen: set[str] = set()
        for job, exists in zip(jobs, pipe.execute(), strict=True):
            if exists or job.job_id in seen:
                self.streams.ack(job.entry_id, tokens=job.counted_tokens)
                self.counters.duplicates_skipped += 1
                log.info("job.duplicate_skipped", job_id=job.job_id)
            else:
                seen.add(job.job_id)
                todo.append(job)
        return todo

    def _score_and_store(self, jobs: list[Job], *, batch_id: str, claimed_at: float) -> None:
        batch = batch_from_jobs(jobs)
        t0 = time.perf_counter()
        try:
            with span("batch.forward", batch_id=batch_id, jobs=len(jobs), tokens=batch.num_tokens):
                outputs = self._score(batch)
        except Exception as exc:  # noqa: BLE001 - loop boundary: a batch failure must not kill us
            log.exception("batch.failed", batch_id=batch_id, jobs=len(jobs))
            if len(jobs) > 1:  # find the culprit: each job alone
                for job in jobs:
                    self._score_and_store([job], batch_id=new_id(), claimed_at=claimed_at)
            else:
                self._fail(
                    jobs[0], reason=f"{type(exc).__name__}: {exc}", exc_type=type(exc).__name__
                )
            return
        compute_ms = (time.perf_counter() - t0) * 1000
        self.counters.batches += 1
        for job, arrays in zip(jobs, outputs, strict=True):
            result = TeacherResult(
                job_id=job.job_id,
                model_version=self.model_version,
                metadata=job.request.metadata,
                timings={
                    "queue_wait_ms": round(max(0.0, claimed_at - job.submitted_at) * 1000, 3),
                    "batch_compute_ms": round(compute_ms, 3),
                },
                **arrays,
            )
            with span("store", carrier=job.request.trace, job_id=job.job_id, batch_id=batch_id):
                record = encode_record(
                    result,
                    queue=self.queue,
                    store=self.store,
                    inline_max_bytes=self.s.queue.inline_max_bytes,
                )
                self.streams.complete(
                    job_id=job.job_id,
                    entry_id=job.entry_id,
                    status="ok",
                    record=record,
                    ttl_s=self.s.queue.result_ttl_s,
                    tokens=job.counted_tokens,
                )
            self.counters.jobs_done += 1
            self.counters.tokens += job.request.num_tokens
        log.info(
            "batch.done",
            batch_id=batch_id,
            jobs=len(jobs),
            tokens=batch.num_tokens,
            compute_ms=round(compute_ms, 2),
            total_ms=round((time.perf_counter() - t0) * 1000, 2),
        )

    def _score(self, batch: BatchTensors) -> list[dict]:
        broadcast_batch(batch, src=self.scorer.layout.leader_rank, group=self._group)
        return self.scorer.score(batch)

    def _fail(self, job: Job, *, reason: str, exc_type: str) -> None:
        fields = {b"job_id": job.job_id.encode(), b"n_tokens": str(job.counted_tokens).encode()}
        self._dead_letter(job.entry_id, fields, reason=reason, exc_type=exc_type, deliveries=1)

    def _dead_letter(
        self,
        entry_id: str,
        fields: dict[bytes, bytes],
        *,
        reason: str,
        exc_type: str,
        deliveries: int,
    ) -> None:
        """Move an entry to the dead-letter stream with why, and give waiters the error."""
        raw_id = fields.get(b"job_id", b"")
        try:
            job_id = raw_id.decode() or f"entry-{entry_id}"
        except UnicodeDecodeError:
            job_id = f"entry-{entry_id}"
        dead = {
            "job_id": job_id,
            "entry_id": entry_id,
            "reason": reason,
            "exception": exc_type,
            "deliveries": deliveries,
            "consumer": self.name,
            "time": time.time(),
        }
        for k, v in fields.items():  # the original payload, field by field
            dead[f"orig:{k.decode(errors='replace')}"] = v
        record = encode_record(
            TeacherResult(job_id=job_id, model_version=self.model_version, error=reason),
            queue=self.queue,
            store=None,
            inline_max_bytes=0,
        )
        self.streams.complete(
            job_id=job_id,
            entry_id=entry_id,
            status="failed",
            record=record,
            ttl_s=self.s.queue.result_ttl_s,
            tokens=entry_tokens(fields),
            dead_letter=dead,
        )
        self.counters.jobs_failed += 1
        log.warning("job.dead_lettered", job_id=job_id, entry_id=entry_id, reason=reason)


def follow(scorer: Scorer) -> None:
    """A non-leader rank: score whatever the leader broadcasts until it signals stop."""
    layout = scorer.layout
    while True:
        batch = broadcast_batch(None, src=layout.leader_rank, group=layout.tp_group)
        if batch is None:
            return
        scorer.score(batch)
