"""How the gateway turns HTTP requests into queue jobs and back: `Jobs.run`.

- **Submit in batches.** Requests that arrive together (the same loop tick, or within
  `gateway.coalesce_ms`) are enqueued by one `AsyncTeacherClient.submit` call: one set of Redis
  round trips for many requests, never a connection each. A batch the queue refuses (an
  invalid request, a full queue) is submitted again request by request, so each request gets
  its own answer; the gateway's job ids are fixed before submit, so this is idempotent.
- **Wait through one reader.** One subscription to the completion stream serves every waiting
  request: announced ids are matched against the waiting jobs and their results read in one
  pipeline per announcement batch.
- **Give up cleanly.** A request past its deadline gets TimeoutError (504 upstream); a
  request whose client went away (aiohttp cancels its handler) cancels its jobs, also those
  still on their way to the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from producer import protocol
from producer.aio import AsyncTeacherClient
from shared import keys
from shared.errors import InvalidJob, QueueFull
from shared.log import get_logger
from shared.messages import TeacherRequest, TeacherResult
from shared.streams import Fields
from shared.weights import served_from_fields

log = get_logger("teacherq.gateway")

MAX_BATCH = 1024  # requests per submit call


@dataclass
class _Pending:
    requests: list[TeacherRequest]
    done: asyncio.Future[list[str]] = field(repr=False)


class Jobs:
    """Submit jobs in coalesced batches and hand each waiting request its results."""

    def __init__(self, client: AsyncTeacherClient, *, coalesce_s: float) -> None:
        self.client = client
        self.coalesce_s = coalesce_s
        self._queue: list[_Pending] = []
        self._flusher: asyncio.Task[None] | None = None
        self._waiting: dict[str, asyncio.Future[TeacherResult]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self.submits = 0  # submit calls made (reported by /get_loads)
        self.submitted = 0  # jobs they carried

    async def start(self) -> None:
        """Start the completion reader (before any job is submitted)."""
        self._reader = asyncio.create_task(self._read(), name="teacherq gateway results")
        await self._listening.wait()

    async def stop(self) -> None:
        """Stop the reader and wait for background cancellations."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader

    async def run(
        self,
        requests: Sequence[TeacherRequest],
        *,
        timeout: float,
        own_ids: frozenset[str] = frozenset(),
    ) -> list[TeacherResult]:
        """Submit `requests` (each with its own job id) and return their results in order.

        Raises InvalidJob or QueueFull as submit does, TimeoutError after `timeout` seconds.
        If the caller is cancelled, its jobs are cancelled (those named by a caller's own id,
        `own_ids`, excepted: their results may exist already and are picked up) and
        CancelledError propagates."""
        loop = asyncio.get_running_loop()
        ids = [r.job_id or "" for r in requests]
        assert all(ids), "the gateway names every job before submitting it"
        futures = [self._waiting.setdefault(j, loop.create_future()) for j in ids]
        pending = _Pending(list(requests), loop.create_future())
        try:
            self._enqueue(pending)
            try:
                await asyncio.shield(pending.done)
            except asyncio.CancelledError:
                # Submitted or not yet: the jobs are cancelled once they are in the queue.
                pending.done.add_done_callback(lambda f: self._cancel_later(f, own_ids))
                raise
            try:
                if own_ids:  # submitted before: its result may exist already
                    await self._deliver([j for j in ids if j in own_ids])
                async with asyncio.timeout(timeout):
                    return list(await asyncio.gather(*(asyncio.shield(f) for f in futures)))
            except asyncio.CancelledError:
                self._cancel_later(pending.done, own_ids)
                raise
        finally:
            for j, f in zip(ids, futures, strict=True):
                if self._waiting.get(j) is f:
                    del self._waiting[j]

    # -- submitting ------------------------------------------------------------------------

    def _enqueue(self, pending: _Pending) -> None:
        self._queue.append(pending)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="teacherq gateway submit")

    async def _flush(self) -> None:
        # Let the requests that arrive in this tick (or within the window) join the batch.
        await asyncio.sleep(self.coalesce_s)
        while self._queue:
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            await self._submit(batch)

    async def _submit(self, batch: list[_Pending]) -> None:
        try:
            reqs = await self._fresh([r for p in batch for r in p.requests])
            await self.client.submit(reqs)
            self.submits += 1
            self.submitted += len(reqs)
        except (InvalidJob, QueueFull) as exc:
            if len(batch) == 1:
                _settle(batch[0].done, exc)
                return
            for p in batch:  # one request's fault must not fail the others
                await self._submit([p])
            return
        except Exception as exc:  # a Redis failure: every request of the batch answers it
            log.exception("gateway.submit_failed", requests=len(batch))
            for p in batch:
                _settle(p.done, exc)
            return
        for p in batch:
            _settle(p.done, [r.job_id or "" for r in p.requests])

    async def _fresh(self, reqs: list[TeacherRequest]) -> list[TeacherRequest]:
        """Like slime's server after an update, a request is computed by the newest weights:
        each job asks for at least the queue's active generation."""
        raw = cast(Fields, await self.client.r.hgetall(keys.weights_key(self.client.queue)))
        gen = protocol.job_generation(served_from_fields(raw))
        if not gen:
            return reqs
        return [
            r.model_copy(update={"min_model_generation": gen})
            if (r.min_model_generation or 0) < gen
            else r
            for r in reqs
        ]

    def _cancel_later(self, done: asyncio.Future[list[str]], own_ids: frozenset[str]) -> None:
        """Cancel the jobs of a request whose client went away (a caller's own job id is
        left to finish: a retry with the same id picks its result up)."""
        if done.cancelled() or done.exception() is not None:
            return
        ids = [j for j in done.result() if j not in own_ids]
        if ids:
            task = asyncio.ensure_future(self._cancel(ids))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _cancel(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            try:
                await self.client.cancel(job_id)
            except Exception:
                log.exception("gateway.cancel_failed", job_id=job_id)
        log.info("gateway.client_gone", cancelled=len(job_ids))

    # -- results ---------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            try:
                async with self.client.watch() as sub:
                    self._listening.set()
                    while True:
                        announced = await sub.next()
                        mine = [j for j in dict.fromkeys(announced) if j in self._waiting]
                        if mine:
                            await self._deliver(mine)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the reader died: fail the waiters, start again
                log.exception("gateway.results_reader_failed")
                for f in list(self._waiting.values()):
                    _settle(f, RuntimeError(f"the gateway's result reader failed: {exc}"))
                await asyncio.sleep(0.5)

    async def _deliver(self, job_ids: list[str]) -> None:
        got = await self.client.results(job_ids, strict=False)
        for job_id, res in zip(job_ids, got, strict=True):
            f = self._waiting.get(job_id)
            if res is not None and f is not None:
                _settle(f, res)


def _settle(f: asyncio.Future, value: object) -> None:
    if f.done():
        return
    if isinstance(value, BaseException):
        f.set_exception(value)
        f.exception()  # retrieved: nobody waiting is not an error worth a warning
    else:
        f.set_result(value)
