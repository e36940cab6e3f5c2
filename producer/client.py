"""TeacherClient: submit teacher jobs, wait for their results, cancel them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any, cast

import redis
import structlog

from producer import protocol
from producer.progress import WaitProgress, track_wait
from shared import keys, weights
from shared.errors import QueueFull
from shared.messages import Limits, TeacherRequest, TeacherResult, encode_job
from shared.redis_server import connect
from shared.results import decode_record
from shared.settings import Settings, load_settings
from shared.storage import ObjectStore
from shared.streams import Entry, Fields, StreamReply, Streams
from shared.tracing import span
from shared.weights import UpdateRequest

log = structlog.get_logger("teacherq.client")


class TeacherClient:
    """Submit jobs to a teacherq queue and collect their results.

    With no arguments, settings come from the environment (TEACHERQ_*), and with no Redis URL
    the embedded server under ./.teacherq/ is started or attached to.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        client: redis.Redis | None = None,
        store: ObjectStore | None = None,
    ) -> None:
        self.settings = settings or load_settings()
        self.queue = self.settings.queue.name
        self.r = client or connect(self.settings.redis)
        self.streams = Streams(self.r, self.queue, self.settings.queue.group)
        self._store = store

    @property
    def store(self) -> ObjectStore:
        """The object store bulk results are read from (opened on first use)."""
        if self._store is None:
            s = self.settings.storage
            self._store = ObjectStore.from_url(
                s.url,
                endpoint=s.endpoint,
                region=s.region,
                access_key_id=s.access_key_id,
                secret_access_key=s.secret_access_key,
            )
        return self._store

    def limits(self) -> Limits:
        """What this queue accepts; the vocabulary comes from settings or the live consumers."""
        advertised = None
        if self.settings.model.vocab_size is None:
            advertised = self.r.hget(keys.model_key(self.queue), "vocab_size")
        return protocol.limits(self.settings, advertised)

    def submit(self, requests: Iterable[TeacherRequest | dict[str, Any]]) -> list[str]:
        """Validate and enqueue requests; returns their job ids in order.

        Every request is validated before any is enqueued, so one bad request raises
        InvalidJob (naming its index and the problem) and enqueues nothing. A job id that was
        submitted before is not enqueued again: submit is idempotent. Jobs without a job_id of
        their own are named after their content and the queue's weight generation, so after
        `update_weights` the same tokens are computed again by the new weights; a stored
        result older than a request's `min_model_generation` is recomputed.
        """
        generation = protocol.served_generation(
            self.r.hget(keys.weights_key(self.queue), "generation")
        )
        prepared = protocol.prepare(
            requests, limits=self.limits(), settings=self.settings, generation=generation
        )
        self.streams.ensure_group()
        ids = []
        for p in prepared:
            req = p.request
            self._wait_for_room(req.num_tokens)
            with span("submit", job_id=p.job_id, tokens=req.num_tokens) as s:
                traced = req.model_copy(update={"trace": s.carrier})
                fields = encode_job(traced, job_id=p.job_id)
                entry = self.streams.submit(
                    p.job_id, fields, tokens=req.num_tokens, min_generation=p.min_generation
                )
                s.set(enqueued=entry is not None)
            ids.append(p.job_id)
        return ids

    def _wait_for_room(self, tokens: int) -> None:
        """Backpressure: block (or raise, by setting) while the queue holds more pending
        tokens than queue.max_pending_tokens. Wakes on completions, never sleep-polls."""
        q = self.settings.queue
        pending = self.streams.pending_tokens()
        if protocol.has_room(pending, tokens, self.settings):
            return
        if q.backpressure == "raise":
            raise QueueFull(
                f"queue {self.queue} holds {pending} pending tokens; adding {tokens} would "
                f"exceed queue.max_pending_tokens={q.max_pending_tokens}"
            )
        deadline = time.monotonic() + q.backpressure_timeout_s
        cursor = self._done_cursor()
        log.info("submit.backpressure", pending_tokens=pending, limit=q.max_pending_tokens)
        while True:
            pending = self.streams.pending_tokens()
            if protocol.has_room(pending, tokens, self.settings):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise QueueFull(
                    f"queue {self.queue} stayed above queue.max_pending_tokens="
                    f"{q.max_pending_tokens} for {q.backpressure_timeout_s:.0f}s"
                )
            reply = self.r.xread({self.streams.done: cursor}, block=int(min(left, 1) * 1000))
            for _stream, entries in cast(StreamReply, reply) or []:
                cursor = entries[-1][0]

    def results(self, job_ids: Sequence[str]) -> list[TeacherResult | None]:
        """Results of finished jobs, None for jobs not finished yet (no waiting)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.result_key(self.queue, job_id))
        out: list[TeacherResult | None] = []
        for fields in pipe.execute():
            out.append(decode_record(fields, store=self.store) if fields else None)
        return out

    def wait(
        self,
        job_ids: Sequence[str],
        *,
        timeout: float | None = None,
        progress: bool | WaitProgress | None = None,
    ) -> list[TeacherResult]:
        """Block until every job has a result (success or failure) and return them in order.

        Blocks on the completion stream (XREAD BLOCK), never sleep-polls. Failed and cancelled
        jobs come back with `error` set. Raises TimeoutError if `timeout` seconds pass first.
        `progress` shows a bar (jobs, tokens, rate, ETA) on stderr: None means when stderr is
        a terminal; pass a `producer.progress.WaitProgress` to give totals or a console.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        # Note where the completion stream ends *before* reading results: a job finishing in
        # between is then seen on the stream.
        cursor = self._done_cursor()
        found: dict[str, TeacherResult] = {}
        pending = set(job_ids)
        check = list(pending)
        with track_wait(job_ids, progress) as tracker:
            while True:
                for job_id, res in zip(check, self.results(check), strict=True):
                    if res is not None:
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
                announced = set()
                for _stream, entries in cast(StreamReply, reply) or []:
                    for entry_id, fields in entries:
                        cursor = entry_id
                        announced.add(fields.get(b"job_id", b"").decode())
                check = list(announced & pending)

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
        is replaced by a `cancelled` failure. Waiters get that failure."""
        record = protocol.cancel_record(self.queue, job_id)
        # One transaction: no consumer write can land between the delete and the rewrite.
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(keys.result_key(self.queue, job_id))
        self.streams.complete(
            job_id=job_id,
            entry_id="",
            status="failed",
            record=record,
            ttl_s=self.settings.queue.result_ttl_s,
            client=pipe,
        )
        pipe.execute()

    def update_weights(
        self, path: str, *, wait: bool = True, timeout: float = 1800.0
    ) -> UpdateRequest:
        """Make every replica of this queue drain and reload from `path` (a Hugging Face or
        Megatron checkpoint directory they can read). A concurrent request for the same path
        joins the running update; one for another path raises UpdateInProgress. With `wait`,
        blocks until every live replica serves the new generation."""
        req = weights.request_update(self.r, self.queue, path)
        if wait:
            weights.wait_done(self.r, self.queue, req.generation, timeout_s=timeout)
        return req

    def close(self) -> None:
        """Close the Redis connection pool."""
        self.r.close()

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
