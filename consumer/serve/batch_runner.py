"""Micro-batches on the device: launch, finish, hand results to the writers, survive failure.

At TP = 1 up to `consumer.batches_in_flight` batches stay queued on the device while the host
stores the results of older ones and prepares the next; in a replica of several ranks each
batch finishes at once. A failed batch is split and each job run alone, to find the culprit
(or get past an out-of-memory); a job that fails alone is delivered again until
`max_deliveries`, then dead-lettered with its error.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import structlog
import torch.distributed as dist

from consumer.forward.batch import BatchTensors
from consumer.forward.peers import peers_alive
from consumer.group.agreement import PHASES, Scored, describe_error, launch_agreed
from consumer.group.batching import batch_from_jobs, broadcast_batch
from consumer.group.faults import FaultInjector
from consumer.serve.failures import DeadLetters
from consumer.serve.heartbeat import Heartbeat
from consumer.serve.metrics import ConsumerMetrics
from consumer.serve.replica import Counters, LoadedModel
from consumer.serve.writer import ResultWriter, WriteTask
from shared.keys import THROUGHPUT_MAXLEN, throughput_stream
from shared.messages import Job, TeacherResult
from shared.streams import Streams
from shared.tracing import Span, attach_phases, end_span, new_id, record, start_span

log = structlog.get_logger("teacherq.consumer")


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
    finish: Callable[[], Scored]


class BatchRunner:
    """Scores micro-batches on the group and submits their results; at TP = 1 up to
    `batches_in_flight` batches stay queued on the device while the host works."""

    def __init__(
        self,
        *,
        loaded: LoadedModel,
        client: redis.Redis,
        streams: Streams,
        writer: ResultWriter,
        heartbeat: Heartbeat,
        metrics: ConsumerMetrics,
        counters: Counters,
        faults: FaultInjector,
        dead_letters: DeadLetters,
        max_deliveries: int,
        consumer: str,
        batches_in_flight: int = 1,
    ) -> None:
        self.loaded = loaded
        self.batches_in_flight = batches_in_flight
        self.r = client
        self.streams = streams
        self.writer = writer
        self.heartbeat = heartbeat
        self.metrics = metrics
        self.counters = counters
        self.faults = faults
        self.dead_letters = dead_letters
        self.max_deliveries = max_deliveries
        self.consumer = consumer
        self._inflight: deque[_InFlight] = deque()  # launched, not yet finished, oldest first
        self._last_finish = 0.0

    @property
    def last_finish(self) -> float:
        """When the last batch finished (time.perf_counter; 0.0 before any)."""
        return self._last_finish

    @property
    def has_inflight(self) -> bool:
        """Whether a batch is launched and not yet finished."""
        return bool(self._inflight)

    @property
    def _group(self) -> dist.ProcessGroup | None:
        return self.loaded.scorer.layout.replica_group

    def score_and_store(
        self, jobs: list[Job], *, batch_id: str, claimed_at: float, deliveries: dict[str, int]
    ) -> None:
        """Launch a micro-batch, then finish the oldest ones until `batches_in_flight` are
        left: at TP = 1 the device computes those while the host stores the finished one's
        results and prepares the next. One left in flight hides the host's work per batch
        behind one batch's compute; two also absorb a batch whose host work takes longer (a
        CUDA graph recorded, a garbage collection). In a replica of several ranks each batch
        finishes at once."""
        launched = self._launch(
            jobs, batch_id=batch_id, claimed_at=claimed_at, deliveries=deliveries
        )
        if launched is not None:
            self._inflight.append(launched)
        keep = self.batches_in_flight if self._group is None else 0
        while len(self._inflight) > keep:
            self.finish_oldest()

    def finish_oldest(self) -> None:
        """Finish the oldest batch in flight, if any (waits for the device to reach it)."""
        if self._inflight:
            self._finish(self._inflight.popleft())

    def finish_inflight(self) -> None:
        """Finish every batch in flight (before control commands, failures, stopping)."""
        while self._inflight:
            self.finish_oldest()

    def settle(self) -> None:
        """Finish every batch in flight and wait until their results are stored and
        acknowledged: nothing is held but what comes next. Before a redelivered job runs (it
        may be the poison that kills the process), so that a result still on its way to Redis
        is not delivered again and charged a delivery it never failed — a good job
        dead-lettered for a neighbour's crashes. Raises as the writer's `check` does."""
        self.finish_inflight()
        self.writer.flush()

    def _launch(
        self, jobs: list[Job], *, batch_id: str, claimed_at: float, deliveries: dict[str, int]
    ) -> _InFlight | None:
        t0 = time.perf_counter()
        if not self._inflight:
            self.heartbeat.batch_started = time.monotonic()
        b = start_span(
            "batch",
            root=True,
            batch_id=batch_id,
            jobs=len(jobs),
            job_ids=[j.job_id for j in jobs],
            consumer=self.consumer,
        )
        try:
            batch = batch_from_jobs(jobs)
            packed = b.elapsed()
            b.child("pack", start_s=0.0, end_s=packed)
            b.set(tokens=batch.num_tokens)
            with peers_alive("broadcasting the batch"):
                broadcast_batch(batch, src=self.loaded.scorer.layout.leader_rank, group=self._group)
            sent = b.elapsed()
            b.child("broadcast", start_s=packed, end_s=sent)
            self.faults.reached("compute")
            finish = launch_agreed(self.loaded.scorer, batch, self.faults)
        except Exception as exc:  # noqa: BLE001 - loop boundary: a batch failure must not kill us
            end_span(b, exc)
            self._batch_failed(
                jobs, exc, batch_id=batch_id, claimed_at=claimed_at, deliveries=deliveries
            )
            return None
        return _InFlight(jobs, batch_id, claimed_at, deliveries, batch, b, packed, sent, t0, finish)

    def _finish(self, f: _InFlight) -> None:
        try:
            outputs, phases = f.finish()
            for tp_rank, offsets in enumerate(phases):
                attach_phases(f.span, f"rank{tp_rank}", PHASES, offsets, at_s=f.sent, rank=tp_rank)
        except Exception as exc:  # noqa: BLE001 - loop boundary: a batch failure must not kill us
            end_span(f.span, exc)
            self._batch_failed(
                f.jobs,
                exc,
                batch_id=f.batch_id,
                claimed_at=f.claimed_at,
                deliveries=f.deliveries,
            )
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
        self._link_spans(
            jobs, f.span, batch_id=batch_id, packed=f.packed, sent=f.sent, phases=phases
        )
        self.metrics.batch_done(jobs=len(jobs), tokens=batch.num_tokens, latency_s=compute_s)
        saved = batch.prefix_tokens_saved
        self.metrics.prefix_tokens_saved(saved)
        self.counters.prefix_tokens_saved += saved
        self.metrics.update_device_memory()
        self._record_throughput(jobs=len(jobs), tokens=batch.num_tokens)
        for job, arrays in zip(jobs, outputs, strict=True):
            self._submit(
                job, arrays, batch_id=batch_id, claimed_at=f.claimed_at, compute_s=compute_s
            )
        # Packing documents back to back (thd) computes no padding tokens at all.
        log.info(
            "batch.done",
            batch_id=batch_id,
            jobs=len(jobs),
            tokens=batch.num_tokens,
            compute_ms=round(compute_s * 1000, 2),
            padding_waste=0.0,
            prefix_tokens_saved=saved,
            device_idle_fraction=self.counters.idle_fraction,
            **self.metrics.progress_fields(),
        )

    def _submit(
        self, job: Job, arrays: dict, *, batch_id: str, claimed_at: float, compute_s: float
    ) -> None:
        """Hand one job's result to the background writers."""
        result = TeacherResult(
            job_id=job.job_id,
            model_version=self.loaded.version,
            model_generation=self.loaded.generation,
            metadata=job.request.metadata,
            timings={
                "queue_wait_ms": round(max(0.0, claimed_at - job.submitted_at) * 1000, 3),
                "batch_compute_ms": round(compute_s * 1000, 3),
            },
            **arrays,
        )
        if self.writer.full():
            # Waiting for the writers (Redis full, replicas missing) is not the device hanging.
            with self.heartbeat.clock_stopped():
                self.writer.wait_for_room()
        self.writer.submit(
            WriteTask(
                result=result,
                entry_id=job.entry_id,
                tokens=job.counted_tokens,
                trace=job.request.trace,
                batch_id=batch_id,
            )
        )

    def _heartbeat_batch(self) -> None:
        """The hang watchdog times the batch in flight, if any."""
        self.heartbeat.batch_started = time.monotonic() if self._inflight else None

    def waited_for_redis(self) -> None:
        """The loop waited for Redis (an outage): that wait is not the device hanging, so the
        watchdog's clock starts again for the batch in flight, if any."""
        self._heartbeat_batch()

    def _batch_failed(
        self,
        jobs: list[Job],
        exc: BaseException,
        *,
        batch_id: str,
        claimed_at: float,
        deliveries: dict[str, int],
    ) -> None:
        """A batch failed: find the culprit (or get past OOM) by running each job alone; a job
        that failed alone is retried or dead-lettered. The batch in flight finishes first, so
        that these runs do not interleave with it."""
        self.finish_inflight()
        self.metrics.batch_failed()
        log.warning(
            "batch.failed", batch_id=batch_id, jobs=len(jobs), error=describe_error(exc, "")
        )
        if len(jobs) > 1:
            for job in jobs:
                self.score_and_store(
                    [job], batch_id=new_id(), claimed_at=claimed_at, deliveries=deliveries
                )
        else:
            self._retry_or_fail(
                jobs[0],
                exc,
                deliveries=deliveries.get(jobs[0].entry_id, 1),
                claimed_at=claimed_at,
            )
        self.finish_inflight()

    def _retry_or_fail(
        self, job: Job, exc: BaseException, *, deliveries: int, claimed_at: float
    ) -> None:
        """A job that failed alone: deliver it again (XCLAIM to ourselves counts a delivery)
        until it has been delivered max_deliveries times, then dead-letter it with the error."""
        if deliveries < self.max_deliveries:
            self.r.xclaim(
                self.streams.jobs,
                self.streams.group,
                self.consumer,
                min_idle_time=0,
                message_ids=[job.entry_id],
            )
            log.info("job.retry", job_id=job.job_id, deliveries=deliveries + 1)
            self.score_and_store(
                [job],
                batch_id=new_id(),
                claimed_at=claimed_at,
                deliveries={job.entry_id: deliveries + 1},
            )
            return
        cause = exc.__cause__ or exc
        fields = job.fields or {b"job_id": job.job_id.encode()}
        reason = f"failed on each of {deliveries} deliveries: {describe_error(exc, 'failed')}"
        self.dead_letters.send(
            job.entry_id,
            fields,
            reason=reason,
            exc_type=type(cause).__name__,
            deliveries=deliveries,
            attempts=deliveries,
        )

    def _link_spans(
        self,
        jobs: list[Job],
        b: Span,
        *,
        batch_id: str,
        packed: float,
        sent: float,
        phases: list[list[float]],
    ) -> None:
        """Each job's pack / forward / head spans, in its own trace, at the batch's times
        (the leader's clock), with the batch id that leads to the batch's trace."""
        lead = phases[self.loaded.scorer.layout.tp_rank]
        t = b.start_wall
        forward_end = t + sent + lead[2 * PHASES.index("forward") + 1]
        head_end = t + sent + max(lead)  # head and d2h
        for job in jobs:
            link: dict[str, Any] = {
                "carrier": job.request.trace,
                "job_id": job.job_id,
                "batch_id": batch_id,
            }
            record("pack", start_time=t, end_time=t + packed, **link)
            record("forward", start_time=t + packed, end_time=forward_end, **link)
            record("head", start_time=forward_end, end_time=head_end, **link)

    def _record_throughput(self, *, jobs: int, tokens: int) -> None:
        """One entry per batch on the throughput stream (`teacherq status` tokens/s)."""
        try:
            self.r.xadd(
                throughput_stream(self.streams.queue),
                {"jobs": jobs, "tokens": tokens, "consumer": self.consumer},
                maxlen=THROUGHPUT_MAXLEN,
                approximate=True,
            )
        except redis.RedisError as exc:  # statistics only: never stop the loop for them
            log.warning("throughput.record_failed", error=str(exc))
