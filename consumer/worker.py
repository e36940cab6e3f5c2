"""The consumer loop: claim jobs from the stream, score them, store results, acknowledge.

Only the leader rank of a replica talks to Redis. Per batch it:
1. takes entries from the claimer (own pending list, then idle entries of dead consumers,
   then new ones) — on a prefetch thread, so the next batch is claimed while the device
   computes;
2. decodes them: invalid entries and entries delivered more than `max_deliveries` times go to
   the dead-letter stream at once; jobs that already have a result are acknowledged without
   recomputing;
3. packs the rest into token-budgeted micro-batches, broadcasts each to its TP peers, and the
   group scores it; a failure on any rank is agreed by the whole group, the batch is split and
   each job retried alone, and a job that fails alone is dead-lettered with its reason;
4. hands each result to background writers: bulk arrays to object storage, then one atomic
   script writes the record, announces it and XACKs. A crash anywhere before that means a
   redelivery, never a loss.
"""

from __future__ import annotations

import math
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import redis
import structlog
import torch
import torch.distributed as dist

from consumer.batching import (
    BATCH,
    RELOAD,
    SLEEP,
    STOP,
    WAKE,
    BatchTensors,
    batch_from_jobs,
    broadcast_batch,
    broadcast_header,
    broadcast_text,
    receive_batch,
)
from consumer.claims import Claimer
from consumer.faults import FaultInjector
from consumer.heartbeat import Heartbeat
from consumer.metrics import ConsumerMetrics
from consumer.prefix import plan_shared_microbatches
from consumer.preflight import check_redis
from consumer.scoring import PendingScore, Scorer
from consumer.writer import ResultWriter, WriteTask
from shared import keys, weights
from shared.errors import InvalidJob
from shared.keys import THROUGHPUT_MAXLEN, throughput_stream
from shared.messages import Job, Limits, TeacherResult, decode_job, entry_tokens
from shared.settings import Settings
from shared.storage import ObjectStore
from shared.streams import Entry, StreamReply, Streams
from shared.tracing import (
    PhaseClock,
    Span,
    attach_phases,
    end_span,
    new_id,
    now,
    record,
    start_span,
)

log = structlog.get_logger("teacherq.consumer")

PHASES = ("check", "h2d", "forward", "head", "d2h")  # timed on every rank of a group


@dataclass
class StopFlag:
    """Set by the first SIGTERM/SIGINT (finish the work in hand, then exit); a second signal
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
    busy_s: float = 0.0  # time the group spent scoring
    idle_s: float = 0.0  # time with work available but the group not scoring (see run)
    prefix_tokens_saved: int = 0  # tokens not computed thanks to shared prompts

    @property
    def idle_fraction(self) -> float:
        """Share of working time the device was not computing although work was at hand."""
        total = self.busy_s + self.idle_s
        return round(self.idle_s / total, 4) if total else 0.0


class GroupFailure(RuntimeError):
    """Some rank of the TP group failed on a batch; every rank knows."""


def _agree(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True only if every rank of the group is ok (one tiny all-reduce)."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def score_agreed(
    scorer: Scorer, batch: BatchTensors, faults: FaultInjector
) -> tuple[list[dict], list[list[float]]]:
    """Score a batch on every rank of the group, agreeing on failure.

    Each rank checks the batch first (and fault injection fires here); the group computes only
    if every rank is ready, and reports success only if every rank finished. A failure is
    raised as GroupFailure on all ranks alike, so no rank is left waiting in a collective for a
    peer that gave up. (A rank that dies inside the model's own collectives is caught by the
    process group's timeout instead.)

    Also returns every rank's phase offsets (`PhaseClock.offsets(PHASES)`), by TP rank.
    """
    return launch_agreed(scorer, batch, faults)()


def launch_agreed(
    scorer: Scorer, batch: BatchTensors, faults: FaultInjector
) -> Callable[[], tuple[list[dict], list[list[float]]]]:
    """`score_agreed` in two steps: check, agree and queue the batch on the device now; the
    returned call waits for the outputs and agrees on them (raising GroupFailure then). Every
    rank of a group calls both steps in the same order."""
    group, device = scorer.layout.tp_group, scorer.device
    marks = cuda_marks(device) if device.type == "cuda" else None
    clock = PhaseClock(device_mark=marks)  # starts as the broadcast returns, on every rank
    error: BaseException | None = None
    try:
        with clock.phase("check"):
            faults.check_batch(batch.input_ids_T)
            scorer.check(batch)
    except Exception as exc:  # noqa: BLE001 - reported to the group, re-raised below
        error = exc
    if not _agree(error is None, group, device):
        raise GroupFailure(_describe(error, "a peer rank failed checking the batch")) from error
    pending: PendingScore | None = None
    try:
        pending = scorer.launch(batch, clock)
    except Exception as exc:  # noqa: BLE001 - reported to the group when finishing
        error = exc

    def finish() -> tuple[list[dict], list[list[float]]]:
        failure, outputs = error, []
        if pending is not None:
            try:
                outputs = pending.result()
            except Exception as exc:  # noqa: BLE001 - reported to the group, re-raised below
                failure = exc
        if not _agree(failure is None, group, device):
            raise GroupFailure(_describe(failure, "a peer rank failed scoring the batch")) from (
                failure
            )
        return outputs, _gather_phases(clock, group, device)

    return finish


def cuda_marks(device: torch.device) -> Callable[[], Callable[[], float]]:
    """A `PhaseClock.device_mark` for CUDA: events on the current stream, timed against one
    recorded as the clock starts (between batches the device is idle, so that event completes
    at once; were it still busy, phases would read late, never early)."""
    start = torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(device))

    def mark() -> Callable[[], float]:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))

        def seconds() -> float:
            event.synchronize()
            return start.elapsed_time(event) / 1e3

        return seconds

    return mark


def _gather_phases(
    clock: PhaseClock, group: dist.ProcessGroup | None, device: torch.device
) -> list[list[float]]:
    """Every rank's phase offsets, by TP rank (one all-gather of 10 numbers per rank)."""
    if group is None:  # nothing to gather, and no device round trip (it waits for the device)
        return [clock.offsets(PHASES)]
    mine = torch.tensor(clock.offsets(PHASES), dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


def _describe(error: BaseException | None, fallback: str) -> str:
    return f"{type(error).__name__}: {error}" if error else fallback


@dataclass
class _InFlight:
    """A micro-batch queued on the device, until its results are handed to the writers."""

    jobs: list[Job]
    batch_id: str
    claimed_at: float
    deliveries: dict[str, int]
    batch: BatchTensors
    span: Span
    packed: float  # seconds from the span's start: packed, then broadcast
    sent: float
    t0: float  # perf_counter at launch
    finish: Callable[[], tuple[list[dict], list[list[float]]]]


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
        faults: FaultInjector,
        reload: Callable[[str], tuple[Scorer, str]] | None = None,
        generation: int = 0,
        control_cursor: str = "0-0",
    ) -> None:
        self.s = settings
        self.reload = reload
        self.generation = generation
        self.control_cursor = control_cursor
        self.asleep = False
        self._idle_since = time.monotonic()
        self._busy_streak = False
        self.c = settings.consumer
        self.scorer = scorer
        self.r = client
        self.store = store
        self.model_version = model_version
        self.stop = stop
        self.faults = faults
        self.queue = settings.queue.name
        self.streams = Streams(client, self.queue, settings.queue.group)
        self.name = self.c.name or f"{socket.gethostname()}-{os.getpid()}-dp{scorer.layout.dp_rank}"
        self.limits = self._limits()
        self.counters = Counters()
        self.claimer = Claimer(
            self.streams, self.name, visibility_timeout_s=self.c.visibility_timeout_s,
            block_ms=self.c.block_ms,
        )  # fmt: skip
        self.heartbeat = Heartbeat(
            client=client,
            key=keys.consumers_key(self.queue),
            name=self.name,
            claimer=self.claimer,
            interval_s=self.c.heartbeat_interval_s,
            job_timeout_s=self.c.job_timeout_s,
            describe=self._describe,
        )
        self.writer = ResultWriter(
            streams=self.streams,
            store=store,
            queue=self.queue,
            inline_max_bytes=settings.queue.inline_max_bytes,
            ttl_s=settings.queue.result_ttl_s,
            threads=self.c.store_threads,
            faults=faults,
            on_done=self._written,
        )
        self._counter_lock = threading.Lock()
        self._next_janitor = 0.0
        self.metrics = ConsumerMetrics(
            queue=self.queue,
            consumer=self.name,
            health_max_age_s=max(30.0, 3 * self.c.heartbeat_interval_s),
            busy_max_s=self.c.job_timeout_s,
        )
        # When each claimed entry was read (span clock): set on the prefetch thread, popped
        # by the loop.
        self._read_times: dict[bytes, tuple[float, float]] = {}
        self._inflight: _InFlight | None = None  # launched, not yet finished (TP = 1)
        self._last_finish = 0.0

    def _limits(self) -> Limits:
        """What this consumer accepts: the queue's limits, capped to the served model's."""
        spec = self.scorer.spec
        return Limits.for_queue(
            self.s.queue, vocab_size=spec.vocab_size, model_max_tokens=spec.max_input_tokens
        )

    def _advertise_model(self) -> None:
        """The served model's record, which producers read for their limits."""
        spec = self.scorer.spec
        record = {
            "vocab_size": spec.vocab_size,
            "version": self.model_version,
            "max_input_tokens": spec.max_input_tokens,
        }
        self.r.hset(keys.model_key(self.queue), mapping=record)

    def _describe(self) -> dict:
        c = self.counters
        return {
            "model_version": self.model_version,
            "model_generation": self.generation,
            "layout": self.scorer.layout.describe(),
            "jobs_done": c.jobs_done,
            "jobs_failed": c.jobs_failed,
            "tokens": c.tokens,
            "reclaimed": self.claimer.stats.reclaimed,
            "device_idle_fraction": c.idle_fraction,
            "prefix_tokens_saved": c.prefix_tokens_saved,
            "deleted_entries": self.claimer.stats.deleted,
        }

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stopped; every claimed entry is finished, stored and acked first."""
        check_redis(self.r, policy=self.c.durable_redis)
        self.streams.ensure_group()
        self._advertise_model()
        self.heartbeat.start()
        self.heartbeat.state = "ready"
        log.info("consumer.ready", consumer=self.name, model_version=self.model_version)
        if self.c.metrics_port:
            # One port per data-parallel replica of a launch, so leaders never clash.
            self.metrics.serve(self.c.metrics_port + self.scorer.layout.dp_rank)
        self.metrics.tick("ready")
        fetcher = Prefetcher(
            self._fetch,
            depth=self.c.prefetch_batches,
            stop=self.stop,
            serial=lambda: self.claimer.last_was_redelivery,
        )
        try:
            while True:
                if self._inflight is not None and not fetcher.ahead:
                    self._finish_inflight()  # claiming inline blocks: nothing may wait on it
                t_wait = time.perf_counter()
                # With a batch in flight, only take entries already claimed: if there are none,
                # store that batch's results now rather than after a blocking read.
                wait_s = 0.0 if self._inflight is not None else self.c.block_ms / 1000
                entries = fetcher.get(timeout_s=wait_s)
                if entries is None:  # stopped and nothing left in hand
                    self._finish_inflight()
                    break
                if not entries and self._inflight is not None:
                    self._finish_inflight()
                    continue
                if entries:
                    # Idle = waiting for entries that were already there (the prefetcher was
                    # behind) + everything in processing that is not scoring (decode, checks,
                    # handing results to the writers).
                    waited = time.perf_counter() - t_wait if self._busy_streak else 0.0
                    busy_before = self.counters.busy_s
                    t_proc = time.perf_counter()
                    self._wake()
                    self.heartbeat.state = "busy"
                    self.metrics.tick("busy")
                    self._process_until_done(entries)
                    fetcher.processed()
                    spent = time.perf_counter() - t_proc
                    self.counters.idle_s += waited + spent - (self.counters.busy_s - busy_before)
                    self._busy_streak = True
                    self._idle_since = time.monotonic()
                elif self.stop.requested:
                    self._busy_streak = False
                    self.heartbeat.state = "draining"
                else:
                    self._busy_streak = False  # the queue ran dry: waiting now is not idling
                    self.heartbeat.state = "sleeping" if self.asleep else "ready"
                    self._maybe_sleep()
                self.metrics.tick(self.heartbeat.state)
                self._check_control()
                self._maybe_trim()
        finally:
            self.heartbeat.state = "draining"
            fetcher.close()
            self.writer.close()
            broadcast_batch(None, src=self.scorer.layout.leader_rank, group=self._group)
            self.heartbeat.stop("stopped")
            self.metrics.tick("stopped")
            self.metrics.close()
            log.info("consumer.stopped", consumer=self.name,
                     device_idle_fraction=self.counters.idle_fraction,
                     **vars(self.counters))  # fmt: skip

    @property
    def _group(self) -> dist.ProcessGroup | None:
        return self.scorer.layout.tp_group

    def _batch_size(self) -> int:
        """Jobs per read: a share of the configured total across live replicas, if set."""
        total = self.c.max_in_flight_total
        if total is None:
            return self.c.batch_max_jobs
        live = len(
            weights.live_replicas(
                self.r, self.queue, fresh_s=3 * self.c.heartbeat_interval_s,
                states=("ready", "busy"),
            )
        )  # fmt: skip
        return max(1, min(self.c.batch_max_jobs, math.ceil(total / max(live, 1))))

    def _fetch(self) -> list[Entry]:
        """Claim entries (called on the prefetch thread, or inline without prefetch)."""
        read0 = now()
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
            read1 = now()
            for eid, _ in entries:
                self._read_times[eid] = (read0, read1)
            self.heartbeat.hold([eid.decode() for eid, _ in entries])
            self.faults.reached("read")
        return entries

    # -- processing -----------------------------------------------------------------------

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
                delay = min(delay * 2, 5.0)

    def _process(self, entries: list[Entry]) -> None:
        claimed_at = time.time()
        deliveries = self.claimer.delivery_counts([eid for eid, _ in entries])
        jobs: list[Job] = []
        for eid, fields in entries:
            entry_id = eid.decode()
            count = deliveries.get(eid, 1)
            # get, not pop: _process_until_done may run the same entries again.
            read0, read1 = self._read_times.get(eid, (claimed_at, claimed_at))
            try:
                job = decode_job(entry_id, fields, limits=self.limits)
            except InvalidJob as exc:
                self._dead_letter(entry_id, fields, reason=str(exc), exc_type="InvalidJob",
                                  deliveries=count)  # fmt: skip
                continue
            if count > self.c.max_deliveries:
                reason = (
                    f"delivered {count} times, more than consumer.max_deliveries="
                    f"{self.c.max_deliveries} (the job crashed, hung or timed out each time)"
                )
                self._dead_letter(entry_id, fields, reason=reason,
                                  exc_type="TooManyDeliveries", deliveries=count,
                                  attempts=count - 1)  # fmt: skip
                continue
            if (job.request.min_model_generation or 0) > self.generation:
                self._leave_for_newer(job)
                continue
            self._claimed(job, read0=read0, read1=read1, deliveries=count)
            jobs.append(job)
        for eid, _ in entries:
            self._read_times.pop(eid, None)
        jobs = self._skip_finished(jobs)
        # Entries delivered before were in flight when something died: run each alone, so a
        # poison job cannot take innocent batch-mates down with it again.
        suspects = [j for j in jobs if deliveries.get(j.entry_id.encode(), 1) > 1]
        fresh = [j for j in jobs if deliveries.get(j.entry_id.encode(), 1) <= 1]
        groups = plan_shared_microbatches(
            fresh,
            token_budget=self.c.token_budget,
            min_prefix_tokens=self.c.min_shared_prefix or None,
        )
        for group in groups + [[j] for j in suspects]:
            counts = {j.entry_id: deliveries.get(j.entry_id.encode(), 1) for j in group}
            if group[0] in suspects:  # alone on the device too, with nothing else in flight
                self._finish_inflight()
            # One id per micro-batch: each has its own trace.
            self._score_and_store(group, batch_id=new_id(), claimed_at=claimed_at,
                                  deliveries=counts)  # fmt: skip
        if suspects:  # finished before the prefetcher may claim more (see Prefetcher)
            self._finish_inflight()

    def _claimed(self, job: Job, *, read0: float, read1: float, deliveries: int) -> None:
        """The job's queue_wait and claim spans (in its own trace), and the wait metric."""
        trace = job.request.trace
        # A blocking read waited for the job to arrive: its claim starts no earlier than that.
        claim0 = min(max(read0, job.submitted_at), read1)
        if job.submitted_at > 0:
            record("queue_wait", start_time=job.submitted_at, end_time=claim0, carrier=trace,
                   job_id=job.job_id, entry_id=job.entry_id, deliveries=deliveries)  # fmt: skip
            self.metrics.job_claimed(queue_wait_s=claim0 - job.submitted_at,
                                     deliveries=deliveries)  # fmt: skip
        record("claim", start_time=claim0, end_time=read1, carrier=trace, job_id=job.job_id,
               consumer=self.name)  # fmt: skip

    def _skip_finished(self, jobs: list[Job]) -> list[Job]:
        """Acknowledge, without computing, jobs that already have a result record (done,
        failed or cancelled) or that appear twice in this read (a retried XADD)."""
        if not jobs:
            return jobs
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            pipe.exists(keys.result_key(self.queue, job.job_id))
        todo, seen = [], set()
        for job, exists in zip(jobs, pipe.execute(), strict=True):
            if exists or job.job_id in seen:
                self.streams.ack(job.entry_id, tokens=job.counted_tokens)
                self.heartbeat.release(job.entry_id)
                self.counters.duplicates_skipped += 1
                self.metrics.duplicate_skipped()
                log.info("job.duplicate_skipped", job_id=job.job_id, entry_id=job.entry_id)
            else:
                seen.add(job.job_id)
                todo.append(job)
        return todo

    def _score_and_store(
        self, jobs: list[Job], *, batch_id: str, claimed_at: float, deliveries: dict[str, int]
    ) -> None:
        """Launch a micro-batch, then finish the one launched before it: at TP = 1 the device
        computes this batch while the host stores the previous one's results and prepares the
        next (one batch in flight at a time). With a TP group each batch finishes at once."""
        launched = self._launch(jobs, batch_id=batch_id, claimed_at=claimed_at,
                                deliveries=deliveries)  # fmt: skip
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            self._finish(previous)
        if self.scorer.layout.tp_group is not None:
            self._finish_inflight()

    def _finish_inflight(self) -> None:
        """Finish the batch in flight, if any (before idling, control commands, stopping)."""
        while self._inflight is not None:
            batch, self._inflight = self._inflight, None
            self._finish(batch)

    def _launch(
        self, jobs: list[Job], *, batch_id: str, claimed_at: float, deliveries: dict[str, int]
    ) -> _InFlight | None:
        t0 = time.perf_counter()
        if self._inflight is None:
            self.heartbeat.batch_started = time.monotonic()
        b = start_span("batch", root=True, batch_id=batch_id, jobs=len(jobs),
                       job_ids=[j.job_id for j in jobs], consumer=self.name)  # fmt: skip
        try:
            batch = batch_from_jobs(jobs)
            packed = b.elapsed()
            b.child("pack", start_s=0.0, end_s=packed)
            b.set(tokens=batch.num_tokens)
            broadcast_batch(batch, src=self.scorer.layout.leader_rank, group=self._group)
            sent = b.elapsed()
            b.child("broadcast", start_s=packed, end_s=sent)
            self.faults.reached("compute")
            finish = launch_agreed(self.scorer, batch, self.faults)
        except Exception as exc:  # noqa: BLE001 - loop boundary: a batch failure must not kill us
            end_span(b, exc)
            self._batch_failed(jobs, exc, batch_id=batch_id, claimed_at=claimed_at,
                               deliveries=deliveries)  # fmt: skip
            return None
        return _InFlight(jobs, batch_id, claimed_at, deliveries, batch, b, packed, sent, t0,
                         finish)  # fmt: skip

    def _finish(self, f: _InFlight) -> None:
        try:
            outputs, phases = f.finish()
            for tp_rank, offsets in enumerate(phases):
                attach_phases(f.span, f"rank{tp_rank}", PHASES, offsets, at_s=f.sent,
                              rank=tp_rank)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - loop boundary: a batch failure must not kill us
            end_span(f.span, exc)
            self._batch_failed(f.jobs, exc, batch_id=f.batch_id, claimed_at=f.claimed_at,
                               deliveries=f.deliveries)  # fmt: skip
            return
        finally:
            self._heartbeat_batch()
        end_span(f.span)
        done = time.perf_counter()
        compute_s = done - f.t0
        # Device time: from launch, or from the previous batch's end if it was still running.
        self.counters.busy_s += done - max(f.t0, self._last_finish)
        self._last_finish = done
        self.counters.batches += 1
        jobs, batch, batch_id = f.jobs, f.batch, f.batch_id
        self._link_spans(jobs, f.span, batch_id=batch_id, packed=f.packed, sent=f.sent,
                         phases=phases)  # fmt: skip
        self.metrics.batch_done(jobs=len(jobs), tokens=batch.num_tokens, latency_s=compute_s)
        saved = batch.prefix_tokens_saved
        self.metrics.prefix_tokens_saved(saved)
        self.counters.prefix_tokens_saved += saved
        self.metrics.update_device_memory()
        self._record_throughput(jobs=len(jobs), tokens=batch.num_tokens)
        for job, arrays in zip(jobs, outputs, strict=True):
            result = TeacherResult(
                job_id=job.job_id,
                model_version=self.model_version,
                model_generation=self.generation,
                metadata=job.request.metadata,
                timings={
                    "queue_wait_ms": round(max(0.0, f.claimed_at - job.submitted_at) * 1000, 3),
                    "batch_compute_ms": round(compute_s * 1000, 3),
                },
                **arrays,
            )
            self.writer.submit(
                WriteTask(
                    result=result,
                    entry_id=job.entry_id,
                    tokens=job.counted_tokens,
                    trace=job.request.trace,
                    batch_id=batch_id,
                )  # fmt: skip
            )
        # Packing documents back to back (thd) computes no padding tokens at all.
        log.info("batch.done", batch_id=batch_id, jobs=len(jobs), tokens=batch.num_tokens,
                 compute_ms=round(compute_s * 1000, 2), padding_waste=0.0,
                 prefix_tokens_saved=saved,
                 device_idle_fraction=self.counters.idle_fraction,
                 **self.metrics.progress_fields())  # fmt: skip

    def _heartbeat_batch(self) -> None:
        """The hang watchdog times the batch in flight, if any."""
        self.heartbeat.batch_started = None if self._inflight is None else time.monotonic()

    def _batch_failed(
        self, jobs: list[Job], exc: BaseException, *, batch_id: str, claimed_at: float,
        deliveries: dict[str, int],
    ) -> None:  # fmt: skip
        """A batch failed: find the culprit (or get past OOM) by running each job alone; a job
        that failed alone is retried or dead-lettered. The batch in flight finishes first, so
        that these runs do not interleave with it."""
        self._finish_inflight()
        self.metrics.batch_failed()
        log.warning("batch.failed", batch_id=batch_id, jobs=len(jobs), error=_describe(exc, ""))
        if len(jobs) > 1:
            for job in jobs:
                self._score_and_store([job], batch_id=new_id(), claimed_at=claimed_at,
                                      deliveries=deliveries)  # fmt: skip
        else:
            self._retry_or_fail(jobs[0], exc, deliveries=deliveries.get(jobs[0].entry_id, 1),
                                claimed_at=claimed_at)  # fmt: skip
        self._finish_inflight()

    def _link_spans(
        self, jobs: list[Job], b: Span, *, batch_id: str, packed: float, sent: float,
        phases: list[list[float]],
    ) -> None:  # fmt: skip
        """Each job's pack / forward / head spans, in its own trace, at the batch's times
        (the leader's clock), with the batch id that leads to the batch's trace."""
        lead = phases[self.scorer.layout.tp_rank]
        t = b.start_wall
        forward_end = t + sent + lead[2 * PHASES.index("forward") + 1]
        head_end = t + sent + max(lead)  # head and d2h
        for job in jobs:
            link: dict[str, Any] = {
                "carrier": job.request.trace, "job_id": job.job_id, "batch_id": batch_id
            }  # fmt: skip
            record("pack", start_time=t, end_time=t + packed, **link)
            record("forward", start_time=t + packed, end_time=forward_end, **link)
            record("head", start_time=forward_end, end_time=head_end, **link)

    def _record_throughput(self, *, jobs: int, tokens: int) -> None:
        """One entry per batch on the throughput stream (`teacherq status` tokens/s)."""
        try:
            self.r.xadd(throughput_stream(self.queue),
                        {"jobs": jobs, "tokens": tokens, "consumer": self.name},
                        maxlen=THROUGHPUT_MAXLEN, approximate=True)  # fmt: skip
        except redis.RedisError as exc:  # statistics only: never stop the loop for them
            log.warning("throughput.record_failed", error=str(exc))

    def _written(self, task: WriteTask, wrote: bool) -> None:
        self.heartbeat.release(task.entry_id)
        with self._counter_lock:
            if task.status == "ok":
                self.counters.jobs_done += wrote
                self.counters.tokens += task.tokens if wrote else 0
                if wrote:
                    self.metrics.job_done(tokens=task.tokens)
            else:
                self.counters.jobs_failed += wrote

    def _retry_or_fail(
        self, job: Job, exc: BaseException, *, deliveries: int, claimed_at: float
    ) -> None:
        """A job that failed alone: deliver it again (XCLAIM to ourselves counts a delivery)
        until it has been delivered max_deliveries times, then dead-letter it with the error."""
        if deliveries < self.c.max_deliveries:
            self.r.xclaim(self.streams.jobs, self.streams.group, self.name, min_idle_time=0,
                          message_ids=[job.entry_id])  # fmt: skip
            log.info("job.retry", job_id=job.job_id, deliveries=deliveries + 1)
            self._score_and_store([job], batch_id=new_id(), claimed_at=claimed_at,
                                  deliveries={job.entry_id: deliveries + 1})  # fmt: skip
            return
        cause = exc.__cause__ or exc
        fields = job.fields or {b"job_id": job.job_id.encode()}
        reason = f"failed on each of {deliveries} deliveries: {_describe(exc, 'failed')}"
        self._dead_letter(job.entry_id, fields, reason=reason, exc_type=type(cause).__name__,
                          deliveries=deliveries, attempts=deliveries)  # fmt: skip

    def _dead_letter(
        self,
        entry_id: str,
        fields: dict[bytes, bytes],
        *,
        reason: str,
        exc_type: str,
        deliveries: int,
        attempts: int = 0,
    ) -> None:
        """Move an entry to the dead-letter stream with why, and give waiters the error.

        `deliveries` is how often the entry was delivered; `attempts` how often it was
        actually computed (0 for invalid input)."""
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
            "attempts": attempts,
            "consumer": self.name,
            "time": time.time(),
        }
        for k, v in fields.items():  # the original payload, field by field
            dead[f"orig:{k.decode(errors='replace')}"] = v
        result = TeacherResult(job_id=job_id, model_version=self.model_version, error=reason)
        self.writer.write_now(
            WriteTask(
                result=result,
                entry_id=entry_id,
                tokens=entry_tokens(fields),
                status="failed",
                dead_letter=dead,
            )  # fmt: skip
        )
        self.metrics.dead_lettered(reason=exc_type)
        self.metrics.job_failed(reason=exc_type)
        log.warning("job.dead_lettered", job_id=job_id, entry_id=entry_id, reason=reason)

    def _leave_for_newer(self, job: Job) -> None:
        """A job wants a newer model generation than ours: put it back on the stream (a fresh
        entry, then XACK this one) for a newer replica — or for us after our next update."""
        self.streams.requeue(job.entry_id, job.fields)
        self.heartbeat.release(job.entry_id)
        log.info("job.left_for_newer", job_id=job.job_id,
                 wants=job.request.min_model_generation, serving=self.generation)  # fmt: skip
        time.sleep(0.1)  # don't spin on a job no live replica can take yet

    # -- weights, sleep -------------------------------------------------------------------

    def _check_control(self) -> None:
        """Apply commands other processes put on the control stream (weight updates)."""
        reply = cast(
            StreamReply,
            self.r.xread({keys.control_stream(self.queue): self.control_cursor}, count=100),
        )
        newest: tuple[str, int] | None = None
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.control_cursor = entry_id.decode()
                if fields.get(b"cmd") == b"update-weights":
                    gen = int(fields[b"generation"])
                    if gen > self.generation:
                        newest = (fields[b"path"].decode(), gen)
        if newest:
            self._update_weights(*newest)

    def _update_weights(self, path: str, generation: int) -> None:
        """Drain, reload every rank from `path`, stamp the new version, acknowledge."""
        if self.reload is None:
            return
        log.info("weights.update", path=path, generation=generation)
        self.heartbeat.state = "updating"
        self._finish_inflight()
        self.writer.flush()  # results computed with the old weights are stored as such
        was_asleep = self.asleep
        self._wake()
        layout = self.scorer.layout
        broadcast_header(RELOAD, src=layout.leader_rank, group=self._group)
        broadcast_text(path, src=layout.leader_rank, group=self._group)
        self.scorer, self.model_version = self.reload(path)
        self.generation = generation
        self.limits = self._limits()
        self._advertise_model()
        if was_asleep:
            self._sleep()
        self.heartbeat.state = "sleeping" if self.asleep else "ready"
        self.heartbeat.beat()
        live = weights.live_replicas(self.r, self.queue, fresh_s=3 * self.c.heartbeat_interval_s)
        done = weights.ack_update(self.r, self.queue, replica=self.name, generation=generation,
                                  live_replicas=live)  # fmt: skip
        log.info("weights.updated", model_version=self.model_version, generation=generation,
                 completed_update=done)  # fmt: skip

    def _maybe_sleep(self) -> None:
        idle = self.c.sleep_after_idle_s
        if idle and not self.asleep and time.monotonic() - self._idle_since > idle:
            self._sleep()

    def _sleep(self) -> None:
        self._finish_inflight()
        broadcast_header(SLEEP, src=self.scorer.layout.leader_rank, group=self._group)
        self.scorer.offload()
        self.asleep = True
        self.heartbeat.state = "sleeping"
        log.info("consumer.sleeping")

    def _wake(self) -> None:
        if not self.asleep:
            return
        broadcast_header(WAKE, src=self.scorer.layout.leader_rank, group=self._group)
        self.scorer.onload()
        self.asleep = False
        log.info("consumer.awake")

    # -- retention ------------------------------------------------------------------------

    def _maybe_trim(self) -> None:
        now = time.monotonic()
        if now < self._next_janitor:
            return
        self._next_janitor = now + self.c.janitor_interval_s
        try:
            trimmed = trim_acknowledged(self.r, self.streams.jobs)
        except redis.RedisError as exc:
            log.warning("janitor.failed", error=str(exc))
            return
        if trimmed:
            log.info("janitor.trimmed", stream=self.streams.jobs, entries=trimmed)


def trim_acknowledged(r: redis.Redis, stream: str) -> int:
    """Trim a stream below the oldest entry any group still needs; returns entries removed.

    An entry is still needed while it is pending in some group or not yet delivered to some
    group, so the cut is the minimum over groups of (oldest pending id, first undelivered id).
    Trimming with MINID never removes an entry at or above the cut: no unacknowledged work is
    ever deleted.
    """
    groups = r.xinfo_groups(stream)
    if not groups:
        return 0
    cuts = []
    for g in groups:
        summary = r.xpending(stream, g["name"])
        if summary["pending"]:
            cuts.append(_id_tuple(summary["min"]))
        ms, seq = _id_tuple(g["last-delivered-id"])
        cuts.append((ms, seq + 1))
    ms, seq = min(cuts)
    return int(r.xtrim(stream, minid=f"{ms}-{seq}", approximate=False))


def _id_tuple(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class Prefetcher:
    """Claims the next batch on a background thread while the current one computes.

    With depth 0 the loop claims inline. On stop, the thread stops claiming, and everything
    it already claimed is still handed out (and so finished) before `get` returns None.
    After claiming redelivered entries (`serial()` true) it waits until the loop has processed
    them before claiming more: a redelivered entry may be the poison that kills the process,
    and entries claimed ahead of it would be charged a delivery for nothing.
    """

    _DONE = object()

    def __init__(
        self,
        fetch: Callable[[], list[Entry]],
        *,
        depth: int,
        stop: StopFlag,
        serial: Callable[[], bool] = lambda: False,
    ) -> None:
        self.fetch = fetch
        self.stop = stop
        self.depth = depth
        self.serial = serial
        self._processed = threading.Event()
        self._q: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="tq-prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.requested:
                entries = self.fetch()
                if entries:
                    wait = self.serial()
                    self._processed.clear()
                    self._q.put(entries)
                    while wait and not self._processed.wait(0.5) and not self.stop.requested:
                        pass
        except BaseException as exc:  # noqa: BLE001 - handed to the loop thread, re-raised there
            self._error = exc
        finally:
            self._q.put(self._DONE)

    @property
    def ahead(self) -> bool:
        """Whether entries are claimed on a background thread (else `get` claims inline)."""
        return self._thread is not None

    def get(self, *, timeout_s: float) -> list[Entry] | None:
        """The next claimed entries, [] if none arrived in time, None once stopped and empty."""
        if self._thread is None:
            return None if self.stop.requested else self.fetch()
        try:
            item = self._q.get(timeout=timeout_s)
        except queue.Empty:
            return []
        if item is self._DONE:
            if self._error is not None:
                raise self._error
            return None
        return item

    def processed(self) -> None:
        """The loop finished the entries it got last."""
        self._processed.set()

    def close(self) -> None:
        """Wait for the thread to notice the stop flag."""
        if self._thread is not None:
            self._thread.join(timeout=30)


def follow(
    scorer: Scorer,
    faults: FaultInjector,
    *,
    reload: Callable[[str], tuple[Scorer, str]] | None = None,
) -> None:
    """A non-leader rank: obey the leader's commands — score batches, reload, sleep, wake —
    until it signals stop."""
    layout = scorer.layout
    src, group = layout.leader_rank, layout.tp_group
    while True:
        word, a, b, c = broadcast_header(STOP, src=src, group=group)
        if word == STOP:
            return
        if word == BATCH:
            batch = receive_batch(a, b, c, src=src, group=group)
            try:
                score_agreed(scorer, batch, faults)
            except GroupFailure as exc:
                log.warning("batch.failed", rank=layout.rank, error=str(exc))
        elif word == RELOAD:
            path = broadcast_text("", src=src, group=group)
            if reload is not None:
                scorer, _ = reload(path)
        elif word == SLEEP:
            scorer.offload()
        elif word == WAKE:
            scorer.onload()
