"""TeacherClient: submit teacher jobs, wait for their results, cancel them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import redis
import structlog

from shared import keys
from shared.errors import InvalidJob
from shared.messages import (
    Limits,
    TeacherRequest,
    TeacherResult,
    check_limits,
    content_job_id,
    encode_job,
    parse_request,
)
from shared.redis_server import connect
from shared.results import decode_record, encode_record
from shared.settings import Settings, load_settings
from shared.storage import ObjectStore
from shared.streams import Streams
from shared.tracing import span

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
        q = self.settings.queue
        vocab = self.settings.model.vocab_size
        if vocab is None:
            advertised = self.r.hget(keys.model_key(self.queue), "vocab_size")
            vocab = int(advertised) if advertised else None
        return Limits(
            max_input_tokens=q.max_input_tokens,
            max_label_width=q.max_label_width,
            max_top_k=q.max_top_k,
            max_sample_n=q.max_sample_n,
            vocab_size=vocab,
        )

    def submit(self, requests: Iterable[TeacherRequest | dict[str, Any]]) -> list[str]:
        """Validate and enqueue requests; returns their job ids in order.

        Every request is validated before any is enqueued, so one bad request raises
        InvalidJob (naming its index and the problem) and enqueues nothing. A job id that was
        submitted before is not enqueued again: submit is idempotent.
        """
        limits = self.limits()
        prepared: list[tuple[str, TeacherRequest]] = []
        for i, raw in enumerate(requests):
            try:
                req = parse_request(raw)
                check_limits(req, limits)
            except InvalidJob as exc:
                raise InvalidJob(f"request {i}: {exc}") from None
            job_id = req.job_id or content_job_id(
                req, queue=self.queue, teacher=self.settings.model.path
            )
            prepared.append((job_id, req))
        self.streams.ensure_group()
        ids = []
        for job_id, req in prepared:
            with span("submit", job_id=job_id, tokens=req.num_tokens) as s:
                traced = req.model_copy(update={"trace": s.carrier})
                fields = encode_job(traced, job_id=job_id)
                entry = self.streams.submit(job_id, fields, tokens=req.num_tokens)
                s.set(enqueued=entry is not None)
            ids.append(job_id)
        return ids

    def results(self, job_ids: Sequence[str]) -> list[TeacherResult | None]:
        """Results of finished jobs, None for jobs not finished yet (no waiting)."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.result_key(self.queue, job_id))
        out: list[TeacherResult | None] = []
        for fields in pipe.execute():
            out.append(decode_record(fields, store=self.store) if fields else None)
        return out

    def wait(self, job_ids: Sequence[str], *, timeout: float | None = None) -> list[TeacherResult]:
        """Block until every job has a result (success or failure) and return them in order.

        Blocks on the completion stream (XREAD BLOCK), never sleep-polls. Failed and cancelled
        jobs come back with `error` set. Raises TimeoutError if `timeout` seconds pass first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        # Note where the completion stream ends *before* reading results: a job finishing in
        # between is then seen on the stream.
        last = self.r.xrevrange(self.streams.done, count=1)
        cursor: bytes | str = last[0][0] if last else "0-0"
        found: dict[str, TeacherResult] = {}
        pending = set(job_ids)
        check = list(pending)
        while True:
            for job_id, res in zip(check, self.results(check), strict=True):
                if res is not None:
                    found[job_id] = res
                    pending.discard(job_id)
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
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    announced.add(fields.get(b"job_id", b"").decode())
            check = list(announced & pending)

    def consumers(self) -> dict[str, dict[str, Any]]:
        """Heartbeat records of the consumers of this queue, by name."""
        raw = self.r.hgetall(keys.consumers_key(self.queue))
        return {k.decode(): json.loads(v) for k, v in raw.items()}

    def consumers_ready(self) -> bool:
        """True when at least one consumer reports itself ready or busy."""
        return any(c.get("state") in ("ready", "busy") for c in self.consumers().values())

    def status(self) -> dict[str, Any]:
        """A snapshot of the queue: depth, lag, pending, dead letters, consumers."""
        self.streams.ensure_group()
        groups = {g["name"].decode(): g for g in self.r.xinfo_groups(self.streams.jobs)}
        g = groups.get(self.streams.group, {})
        now = time.time()
        consumers = {
            name: {**rec, "heartbeat_age_s": round(now - rec.get("time", now), 3)}
            for name, rec in self.consumers().items()
        }
        return {
            "queue": self.queue,
            "jobs_in_stream": self.r.xlen(self.streams.jobs),
            "lag": g.get("lag"),
            "pending": g.get("pending", 0),
            "dead_letters": self.r.xlen(self.streams.dead),
            "results_announced": self.r.xlen(self.streams.done),
            "pending_tokens": self.streams.pending_tokens(),
            "consumers": consumers,
        }

    def cancel(self, job_id: str) -> None:
        """Cancel a job: it is not computed if not started yet, and a result it already has
        is replaced by a `cancelled` failure. Waiters get that failure."""
        record = encode_record(
            TeacherResult(job_id=job_id, error="cancelled by the user"),
            queue=self.queue,
            store=None,
            inline_max_bytes=0,
        )
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

    def close(self) -> None:
        """Close the Redis connection pool."""
        self.r.close()

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
