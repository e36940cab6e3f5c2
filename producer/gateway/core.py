"""The gateway's core, what every dialect builds on: `Core` (the queue's clients, the
submit-and-wait path `score`, answers and errors in a dialect's shape, and what the consumers
serve) and `new_job_id`.

A dialect module (slime.py, sglang.py, vllm.py, trl.py) imports this module and common.py,
never the server or another dialect, and hands the server its routes (`routes(gw)`); the
server (server.py) owns the socket and the process and only assembles the routes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import redis
from aiohttp import web

from producer.aio import AsyncTeacherClient
from producer.client import TeacherClient
from producer.gateway.common import HttpError, Style, error_body, json_response, read_json
from producer.gateway.jobs import Jobs
from shared import keys, weights
from shared.errors import InvalidJob, QueueFull
from shared.log import get_logger
from shared.messages import Limits, TeacherRequest, TeacherResult
from shared.settings import Settings
from shared.streams import Fields
from shared.tracing import end_span, start_span

log = get_logger("teacherq.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LIMITS_TTL_S = 1.0  # how long the queue's limits are reused between requests


def new_job_id() -> str:
    """A fresh job id for a gateway request (never shared: cancelling it hurts nobody else)."""
    return f"gw-{uuid.uuid4().hex}"


class Core:
    """What a dialect's handlers use: settings, the clients, the job plumbing, answers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.g = settings.gateway
        self.queue = settings.queue.name
        # Blocking calls of the admin routes (weight updates, status) run in worker threads.
        self.client = TeacherClient(settings, trace_process="teacherq gateway")
        self.aclient: AsyncTeacherClient | None = None
        self.jobs: Jobs | None = None
        self._limits: tuple[float, Limits] | None = None
        self.started = time.time()

    async def open(self) -> None:
        """Connect the asyncio client and start the job plumbing (inside the serving loop)."""
        self.aclient = AsyncTeacherClient(self.settings, trace_process="teacherq gateway")
        self.jobs = Jobs(self.aclient, coalesce_s=self.g.coalesce_ms / 1000)
        await self.jobs.start()

    async def close(self) -> None:
        """Stop the job plumbing and close every client (after the last request)."""
        if self.jobs is not None:
            await self.jobs.stop()
        if self.aclient is not None:
            await self.aclient.aclose()
        self.client.close()

    # -- request plumbing ------------------------------------------------------------------

    def route(self, style: Style, fn: Handler) -> Handler:
        """`fn` with errors answered in the dialect's shape (HttpError as is; anything else
        500, logged with its traceback)."""

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                return await fn(request)
            except HttpError as exc:
                body = error_body(style, exc.status, exc.message, exc.extra)
                return json_response(body, status=exc.status, headers=_trace_header(request))
            except (asyncio.CancelledError, web.HTTPException):
                raise
            except Exception as exc:  # the loop boundary: answer 500, log with the traceback
                log.exception("gateway.error", path=request.path)
                body = error_body(style, 500, f"{type(exc).__name__}: {exc}", {})
                return json_response(body, status=500, headers=_trace_header(request))

        return handle

    async def body(self, request: web.Request, *, empty_ok: bool = False) -> dict[str, Any]:
        """The request's JSON object (413 above gateway.max_body_bytes)."""
        return await read_json(request, max_bytes=self.g.max_body_bytes, empty_ok=empty_ok)

    async def limits(self) -> Limits:
        """The queue's limits, read at most once per LIMITS_TTL_S."""
        now = time.monotonic()
        if self._limits is None or now - self._limits[0] > LIMITS_TTL_S:
            assert self.aclient is not None
            self._limits = (now, await self.aclient.limits())
        return self._limits[1]

    async def score(
        self,
        request: web.Request,
        requests: Sequence[TeacherRequest],
        *,
        span_name: str,
        timeout_s: float | None = None,
        own_ids: frozenset[str] = frozenset(),
    ) -> list[TeacherResult]:
        """Compute `requests` (one job each) under one span of the HTTP request and return
        their results in order; refusals become HttpError (400 invalid, 503 queue full, 504
        past the deadline, 500 a failed job). The span is a child of the caller's W3C
        `traceparent` header and parents the jobs' spans; its own traceparent goes back in
        the response's header."""
        assert self.jobs is not None
        incoming = request.headers.get("traceparent")
        span = start_span(span_name, carrier={"traceparent": incoming} if incoming else None)
        request["traceparent"] = span.carrier["traceparent"]
        reqs = [r.model_copy(update={"trace": dict(span.carrier)}) for r in requests]
        span.set(jobs=len(reqs), job_id=reqs[0].job_id if len(reqs) == 1 else None)
        deadline = timeout_s if timeout_s is not None else self.g.request_timeout_s
        what = "timeout_s" if timeout_s is not None else "gateway.request_timeout_s"
        try:
            results = await self.jobs.run(reqs, timeout=deadline, own_ids=own_ids)
        except InvalidJob as exc:
            end_span(span, exc)
            raise HttpError(400, str(exc).removeprefix("request 0: ")) from None
        except QueueFull as exc:
            end_span(span, exc)
            raise HttpError(503, str(exc)) from None
        except TimeoutError as exc:
            end_span(span, exc)
            ids = [r.job_id for r in reqs]
            raise HttpError(
                504,
                f"{'job ' + str(ids[0]) if len(ids) == 1 else f'{len(ids)} jobs'} not done "
                f"within {what}={deadline:g}",
                request_id=ids[0] if len(ids) == 1 else ids,
            ) from None
        except BaseException as exc:
            end_span(span, exc)
            raise
        end_span(span)
        for res in results:
            if not res.ok:
                raise HttpError(500, f"result failed: {res.error}", request_id=res.job_id)
        return results

    def respond(self, request: web.Request, body: Any) -> web.Response:
        """A 200 JSON answer carrying the request's span as its traceparent header."""
        return json_response(body, headers=_trace_header(request))

    # -- what the consumers serve ----------------------------------------------------------

    async def model_record(self) -> dict[str, str]:
        """The model the queue's consumers last published (vocab_size, version, path...)."""
        assert self.aclient is not None
        raw = cast(Fields, await self.aclient.r.hgetall(keys.model_key(self.queue)))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def live_consumers(self) -> dict[str, dict[str, Any]]:
        """Heartbeat records of the consumers alive now (fresh beat, not stopped)."""
        assert self.aclient is not None
        c = self.settings.consumer
        fresh_s = c.live_after_s
        raw = cast(Fields, await self.aclient.r.hgetall(keys.consumers_key(self.queue)))
        now = time.time()
        out = {}
        for name, value in raw.items():
            try:
                rec = json.loads(value)
            except ValueError:
                continue
            fresh = isinstance(rec, dict) and now - rec.get("time", 0) < fresh_s
            if fresh and rec.get("state") != "stopped":
                out[name.decode()] = rec
        return out

    async def served_paths(self) -> set[str]:
        """The checkpoint paths the consumers serve ("" for the built-in preset): those of
        the live consumers' heartbeats, else the one the last consumer published."""
        live = await self.live_consumers()
        paths = {str(rec["model_path"]) for rec in live.values() if "model_path" in rec}
        if paths:
            return paths
        rec = await self.model_record()
        return {rec["path"]} if "path" in rec else set()

    async def served_path(self) -> str | None:
        """The one path every consumer serves (None: none known, or several)."""
        paths = await self.served_paths()
        return next(iter(paths)) or None if len(paths) == 1 else None

    async def consumers_ready(self) -> bool:
        """True when a live consumer reports itself ready or busy."""
        live = await self.live_consumers()
        return any(rec.get("state") in ("ready", "busy") for rec in live.values())

    async def redis_ok(self) -> str | None:
        """None while Redis answers, else why not."""
        assert self.aclient is not None
        try:
            await self.aclient.r.ping()
        except redis.RedisError as exc:  # any failure to reach Redis is "unhealthy", said so
            return f"redis: {exc}"
        return None

    async def weights_state(self) -> weights.Served:
        """The queue's weight-update record."""
        assert self.aclient is not None
        raw = cast(Fields, await self.aclient.r.hgetall(keys.weights_key(self.queue)))
        return weights.served_from_fields(raw)


def _trace_header(request: web.Request) -> dict[str, str] | None:
    tp = request.get("traceparent")
    return {"traceparent": tp} if tp else None
