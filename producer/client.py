"""TeacherClient: submit teacher jobs, wait for their results, cancel them."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis

from producer import protocol
from producer.progress import WaitProgress, track_wait
from shared import keys, weights
from shared.checkpoint_probe import probe_checkpoint
from shared.errors import JobFailed, QueueFull, UnknownJob
from shared.log import get_logger
from shared.memory import MemoryInfo, read_memory
from shared.messages import Limits, TeacherRequest, TeacherResult, encode_job
from shared.redis_client import await_replicas, connect, execute_scripted
from shared.results import decode_records
from shared.settings import Settings, load_settings
from shared.storage import ObjectStore
from shared.streams import Entry, Fields, StreamReply, Streams
from shared.trace_store import ensure_sink, release_sink
from shared.tracing import end_span
from shared.weights import UpdateRequest

log = get_logger("teacherq.client")


class TeacherClient:
    """Submit jobs to a teacherq queue and collect their results.

    With no arguments, settings come from the environment (TEACHERQ_*), and with no Redis URL
    the embedded server under ./.teacherq/ is started or attached to. Each job's `submit` span
    is recorded (`teacherq trace JOB_ID`) under `trace_process` unless the process already
    chose a span sink; None records nothing.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        client: redis.Redis | None = None,
        store: ObjectStore | None = None,
        trace_process: str | None = "teacherq client",
    ) -> None:
        self.settings = settings or load_settings()
        self.queue = self.settings.queue.name
        self.r = client or connect(self.settings.redis)
        self.streams = Streams(self.r, self.queue, self.settings.queue.group)
        self._store = store
        # Unless this process already records spans, its `submit` spans go to Redis (and to an
        # OTLP collector if OTEL_EXPORTER_OTLP_* is set), as the CLI's do; `close` lets go.
        self._holds_sink = trace_process is not None and ensure_sink(
            self.r, self.settings.queue, process=trace_process
        )

    @property
    def store(self) -> ObjectStore:
        """The object store bulk results are read from (opened on first use)."""
        if self._store is None:
            self._store = ObjectStore.from_settings(self.settings.storage)
        return self._store

    def limits(self) -> Limits:
        """What this queue accepts; the vocabulary comes from settings or the live consumers."""
        advertised = self.r.hmget(keys.model_key(self.queue), list(protocol.MODEL_FIELDS))
        return protocol.limits(self.settings, cast(list[Any], advertised))

    def submit(self, requests: Iterable[TeacherRequest | dict[str, Any]]) -> list[str]:
        """Validate and enqueue requests; returns their job ids in order.

        Every request is validated before any is enqueued, so one bad request raises
        InvalidJob (naming its index and the problem) and enqueues nothing. A job id that was
        submitted before is not enqueued again: submit is idempotent. Jobs without a job_id of
        their own are named after their content and the queue's weight generation, so after
        `update_weights` the same tokens are computed again by the new weights; a stored
        result older than a request's `min_model_generation` is computed again.
        """
        served = weights.current(self.r, self.queue)
        prepared = protocol.prepare(
            requests,
            limits=self.limits(),
            settings=self.settings,
            generation=protocol.job_generation(served),
        )
        self.streams.ensure_group()
        enqueued = 0
        for unit in protocol.units(prepared, self.settings):
            if protocol.memory_check_due(enqueued, len(unit)):
                self._wait_for_memory()
            self._enqueue(unit)
            enqueued += len(unit)
        return [p.job_id for p in prepared]

    def _enqueue(self, jobs: list[protocol.Prepared]) -> None:
        """Enqueue jobs in one transaction: a consumer reads all of them or none, so the
        responses of a GRPO group submitted together meet in one batch and share their
        prompt, even when an idle consumer is blocked on the stream. One `submit` span each."""
        self._wait_for_room(sum(p.request.num_tokens for p in jobs))
        spans = [protocol.submit_span(p) for p in jobs]

        def fill(pipe: Any) -> None:
            for p, s in zip(jobs, spans, strict=True):
                req = p.request
                fields = encode_job(req.model_copy(update={"trace": s.carrier}), job_id=p.job_id)
                self.streams.submit(
                    p.job_id,
                    fields,
                    tokens=req.num_tokens,
                    min_generation=p.min_generation,
                    client=pipe,
                )

        try:
            entries = execute_scripted(self.r, fill)
            await_replicas(self.r, self.queue, self.settings.redis)  # redis.min_replicas_acked
        except BaseException as exc:
            for s in spans:
                end_span(s, exc)
            raise
        protocol.end_submit_spans(spans, entries)

    def _memory_full(self) -> MemoryInfo | None:
        """Redis's memory figures if above queue.max_memory_fraction of maxmemory, else None."""
        info = read_memory(self.r, key=self.streams.jobs)  # the queue's shard on a cluster
        return info if protocol.memory_full(self.settings, info) else None

    def _wait_for_memory(self) -> None:
        """Memory backpressure: block (or raise, by queue.backpressure) while Redis uses more
        than queue.max_memory_fraction of maxmemory."""
        info = self._memory_full()
        if info is None:
            return
        q = self.settings.queue
        if q.backpressure == "raise":
            raise QueueFull(protocol.memory_message(self.settings, info))
        log.warning(
            "submit.memory_backpressure", queue=self.queue, used=info.used, limit=info.limit
        )
        deadline = time.monotonic() + q.backpressure_timeout_s
        cursor = self._done_cursor()
        while (info := self._memory_full()) is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise QueueFull(
                    protocol.memory_message(self.settings, info)
                    + f" (waited {q.backpressure_timeout_s:.0f}s)"
                )
            # Completions are when memory may fall (acks, trims); wake on them, at least 1/s.
            reply = self.r.xread({self.streams.done: cursor}, block=int(min(left, 1) * 1000))
            for _stream, entries in cast(StreamReply, reply) or []:
                cursor = entries[-1][0]

    def _wait_for_room(self, tokens: int) -> None:
        """Backpressure: block (or raise, by setting) while the queue holds more pending
        tokens than queue.max_pending_tokens. Wakes on completions, never sleep-polls."""
        q = self.settings.queue
        pending = self.streams.pending_tokens()
        if protocol.has_room(pending, tokens, self.settings):
            return
        if q.backpressure == "raise":
            raise QueueFull(protocol.full_message(self.settings, pending, tokens))
        deadline = time.monotonic() + q.backpressure_timeout_s
        cursor = self._done_cursor()
        log.info("submit.backpressure", pending_tokens=pending, limit=q.max_pending_tokens)
        while True:
            pending = self.streams.pending_tokens()
            if protocol.has_room(pending, tokens, self.settings):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise QueueFull(protocol.stayed_full_message(self.settings))
            reply = self.r.xread({self.streams.done: cursor}, block=int(min(left, 1) * 1000))
            for _stream, entries in cast(StreamReply, reply) or []:
                cursor = entries[-1][0]

    def results(self, job_ids: Sequence[str], *, strict: bool = True) -> list[TeacherResult | None]:
        """Results of finished jobs, None for jobs submitted and not finished yet (no waiting).
        Raises `UnknownJob` naming every id this queue has never seen; `strict=False` returns
        None for those too. With queue.delete_result_on_read, the records returned are deleted
        from Redis."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.result_key(self.queue, job_id))
        records = pipe.execute()
        if strict:
            self.check_known([j for j, rec in zip(job_ids, records, strict=True) if not rec])
        out = decode_records(records, store=self.store)  # objects fetched side by side
        if self.settings.queue.delete_result_on_read:
            # Read once, then gone from Redis (queue.delete_result_on_read): the record's
            # memory is freed now instead of after result_ttl_s. Bulk objects stay in storage.
            read = [
                keys.result_key(self.queue, j)
                for j, res in zip(job_ids, out, strict=True)
                if res is not None
            ]
            if read:
                self.r.unlink(*read)
        return out

    def check_known(self, job_ids: Sequence[str]) -> None:
        """Raise `UnknownJob` naming the ids never submitted to this queue (no result record,
        no submit marker): a typo must not wait forever or create anything."""
        if not job_ids:
            return
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(keys.submitted_key(self.queue, job_id), keys.result_key(self.queue, job_id))
        unknown = [j for j, n in zip(job_ids, pipe.execute(), strict=True) if not n]
        if unknown:
            raise UnknownJob(unknown, self.queue)

    def wait(
        self,
        job_ids: Sequence[str],
        *,
        timeout: float | None = None,
        progress: bool | WaitProgress = False,
        raise_on_error: bool = False,
    ) -> list[TeacherResult]:
        """Block until every job has a result (success or failure) and return them in order.

        Blocks on the completion stream (XREAD BLOCK), never sleep-polls. Failed and cancelled
        jobs come back with `error` set, or, with `raise_on_error`, raise `JobFailed` as soon
        as one is seen. Raises TimeoutError if `timeout` seconds pass first; without a timeout,
        ids never submitted to this queue raise `UnknownJob` at once instead of waiting forever.
        `progress=True` shows a bar (jobs, tokens, rate, ETA) on stderr; pass a
        `producer.progress.WaitProgress` to give totals or a console. The library never draws
        one unasked.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        # Note where the completion stream ends *before* reading results: a job finishing in
        # between is then seen on the stream.
        cursor = self._done_cursor()
        found: dict[str, TeacherResult] = {}
        pending = set(job_ids)
        check = list(pending)
        first = True
        with track_wait(job_ids, progress) as tracker:
            while True:
                got = self.results(check, strict=first and timeout is None)
                first = False
                for job_id, res in zip(check, got, strict=True):
                    if res is not None:
                        if raise_on_error and not res.ok:
                            raise JobFailed(job_id, res.error or "failed")
                        found[job_id] = res
                        pending.discard(job_id)
                        tracker.advance(job_id, res)
                if not pending:
                    return [found[j] for j in job_ids]
                block_ms = 1000
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{len(pending)} of {len(job_ids)} jobs not done")
                    block_ms = max(1, min(block_ms, int(left * 1000)))
                reply = self.r.xread({self.streams.done: cursor}, block=block_ms, count=10_000)
                cursor, announced = protocol.announced(reply, cursor)
                check = list(set(announced) & pending)

    def _done_cursor(self) -> bytes | str:
        """The id of the completion stream's last entry ("0-0" while empty): read from there,
        XREAD sees only completions that come after."""
        last = cast(list[Entry], self.r.xrevrange(self.streams.done, count=1))
        return last[0][0] if last else "0-0"

    def consumers(self) -> dict[str, dict[str, Any]]:
        """Heartbeat records of the consumers of this queue, by name."""
        raw = cast(Fields, self.r.hgetall(keys.consumers_key(self.queue)))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def consumers_ready(self) -> bool:
        """True when at least one consumer reports itself ready or busy."""
        return any(c.get("state") in ("ready", "busy") for c in self.consumers().values())

    def status(self) -> dict[str, Any]:
        """A snapshot of the queue: backlog, work in flight, dead letters, consumers and
        throughput (see `producer.status.snapshot` for each figure)."""
        from producer.status import snapshot

        return snapshot(self.r, self.queue, self.streams.group)

    def cancel(self, job_id: str) -> None:
        """Cancel a job: it is not computed if not started yet, and a result it already has
        is replaced by a `cancelled` failure. Waiters get that failure. Raises `UnknownJob`
        (and changes nothing) for an id never submitted to this queue."""
        self.check_known([job_id])
        record = protocol.cancel_record(self.queue, job_id)

        # One transaction: no consumer write can land between the delete and the rewrite.
        def fill(pipe: Any) -> None:
            pipe.delete(keys.result_key(self.queue, job_id))
            self.streams.complete(
                job_id=job_id,
                entry_id="",
                status="failed",
                record=record,
                ttl_s=self.settings.queue.result_ttl_s,
                client=pipe,
            )

        execute_scripted(self.r, fill)

    def update_weights(
        self, path: str, *, wait: bool = True, timeout: float = 1800.0, check: bool = True
    ) -> UpdateRequest:
        """Make every replica of this queue drain and reload from `path` (a Hugging Face or
        Megatron checkpoint directory they can read).

        With `check`, the path is first looked at here (exists, parses, a served family:
        `shared.checkpoint_probe`) and refused with `InvalidCheckpoint` before anything is
        committed; pass `check=False` for a path only the consumers can see. A concurrent
        request for the same path joins the running update; one for another path raises
        UpdateInProgress. With `wait`, blocks until every live replica serves the new
        generation, raising `WeightUpdateFailed` as soon as one reports it cannot load it
        (every consumer then keeps its previous weights). With no live consumer there is
        nothing to wait for: the next consumer to start applies the update."""
        if check:
            probe_checkpoint(path)
        return self._request_weights(path, wait=wait, timeout=timeout)

    def reset_weights(self, *, wait: bool = True, timeout: float = 1800.0) -> UpdateRequest:
        """Return every replica to its own configured model (`model.path`, or the tiny preset),
        undoing earlier `update_weights`; waits like `update_weights`."""
        return self._request_weights(weights.CONFIGURED, wait=wait, timeout=timeout)

    def _request_weights(self, path: str, *, wait: bool, timeout: float) -> UpdateRequest:
        fresh_s = self.settings.consumer.live_after_s
        # An update whose consumers all died mid-way has nobody left to finish it: replace it.
        orphaned = not weights.live_replicas(self.r, self.queue, fresh_s=fresh_s)
        req = weights.request_update(self.r, self.queue, path, take_over=orphaned)
        log.debug(
            "weights.requested",
            path=path or "(configured)",
            generation=req.generation,
            coalesced=req.coalesced,
        )
        if orphaned and not weights.live_replicas(self.r, self.queue, fresh_s=fresh_s):
            return dataclasses.replace(req, no_consumer=True)
        if wait:
            weights.wait_done(self.r, self.queue, req.generation, timeout_s=timeout)
        return req

    def close(self) -> None:
        """Close the Redis connection pool; the last client open writes out the `submit`
        spans it recorded and stops recording."""
        if self._holds_sink:
            self._holds_sink = False
            release_sink()
        self.r.close()

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
