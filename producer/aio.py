"""AsyncTeacherClient: the teacher client for asyncio trainers (redis.asyncio, obstore async).

    async with AsyncTeacherClient() as client:
        ids = await client.submit(requests)
        async for result in client.as_completed(ids, timeout=600):
            ...

Same semantics as `TeacherClient` (the two share `producer.protocol`): idempotent job ids,
the same validation, result decoding and timeouts. Nothing blocks the event loop: Redis calls
go through redis.asyncio, bulk results are read with obstore's async API, and every waiter of
one client shares a single reader of the completion stream (`_Completions`), so thousands of
concurrent `wait`/`as_completed` calls hold one blocking XREAD, not one connection each.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, cast

import redis
import redis.asyncio

from producer import protocol
from shared import keys
from shared.errors import JobFailed, QueueFull, UnknownJob
from shared.log import get_logger
from shared.memory import MemoryInfo
from shared.messages import Limits, TeacherRequest, TeacherResult, encode_job
from shared.redis_client import (
    await_replicas,
    connect,
    connect_async,
    execute_scripted_async,
    read_memory_async,
    run_script_async,
)
from shared.results import decode_record, record_object
from shared.settings import Settings, load_settings
from shared.storage import ObjectStore
from shared.streams import COMPLETE_SCRIPT, SUBMIT_SCRIPT, Entry, Fields, complete_call, submit_call
from shared.trace_store import ensure_sink, release_sink
from shared.tracing import end_span
from shared.weights import served_from_fields

log = get_logger("teacherq.client")

READ_BLOCK_MS = 1000  # the completion reader re-checks for subscribers this often
READ_SLICE = 256  # result records read per pipeline


class AsyncTeacherClient:
    """Submit jobs to a teacherq queue and collect their results from asyncio code.

    With no arguments, settings come from the environment (TEACHERQ_*), and with no Redis URL
    the embedded server under ./.teacherq/ is started or attached to (that start blocks once,
    in the constructor). Use `async with`, or call `aclose()`. Spans are recorded as by
    `TeacherClient` (`trace_process`).
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        client: redis.asyncio.Redis | None = None,
        store: ObjectStore | None = None,
        max_connections: int = 64,
        trace_process: str | None = "teacherq client",
    ) -> None:
        self.settings = settings or load_settings()
        self.queue = self.settings.queue.name
        self.r = client or connect_async(self.settings.redis, max_connections=max_connections)
        # As TeacherClient: `submit` spans recorded, by a sink thread on its own (blocking)
        # connection, off the event loop; `aclose` lets go.
        self._holds_sink = trace_process is not None and ensure_sink(
            lambda: connect(self.settings.redis), self.settings.queue, process=trace_process
        )
        self._store = store
        self._submit = self.r.register_script(SUBMIT_SCRIPT)
        self._complete = self.r.register_script(COMPLETE_SCRIPT)
        self._group_ready = False
        self._completions = _Completions(self.r, keys.done_stream(self.queue))
        self._sync: redis.Redis | None = None

    def _blocking(self) -> redis.Redis:
        """A blocking client of the same Redis (for WAIT, run in a worker thread)."""
        if self._sync is None:
            self._sync = connect(self.settings.redis)
        return self._sync

    @property
    def store(self) -> ObjectStore:
        """The object store bulk results are read from (opened on first use)."""
        if self._store is None:
            self._store = ObjectStore.from_settings(self.settings.storage)
        return self._store

    async def limits(self) -> Limits:
        """What this queue accepts; the vocabulary comes from settings or the live consumers."""
        advertised = await self.r.hmget(keys.model_key(self.queue), list(protocol.MODEL_FIELDS))
        return protocol.limits(self.settings, cast(list[Any], advertised))

    async def submit(self, requests: Iterable[TeacherRequest | dict[str, Any]]) -> list[str]:
        """Validate and enqueue requests; returns their job ids in order (as
        `TeacherClient.submit`: all validated first, idempotent, named after the weight
        generation, jobs that share a prompt in one transaction, backpressure by setting)."""
        raw = cast(Fields, await self.r.hgetall(keys.weights_key(self.queue)))
        prepared = protocol.prepare(
            requests,
            limits=await self.limits(),
            settings=self.settings,
            generation=protocol.job_generation(served_from_fields(raw)),
        )
        await self._ensure_group()
        enqueued = 0
        for unit in protocol.units(prepared, self.settings):
            if protocol.memory_check_due(enqueued, len(unit)):
                await self._wait_for_memory()
            await self._enqueue(unit)
            enqueued += len(unit)
        return [p.job_id for p in prepared]

    async def _enqueue(self, jobs: list[protocol.Prepared]) -> None:
        """One transaction per unit, one `submit` span per job (as `TeacherClient._enqueue`)."""
        await self._wait_for_room(sum(p.request.num_tokens for p in jobs))
        spans = [protocol.submit_span(p) for p in jobs]

        async def fill(pipe: Any) -> None:
            for p, s in zip(jobs, spans, strict=True):
                req = p.request
                fields = encode_job(req.model_copy(update={"trace": s.carrier}), job_id=p.job_id)
                keys_, argv = submit_call(
                    self.queue,
                    p.job_id,
                    fields,
                    tokens=req.num_tokens,
                    min_generation=p.min_generation,
                )
                await run_script_async(self._submit, keys=keys_, args=argv, client=pipe)

        try:
            entries = await execute_scripted_async(self.r, fill)
            if self.settings.redis.min_replicas_acked:  # WAIT, on a blocking connection
                await asyncio.to_thread(
                    await_replicas, self._blocking(), self.queue, self.settings.redis
                )
        except BaseException as exc:
            for s in spans:
                end_span(s, exc)
            raise
        protocol.end_submit_spans(spans, entries)

    async def _ensure_group(self) -> None:
        """As `Streams.ensure_group`: an existing group is never an error, also while Redis
        is full (looked up first; an OOM refusal re-checked against the group)."""
        if self._group_ready or await self._group_exists():
            self._group_ready = True
            return
        try:
            await self.r.xgroup_create(
                keys.jobs_stream(self.queue), self.settings.queue.group, id="0", mkstream=True
            )
        except redis.ResponseError as exc:  # OutOfMemoryError is one
            if "BUSYGROUP" not in str(exc) and not await self._group_exists():
                raise
        self._group_ready = True

    async def _group_exists(self) -> bool:
        try:
            groups = await self.r.xinfo_groups(keys.jobs_stream(self.queue))
        except redis.ResponseError:  # no such stream yet
            return False
        group = self.settings.queue.group
        return any(g["name"] in (group, group.encode()) for g in groups)

    async def _pending_tokens(self) -> int:
        return int(await self.r.get(keys.pending_tokens_key(self.queue)) or 0)

    async def _memory_full(self) -> MemoryInfo | None:
        info = await read_memory_async(self.r, keys.jobs_stream(self.queue))
        return info if protocol.memory_full(self.settings, info) else None

    async def _wait_for_memory(self) -> None:
        """Memory backpressure as `TeacherClient._wait_for_memory`: wait (woken by
        completions, at least each second) or raise QueueFull while Redis uses more than
        queue.max_memory_fraction of maxmemory."""
        info = await self._memory_full()
        if info is None:
            return
        q = self.settings.queue
        if q.backpressure == "raise":
            raise QueueFull(protocol.memory_message(self.settings, info))
        log.warning(
            "submit.memory_backpressure", queue=self.queue, used=info.used, limit=info.limit
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + q.backpressure_timeout_s
        async with self._completions.subscribe(None) as sub:
            while (info := await self._memory_full()) is not None:
                left = deadline - loop.time()
                if left <= 0:
                    raise QueueFull(
                        protocol.memory_message(self.settings, info)
                        + f" (waited {q.backpressure_timeout_s:.0f}s)"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sub.next(), min(left, 1.0))

    async def _wait_for_room(self, tokens: int) -> None:
        """Backpressure as `TeacherClient._wait_for_room`: wait (woken by completions) or
        raise QueueFull while the queue holds more than queue.max_pending_tokens."""
        q = self.settings.queue
        pending = await self._pending_tokens()
        if protocol.has_room(pending, tokens, self.settings):
            return
        if q.backpressure == "raise":
            raise QueueFull(protocol.full_message(self.settings, pending, tokens))
        log.info("submit.backpressure", pending_tokens=pending, limit=q.max_pending_tokens)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + q.backpressure_timeout_s
        async with self._completions.subscribe(None) as sub:
            while not protocol.has_room(await self._pending_tokens(), tokens, self.settings):
                left = deadline - loop.time()
                if left <= 0:
                    raise QueueFull(protocol.stayed_full_message(self.settings))
                # Acks that free room need not announce a result; look again at least each
                # second.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sub.next(), min(left, 1.0))

    async def results(
        self, job_ids: Sequence[str], *, strict: bool = True
    ) -> list[TeacherResult | None]:
        """Results of finished jobs, None for jobs not finished yet (no waiting); as
        `TeacherClient.results`: unknown ids raise `UnknownJob` (None with `strict=False`),
        and queue.delete_result_on_read deletes the records returned."""
        records: list[Fields] = []
        # In slices: packing and parsing one pipeline runs on the event loop, so thousands of
        # ids in one would hold it for a noticeable time; between slices other tasks run.
        for i in range(0, len(job_ids), READ_SLICE):
            async with self.r.pipeline(transaction=False) as pipe:
                for job_id in job_ids[i : i + READ_SLICE]:
                    pipe.hgetall(keys.result_key(self.queue, job_id))
                records += cast(list[Fields], await pipe.execute())
            await asyncio.sleep(0)
        if strict:
            await self.check_known([j for j, rec in zip(job_ids, records, strict=True) if not rec])
        out = list(await asyncio.gather(*(self._decode(f) for f in records)))
        if self.settings.queue.delete_result_on_read:
            read = [
                keys.result_key(self.queue, j)
                for j, res in zip(job_ids, out, strict=True)
                if res is not None
            ]
            if read:
                await self.r.unlink(*read)
        return out

    async def check_known(self, job_ids: Sequence[str]) -> None:
        """Raise `UnknownJob` naming the ids never submitted to this queue (as
        `TeacherClient.check_known`)."""
        if not job_ids:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(
                    keys.submitted_key(self.queue, job_id), keys.result_key(self.queue, job_id)
                )
            found = await pipe.execute()
        unknown = [j for j, n in zip(job_ids, found, strict=True) if not n]
        if unknown:
            raise UnknownJob(unknown, self.queue)

    async def _decode(self, fields: Fields) -> TeacherResult | None:
        if not fields:
            return None
        obj = record_object(fields)
        blob = None
        if obj:
            blob = await self.store.get_async(obj["key"], checksum=obj["checksum"])
        return decode_record(fields, store=None, blob=blob)

    async def wait(
        self,
        job_ids: Sequence[str],
        *,
        timeout: float | None = None,
        raise_on_error: bool = False,
    ) -> list[TeacherResult]:
        """Wait until every job has a result (success or failure) and return them in order.
        Failed and cancelled jobs come back with `error` set, or, with `raise_on_error`, raise
        `JobFailed` as soon as one is seen. Raises TimeoutError if `timeout` seconds pass
        first; without a timeout, unknown ids raise `UnknownJob` at once."""
        found: dict[str, TeacherResult] = {}
        async for res in self.as_completed(job_ids, timeout=timeout):
            if raise_on_error and not res.ok:
                raise JobFailed(res.job_id, res.error or "failed")
            found[res.job_id] = res
        return [found[j] for j in job_ids]

    async def as_completed(
        self, job_ids: Sequence[str], *, timeout: float | None = None
    ) -> AsyncIterator[TeacherResult]:
        """Yield each job's result as soon as it exists (each job once, in completion order).
        Raises TimeoutError naming how many are left if `timeout` seconds pass first; without
        a timeout, ids never submitted to this queue raise `UnknownJob` at once."""
        pending = set(job_ids)
        total = len(pending)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        # Subscribe before reading results: a job finishing in between is then announced.
        async with self._completions.subscribe(pending) as sub:
            check = list(pending)
            first = True
            while True:
                if check:
                    got = await self.results(check, strict=first and timeout is None)
                    for job_id, res in zip(check, got, strict=True):
                        if res is not None and job_id in pending:
                            pending.discard(job_id)
                            sub.discard(job_id)
                            yield res
                first = False
                if not pending:
                    return
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{len(pending)} of {total} jobs not done")
                try:
                    announced = await asyncio.wait_for(sub.next(), left)
                except TimeoutError:
                    raise TimeoutError(f"{len(pending)} of {total} jobs not done") from None
                check = [j for j in announced if j in pending]

    def watch(self) -> contextlib.AbstractAsyncContextManager[_Subscription]:
        """Every job id announced on the queue's completion stream while the block runs:
        `await sub.next()` returns the ids announced since the last call (the same single
        reader as `wait` serves it; the HTTP gateway waits for all its requests this way)."""
        return self._completions.subscribe(None)

    async def cancel(self, job_id: str) -> None:
        """Cancel a job: it is not computed if not started yet, and a result it already has
        is replaced by a `cancelled` failure. Waiters get that failure. Raises `UnknownJob`
        (and changes nothing) for an id never submitted to this queue."""
        await self.check_known([job_id])
        keys_, argv = complete_call(
            self.queue,
            self.settings.queue.group,
            job_id=job_id,
            entry_id="",
            status="failed",
            record=protocol.cancel_record(self.queue, job_id),
            ttl_s=self.settings.queue.result_ttl_s,
        )
        # One transaction: no consumer write can land between the delete and the rewrite.

        async def fill(pipe: Any) -> None:
            pipe.delete(keys.result_key(self.queue, job_id))
            await run_script_async(self._complete, keys=keys_, args=argv, client=pipe)

        await execute_scripted_async(self.r, fill)

    async def aclose(self) -> None:
        """Stop the completion reader and close the Redis connection pool."""
        await self._completions.stop()
        await self.r.aclose()
        if self._sync is not None:
            self._sync.close()
        if self._holds_sink:  # the sink's last write blocks: off the event loop
            self._holds_sink = False
            await asyncio.to_thread(release_sink)

    async def __aenter__(self) -> AsyncTeacherClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Subscription:
    """Job ids one waiter wants (None: every completion); announced ids queue up here."""

    def __init__(self, owner: _Completions, job_ids: set[str] | None) -> None:
        self._owner = owner
        self.job_ids = job_ids
        self._queue: asyncio.Queue[str | BaseException] = asyncio.Queue()

    def put(self, item: str | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self) -> list[str]:
        """The ids announced since the last call (waits for at least one)."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                raise RuntimeError(f"the completion reader failed: {item}") from item
        return cast(list[str], items)

    def discard(self, job_id: str) -> None:
        """Stop listening for one job (it has its result)."""
        self._owner.forget(self, job_id)


class _Completions:
    """One reader of the completion stream per client, dispatching announced job ids to the
    subscribed waiters. It starts with the first subscriber (from the stream's current end,
    read before the subscriber looks at results, so nothing finishing in between is missed)
    and stops when none is left."""

    def __init__(self, r: redis.asyncio.Redis, stream: str) -> None:
        self.r = r
        self.stream = stream
        self._by_job: dict[str, set[_Subscription]] = {}
        self._every: set[_Subscription] = set()
        self._task: asyncio.Task[None] | None = None
        self._cursor: bytes | str = "0-0"
        self._starting = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def subscribe(self, job_ids: Iterable[str] | None) -> AsyncIterator[_Subscription]:
        """Listen for completions of `job_ids` (None: all) while the block runs."""
        sub = _Subscription(self, None if job_ids is None else set(job_ids))
        if sub.job_ids is None:
            self._every.add(sub)
        else:
            for job_id in sub.job_ids:
                self._by_job.setdefault(job_id, set()).add(sub)
        try:
            await self._ensure_reader()
            yield sub
        finally:
            self._every.discard(sub)
            for job_id in list(sub.job_ids or ()):
                self.forget(sub, job_id)

    def forget(self, sub: _Subscription, job_id: str) -> None:
        if sub.job_ids is not None:
            sub.job_ids.discard(job_id)
        subs = self._by_job.get(job_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._by_job[job_id]

    def _wanted(self) -> bool:
        return bool(self._by_job or self._every)

    async def _ensure_reader(self) -> None:
        async with self._starting:
            if self._task is not None and not self._task.done():
                return
            last = cast(list[Entry], await self.r.xrevrange(self.stream, count=1))
            self._cursor = last[0][0] if last else "0-0"
            self._task = asyncio.create_task(self._run(), name=f"teacherq reader {self.stream}")

    async def _run(self) -> None:
        delay = 0.05
        try:
            while self._wanted():
                try:
                    reply = await self.r.xread(
                        {self.stream: self._cursor}, block=READ_BLOCK_MS, count=10_000
                    )
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    # The client already retried with backoff; keep the cursor and go on.
                    log.warning("client.completions_retry", error=str(exc), delay_s=delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                delay = 0.05
                self._cursor, ids = protocol.announced(reply, self._cursor)
                for job_id in ids:
                    for sub in list(self._by_job.get(job_id, ())):
                        sub.put(job_id)
                    for sub in self._every:
                        sub.put(job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Waiters must not hang on a dead reader: hand them the error.
            log.exception("client.completions_failed")
            for sub in {s for subs in self._by_job.values() for s in subs} | self._every:
                sub.put(exc)
            raise

    async def stop(self) -> None:
        """Cancel the reader (on close)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
