"""`teacherq serve`: an HTTP gateway in the API of slime's Megatron teacher server, on the queue.

A trainer written against that server (`POST /generate`, `POST /update_weights_from_disk`,
`GET /get_loads`, `/healthz`, `/info`) switches by changing its URL: request and response
fields keep their names (docs/gateway.md maps them one by one), and every request becomes a
queue job (durable, batched with other trainers' work, replayable, traced).

Built on the standard library's threaded HTTP server: a handler thread validates and submits
with the sync client, then waits through the one `AsyncTeacherClient` of the gateway, whose
single completion reader (on its own event-loop thread) serves every waiting request. While it
waits, the handler watches its socket: a client that disconnects cancels its job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import select
import signal
import socket
import threading
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import redis

from producer import protocol
from producer.aio import AsyncTeacherClient
from producer.client import TeacherClient
from shared import keys, weights
from shared.errors import (
    InvalidCheckpoint,
    InvalidJob,
    QueueFull,
    TeacherqError,
    WeightUpdateFailed,
)
from shared.log import get_logger
from shared.messages import TeacherRequest, TeacherResult, parse_request
from shared.settings import Settings
from shared.streams import Fields
from shared.tracing import Span, end_span, start_span

log = get_logger("teacherq.gateway")

MAX_BODY_BYTES = 64 * 1024 * 1024  # as slime's server
POLL_S = 0.2  # how often a waiting handler looks at its client's socket
# teacherq's own /generate fields, accepted beside slime's.
OWN_FIELDS = ("top_k", "return_entropy", "seed", "temperature", "job_id", "metadata")


class HttpError(Exception):
    """An error answer: status and JSON body (`{"error": ...}` plus any extra fields)."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": message, **extra}


class ListenError(TeacherqError):
    """The gateway cannot listen on its address (a taken port, an unknown host)."""


class Gateway:
    """The gateway's state: settings, both clients, the event-loop thread, the HTTP server."""

    def __init__(self, settings: Settings, *, host: str, port: int) -> None:
        self.settings = settings
        self.g = settings.gateway
        # Bind first: a taken port fails before anything else is started.
        try:
            self.server = ThreadingHTTPServer((host, port), _Handler)
        except OSError as exc:
            raise ListenError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                "(set --port / --host, or TEACHERQ_GATEWAY__PORT / TEACHERQ_GATEWAY__HOST)"
            ) from exc
        self.server.daemon_threads = True
        self.server.gateway = self  # type: ignore[attr-defined]  # read by the handlers
        self.client = TeacherClient(settings, trace_process="teacherq gateway")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="teacherq gateway loop", daemon=True
        )
        self._loop_thread.start()
        self.aclient: AsyncTeacherClient = self._run(_make_async_client(settings))

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on (port 0 in settings: the one it got)."""
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def serve_forever(self) -> None:
        """Answer requests until `shutdown` (from another thread or a signal handler)."""
        host, port = self.address
        log.info("gateway.listening", host=host, port=port, queue=self.settings.queue.name)
        try:
            self.server.serve_forever()
        finally:
            self.close()

    def shutdown(self) -> None:
        """Stop `serve_forever` (call from another thread)."""
        self.server.shutdown()

    def close(self) -> None:
        """Close the socket, both clients and the loop thread."""
        self.server.server_close()
        self._run(self.aclient.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=5)
        self.client.close()

    # -- /generate ---------------------------------------------------------------------------

    def generate(self, payload: dict[str, Any], handler: _Handler) -> dict[str, Any] | None:
        """Submit one job and wait for it; None when the client went away (job cancelled).

        The request is one `generate` span: a child of the caller's W3C `traceparent` header
        when it sends one, the parent of the job's spans, and sent back as the response's
        `traceparent` header (errors included), so a caller learns the job's trace."""
        incoming = handler.headers.get("traceparent")
        span = start_span("generate", carrier={"traceparent": incoming} if incoming else None)
        handler.traceparent = span.carrier["traceparent"]
        try:
            out = self._generate(payload, handler, span)
        except BaseException as exc:
            end_span(span, exc)
            raise
        end_span(span)
        return out

    def _generate(
        self, payload: dict[str, Any], handler: _Handler, span: Span
    ) -> dict[str, Any] | None:
        req, own_id = self._request(payload, trace=span.carrier)
        span.set(job_id=req.job_id)
        try:
            [job_id] = self.client.submit([req])
        except InvalidJob as exc:
            raise HttpError(400, str(exc).removeprefix("request 0: ")) from None
        except QueueFull as exc:
            raise HttpError(503, str(exc)) from None
        fut = asyncio.run_coroutine_threadsafe(
            self.aclient.wait([job_id], timeout=self.g.request_timeout_s), self._loop
        )
        while not concurrent.futures.wait([fut], timeout=POLL_S).done:
            if handler.client_gone():
                fut.cancel()
                if not own_id:  # a caller's own id may be fetched again later
                    self.client.cancel(job_id)
                log.info("gateway.client_gone", job_id=job_id, cancelled=not own_id)
                return None
        try:
            [res] = fut.result()
        except TimeoutError:
            raise HttpError(
                504,
                f"job {job_id} not done within gateway.request_timeout_s="
                f"{self.g.request_timeout_s:g}",
                request_id=job_id,
            ) from None
        if not res.ok:
            raise HttpError(500, f"result failed: {res.error}", request_id=job_id)
        return _response(job_id, res, req.num_tokens - 1)

    def _request(
        self, payload: dict[str, Any], *, trace: dict[str, str] | None = None
    ) -> tuple[TeacherRequest, bool]:
        """The queue request for a /generate payload (slime's fields and teacherq's own), and
        whether the caller named the job id. `trace`: the carrier of the span that parents the
        job's spans (the request's)."""
        if "input_ids" not in payload:
            raise HttpError(400, "missing input_ids")
        ids = payload["input_ids"]
        if not isinstance(ids, list):
            raise HttpError(400, "input_ids must be a list of token ids")
        limit = self.client.limits().max_input_tokens
        if self.g.max_length:
            limit = min(limit, self.g.max_length)
        if len(ids) > limit:
            raise HttpError(
                413,
                f"input_ids length {len(ids)} exceeds configured maximum {limit}",
                input_length=len(ids),
                max_length=limit,
            )
        fields: dict[str, Any] = {
            "input_ids": ids,
            "label_token_ids": payload.get("label_token_ids"),
            "sample_n": _sample_n(payload.get("sample_n", 0)),
            "temperature": self.g.temperature,
        }
        fields.update({k: payload[k] for k in OWN_FIELDS if payload.get(k) is not None})
        own_id = "job_id" in fields
        if trace:
            fields["trace"] = dict(trace)
        fields.setdefault("job_id", f"gw-{uuid.uuid4().hex}")
        # Like slime's server after an update: a request is computed by the newest weights.
        fields["min_model_generation"] = protocol.job_generation(
            weights.current(self.client.r, self.settings.queue.name)
        )
        try:
            return parse_request(fields), own_id
        except InvalidJob as exc:
            raise HttpError(400, str(exc)) from None

    # -- /update_weights_from_disk --------------------------------------------------------

    def update_weights(self, payload: dict[str, Any]) -> dict[str, Any]:
        """slime's semantics on the queue's weight-update path: the loaded path is skipped,
        the same path in progress coalesces, another path in progress is refused (409)."""
        raw = payload.get("model_path") or payload.get("path") or payload.get("load")
        if not raw:
            raise HttpError(400, "missing model_path")
        path = str(raw)
        served = weights.current(self.client.r, self.settings.queue.name)
        if served.state != "updating" and self._loaded(served) == path:
            return {"ok": True, "model_path": path, "skipped": True}
        timeout = _positive(payload.get("timeout_s"), "timeout_s") or self.g.update_timeout_s
        before = self.loads()
        check = payload.get("check", True)
        if not isinstance(check, bool):
            raise HttpError(400, "check must be true or false")
        try:
            req = self.client.update_weights(path, wait=True, timeout=timeout, check=check)
        except InvalidCheckpoint as exc:
            raise HttpError(400, str(exc)) from None
        except weights.UpdateInProgress as exc:
            raise HttpError(409, str(exc)) from None
        except WeightUpdateFailed as exc:
            raise HttpError(500, str(exc), generation=exc.generation) from None
        except TimeoutError as exc:
            raise HttpError(503, str(exc)) from None
        out: dict[str, Any] = {
            "ok": True,
            "model_path": path,
            "before_loads": before,
            "after_loads": self.loads(),
            "update_result": {"generation": req.generation, "request_id": req.request_id},
        }
        if req.coalesced:
            out["coalesced"] = True
        return out

    def _loaded(self, served: weights.Served) -> str | None:
        """The path the replicas serve: the active update's, else their configured model."""
        return served.active_path if served.active_path is not None else self.settings.model.path

    # -- GET endpoints --------------------------------------------------------------------

    def loads(self) -> dict[str, Any]:
        """slime's load figures, from the queue's status snapshot (plus teacherq's own)."""
        snap = self.client.status()
        alive = {n: c for n, c in snap["consumers"].items() if c["alive"]}
        tp = snap["throughput"]
        return {
            "queue_size": snap["queued"],
            "inflight_size": snap["in_flight"],
            "pending_tokens": snap["pending_tokens"],
            "running_by_worker": {
                n: c["entries"] for n, c in snap["in_flight_by_consumer"].items()
            },
            "total_finished_reqs": snap["results_announced"],
            "queue": snap["queue"],
            "dead_letters": snap["dead_letters"],
            "consumers": len(alive),
            "consumers_ready": sum(c.get("state") in ("ready", "busy") for c in alive.values()),
            "jobs_per_s": tp["jobs_per_s"],
            "tokens_per_s": tp["tokens_per_s"],
        }

    def info(self) -> dict[str, Any]:
        """What is served and how the gateway is set (no secrets)."""
        from importlib.metadata import PackageNotFoundError, version

        served = weights.current(self.client.r, self.settings.queue.name)
        model = cast(Fields, self.client.r.hgetall(keys.model_key(self.settings.queue.name)))
        try:
            ours = version("teacherq")
        except PackageNotFoundError:
            ours = "unknown"
        args = {
            "load": self._loaded(served),
            "rollout_temperature": self.g.temperature,
            "megatron_server_max_length": self.g.max_length,
            "max_input_tokens": self.settings.queue.max_input_tokens,
            "queue": self.settings.queue.name,
        }
        return {
            "args": args,
            "server_type": "teacherq",
            "version": ours,
            "model": {
                "path": args["load"],
                "version": model.get(b"version", b"").decode() or None,
                "vocab_size": int(model[b"vocab_size"]) if model.get(b"vocab_size") else None,
                "generation": served.generation,
                "update_state": served.state,
            },
        }

    def healthz(self) -> tuple[int, dict[str, Any]]:
        """200 when Redis answers (the queue accepts work), 503 otherwise."""
        try:
            self.client.r.ping()
        except redis.RedisError as exc:  # any failure to reach Redis is "unhealthy", said so
            return 503, {"ok": False, "error": f"redis: {exc}"}
        return 200, {"ok": True, "consumers_ready": self.client.consumers_ready()}


async def _make_async_client(settings: Settings) -> AsyncTeacherClient:
    # Built on the loop thread, so its locks and connections belong to that loop.
    return AsyncTeacherClient(settings, trace_process="teacherq gateway")


def _sample_n(value: Any) -> int:
    """slime's rule: an int or a numeric string, >= 0; booleans refused."""
    if value is None:
        return 0
    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
        raise HttpError(400, "sample_n must be an integer >= 0")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise HttpError(400, "sample_n must be an integer >= 0") from None
    if n < 0:
        raise HttpError(400, "sample_n must be >= 0")
    return n


def _positive(value: Any, name: str) -> float | None:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise HttpError(400, f"{name} must be a number > 0") from None
    if not math.isfinite(v) or v <= 0:
        raise HttpError(400, f"{name} must be a number > 0")
    return v


def _response(job_id: str, res: TeacherResult, rows: int) -> dict[str, Any]:
    """slime's response fields (cropped to L-1 rows), then teacherq's own."""

    def rows_of(arr: Any) -> Any:
        return None if arr is None else arr[:rows].tolist()

    out: dict[str, Any] = {"request_id": job_id, "log_probs": rows_of(res.logprobs)}
    for ours, theirs in (
        ("label_logprobs", "label_token_log_probs"),
        ("sampled_token_ids", "sampled_token_ids"),
        ("sampled_logprobs", "sampled_log_probs"),
        ("topk_token_ids", "topk_token_ids"),
        ("topk_logprobs", "topk_logprobs"),
        ("topk_rest_logprob", "topk_rest_logprob"),
        ("entropy", "entropy"),
    ):
        value = getattr(res, ours)
        if value is not None:
            out[theirs] = rows_of(value)
    out.update(model_version=res.model_version, model_generation=res.model_generation)
    return out


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the trainers' HTTP sessions expect
    server_version = "teacherq-gateway"
    traceparent: str | None = None  # the current request's span, sent back as a header

    @property
    def gateway(self) -> Gateway:
        return self.server.gateway  # type: ignore[attr-defined, no-any-return]

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("gateway.http", client=self.address_string(), line=format % args)

    def do_GET(self) -> None:
        self.traceparent = None  # one handler serves every request of a kept-alive connection
        path = self.path.split("?", 1)[0]
        routes = {
            "/healthz": self.gateway.healthz,
            "/get_loads": lambda: (200, self.gateway.loads()),
            "/info": lambda: (200, self.gateway.info()),
        }
        if path not in routes:
            self._send(404, {"error": f"no route GET {path}"})
            return
        self._answer(routes[path])

    def do_POST(self) -> None:
        self.traceparent = None
        path = self.path.split("?", 1)[0]
        if path == "/generate":
            self._answer(lambda: self._generate())
        elif path == "/update_weights_from_disk":
            self._answer(lambda: (200, self.gateway.update_weights(self._payload(empty_ok=True))))
        else:
            self._drain_body()
            self._send(404, {"error": f"no route POST {path}"})

    def _generate(self) -> tuple[int, dict[str, Any] | None]:
        return 200, self.gateway.generate(self._payload(empty_ok=False), self)

    def _answer(self, route: Any) -> None:
        try:
            status, body = route()
        except HttpError as exc:
            status, body = exc.status, exc.body
        except Exception as exc:  # the loop boundary: answer 500, log with the traceback
            log.exception("gateway.error", path=self.path)
            status, body = 500, {"error": f"{type(exc).__name__}: {exc}"}
        if body is None:  # the client went away
            self.close_connection = True
            return
        self._send(status, body)

    def _payload(self, *, empty_ok: bool) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise HttpError(413, f"request body of {length} bytes exceeds {MAX_BODY_BYTES}")
        raw = self.rfile.read(length) if length else b""
        if not raw.strip() and empty_ok:
            return {}
        try:
            payload = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise HttpError(400, "request body must be a JSON object")
        return payload

    def _drain_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= MAX_BODY_BYTES:
            self.rfile.read(length)
        elif length:
            self.close_connection = True

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status, HTTPStatus(status).phrase)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.traceparent:  # the request's span (/generate)
                self.send_header("traceparent", self.traceparent)
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client left while we answered
            self.close_connection = True

    def client_gone(self) -> bool:
        """True when the client closed its connection (readable with nothing to read)."""
        conn = self.connection
        try:
            readable, _, _ = select.select([conn], [], [], 0)
            return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


def serve(gw: Gateway) -> None:
    """Run a gateway in the foreground until SIGINT or SIGTERM (entry of `teacherq serve`)."""

    def stop(signum: int, _frame: Any) -> None:
        log.info("gateway.stopping", signal=signum)
        threading.Thread(target=gw.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    gw.serve_forever()
