"""Prometheus metrics and a health endpoint for one consumer replica (the leader rank).

The worker owns one `ConsumerMetrics` (its own CollectorRegistry, so two consumers in one
process, or the tests, never share series) and reports what happens as it happens; `serve`
exposes `/metrics` (Prometheus text format) and `/healthz` on one small HTTP server thread.

Health: `/healthz` answers 200 while the loop ticked within `health_max_age_s`, or while it
is busy with one batch for less than `busy_max_s` (a long batch does not tick), and 503
before the first tick, after `stopped`, or when the loop went quiet — so a container health
check restarts a wedged consumer. The body is a small JSON object saying why.

Tokens/s is `rate(teacherq_tokens_total[1m])` in Prometheus; `progress_fields()` gives the
same over a sliding window for the leader's per-batch progress log line.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)

log = structlog.get_logger("teacherq.metrics")

# Seconds: from a few ms (tiny batches on a GPU) to minutes (long prefill on CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Queue waits run from instant to hours behind a backlog.
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600)
RATIO_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


class ConsumerMetrics:
    """The metrics of one consumer; every method is cheap and thread-safe (writer threads
    report jobs done while the loop reports batches)."""

    def __init__(
        self,
        *,
        queue: str,
        consumer: str,
        health_max_age_s: float = 30.0,
        busy_max_s: float = 600.0,
        rate_window_s: float = 60.0,
    ) -> None:
        # No `<counter>_created` series: they double the series count and no query here
        # needs them (a process-wide switch of prometheus_client; teacherq never wants them).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.queue = queue
        self.consumer = consumer
        self.health_max_age_s = health_max_age_s
        self.busy_max_s = busy_max_s
        labels = ("queue", "consumer")
        lv = (queue, consumer)
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + extra, registry=reg)

        self._tokens = counter("teacherq_tokens", "Tokens of jobs scored and stored.").labels(*lv)
        self._jobs_done = counter("teacherq_jobs_done", "Jobs scored and stored.").labels(*lv)
        self._jobs_failed = counter(
            "teacherq_jobs_failed", "Jobs that ended in a failure record.", ("reason",)
        )
        self._batches = counter("teacherq_batches", "Micro-batches scored.").labels(*lv)
        self._batch_failures = counter(
            "teacherq_batch_failures", "Micro-batches that failed (then retried job by job)."
        ).labels(*lv)
        self._redeliveries = counter(
            "teacherq_redeliveries", "Entries received that were delivered before."
        ).labels(*lv)
        self._dead_letters = counter(
            "teacherq_dead_letters", "Entries moved to the dead-letter stream.", ("reason",)
        )
        self._duplicates = counter(
            "teacherq_duplicates_skipped", "Entries acknowledged without computing (had a result)."
        ).labels(*lv)
        self._unreplicated = counter(
            "teacherq_unreplicated_writes",
            "Results stored without the replica acknowledgement redis.min_replicas_acked asks "
            "for (redis.replica_ack_policy=degrade).",
        ).labels(*lv)
        self._prefix_saved = counter(
            "teacherq_prefix_tokens_saved",
            "Tokens not computed because jobs shared a prompt (each shared prompt runs once).",
        ).labels(*lv)
        self._batch_latency = Histogram(
            "teacherq_batch_latency_seconds",
            "Wall time of one micro-batch on the device (broadcast, forward, head).",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ).labels(*lv)
        self._queue_wait = Histogram(
            "teacherq_queue_wait_seconds",
            "From submit to claim, per job.",
            labels,
            buckets=WAIT_BUCKETS,
            registry=reg,
        ).labels(*lv)
        self._batch_jobs = Histogram(
            "teacherq_batch_jobs",
            "Jobs per micro-batch.",
            labels,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=reg,
        ).labels(*lv)
        self._batch_tokens = Histogram(
            "teacherq_batch_tokens",
            "Real (unpadded) tokens per micro-batch.",
            labels,
            buckets=(16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
            registry=reg,
        ).labels(*lv)
        self._padding = Histogram(
            "teacherq_padding_waste_ratio",
            "Share of computed token slots that were padding, per micro-batch.",
            labels,
            buckets=RATIO_BUCKETS,
            registry=reg,
        ).labels(*lv)
        self._padding_last = Gauge(
            "teacherq_padding_waste_last_ratio",
            "Padding share of the last micro-batch.",
            labels,
            registry=reg,
        ).labels(*lv)
        self._device_mem = Gauge(
            "teacherq_device_memory_bytes",
            "Accelerator memory of this process (kind: allocated, reserved, peak_allocated).",
            labels + ("device", "kind"),
            registry=reg,
        )
        self._last_tick = Gauge(
            "teacherq_last_tick_timestamp_seconds",
            "Unix time the loop last ticked.",
            labels,
            registry=reg,
        ).labels(*lv)
        self._state = Gauge(
            "teacherq_consumer_state",
            "1 for the consumer's current state.",
            labels + ("state",),
            registry=reg,
        )

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        self._redis_used = gauge(
            "teacherq_redis_memory_used_bytes", "Redis used_memory as last sampled."
        ).labels(*lv)
        self._redis_limit = gauge(
            "teacherq_redis_memory_limit_bytes", "Redis maxmemory (0: no limit)."
        ).labels(*lv)
        self._redis_growth = gauge(
            "teacherq_redis_memory_growth_bytes_per_second",
            "Growth of Redis used_memory over the last minutes (negative: shrinking).",
        ).labels(*lv)
        self._redis_full_in = gauge(
            "teacherq_redis_memory_seconds_to_full",
            "Projected seconds until maxmemory at the current growth (-1: not growing or no "
            "limit; 0: full).",
        ).labels(*lv)
        self._paused = gauge(
            "teacherq_consumer_paused",
            "1 while the consumer takes no new work because Redis is (nearly) full.",
        ).labels(*lv)
        self._start = Gauge(
            "teacherq_consumer_start_seconds",
            "Seconds of this consumer's start until ready, by phase (import, setup, build, "
            "read, copy, load, compile, warmup, open; total: all of them).",
            labels + ("phase",),
            registry=reg,
        )
        ProcessCollector(registry=reg)  # resident memory, CPU seconds, open fds of this process

        self._lock = threading.Lock()
        self._state_name = "starting"
        self._tick_mono: float | None = None
        self._busy_since: float | None = None
        self._window: deque[tuple[float, int, int]] = deque()  # (monotonic, jobs, tokens)
        self._rate_window_s = rate_window_s
        # Named *_total so they never clash with a log call's own fields (jobs, tokens).
        self._totals = {
            "jobs_done_total": 0,
            "jobs_failed_total": 0,
            "tokens_total": 0,
            "batches_total": 0,
        }
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    # -- reporting ------------------------------------------------------------------------

    def tick(self, state: str) -> None:
        """The loop is alive, in `state` (ready, busy, draining, stopped); call once per
        iteration. A `busy` tick starts the busy clock that health allows `busy_max_s`."""
        now = time.monotonic()
        with self._lock:
            if state == "busy" and self._state_name != "busy":
                self._busy_since = now
            elif state != "busy":
                self._busy_since = None
            previous, self._state_name, self._tick_mono = self._state_name, state, now
        self._last_tick.set(time.time())
        if previous != state:
            self._state.labels(self.queue, self.consumer, previous).set(0)
        self._state.labels(self.queue, self.consumer, state).set(1)

    def batch_done(
        self, *, jobs: int, tokens: int, latency_s: float, padded_tokens: int | None = None
    ) -> None:
        """One micro-batch scored: `tokens` real tokens in `padded_tokens` computed slots (the
        same when packed without padding)."""
        slots = padded_tokens if padded_tokens is not None else tokens
        waste = (slots - tokens) / slots if slots > 0 else 0.0
        self._batches.inc()
        self._batch_latency.observe(latency_s)
        self._batch_jobs.observe(jobs)
        self._batch_tokens.observe(tokens)
        self._padding.observe(waste)
        self._padding_last.set(waste)
        with self._lock:
            self._totals["batches_total"] += 1

    def batch_failed(self) -> None:
        """A micro-batch failed as a whole (its jobs are retried one by one)."""
        self._batch_failures.inc()

    def job_claimed(self, *, queue_wait_s: float, deliveries: int = 1) -> None:
        """A job taken from the stream: how long it waited, and whether it was redelivered."""
        self._queue_wait.observe(max(0.0, queue_wait_s))
        if deliveries > 1:
            self._redeliveries.inc()

    def job_done(self, *, tokens: int) -> None:
        """A job's result stored and acknowledged."""
        self._jobs_done.inc()
        self._tokens.inc(tokens)
        now = time.monotonic()
        with self._lock:
            self._totals["jobs_done_total"] += 1
            self._totals["tokens_total"] += tokens
            self._window.append((now, 1, tokens))
            self._trim(now)

    def job_failed(self, *, reason: str) -> None:
        """A job ended in a failure record (`reason`: a short class such as InvalidJob)."""
        self._jobs_failed.labels(self.queue, self.consumer, reason).inc()
        with self._lock:
            self._totals["jobs_failed_total"] += 1

    def dead_lettered(self, *, reason: str) -> None:
        """An entry moved to the dead-letter stream (`reason`: its exception class)."""
        self._dead_letters.labels(self.queue, self.consumer, reason).inc()

    def duplicate_skipped(self) -> None:
        """An entry acknowledged without computing: its job already had a result."""
        self._duplicates.inc()

    def unreplicated_write(self) -> None:
        """A result stored without its replica acknowledgement (degraded)."""
        self._unreplicated.inc()

    def prefix_tokens_saved(self, tokens: int) -> None:
        """Tokens a batch did not compute thanks to shared-prefix packing."""
        self._prefix_saved.inc(tokens)

    def update_device_memory(self) -> None:
        """Sample accelerator memory (torch.cuda; nothing on a CPU-only host). Call it after
        a batch: it reads counters, it does not synchronize the device."""
        import torch  # lazily: consumer-side only, and cheap once the worker imported it

        if not torch.cuda.is_available():
            return
        for i in range(torch.cuda.device_count()):
            dev = f"cuda:{i}"
            for kind, value in (
                ("allocated", torch.cuda.memory_allocated(i)),
                ("reserved", torch.cuda.memory_reserved(i)),
                ("peak_allocated", torch.cuda.max_memory_allocated(i)),
            ):
                self._device_mem.labels(self.queue, self.consumer, dev, kind).set(value)

    def start_phases(self, phases: dict[str, float]) -> None:
        """Seconds per start-up phase, as `consumer.ready` logs them (`phases_s`)."""
        for phase, seconds in phases.items():
            self._start.labels(self.queue, self.consumer, phase).set(seconds)

    def redis_memory(self, fields: dict[str, Any], *, paused: bool) -> None:
        """Redis memory as `shared.memory.memory_fields` reports it, and the pause state."""
        self._redis_used.set(fields["used_bytes"])
        self._redis_limit.set(fields["limit_bytes"])
        self._redis_growth.set(fields["growth_bytes_per_s"] or 0.0)
        eta = fields["seconds_to_full"]
        self._redis_full_in.set(-1 if eta is None else eta)
        self._paused.set(1 if paused else 0)

    # -- reading --------------------------------------------------------------------------

    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0][0] > self._rate_window_s:
            self._window.popleft()

    def progress_fields(self) -> dict[str, Any]:
        """Totals (`*_total`) and rates over the last `rate_window_s`, as fields for the
        leader's per-batch progress log line."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            jobs = sum(j for _, j, _ in self._window)
            tokens = sum(t for _, _, t in self._window)
            span = (now - self._window[0][0]) if self._window else 0.0
            totals = dict(self._totals)
        # Over the span the window covers (not the full window right after start-up).
        span = max(span, 1.0)
        return {
            **totals,
            "jobs_per_s": round(jobs / span, 3),
            "tokens_per_s": round(tokens / span, 1),
        }

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details): see the module doc for the rule."""
        now = time.monotonic()
        with self._lock:
            state, tick, busy = self._state_name, self._tick_mono, self._busy_since
        body: dict[str, Any] = {"consumer": self.consumer, "queue": self.queue, "state": state}
        if tick is None:
            return False, {**body, "status": "starting", "reason": "the loop has not ticked yet"}
        age = now - tick
        body["last_tick_age_s"] = round(age, 3)
        if state == "stopped":
            return False, {**body, "status": "down", "reason": "stopped"}
        if age <= self.health_max_age_s:
            return True, {**body, "status": "ok"}
        if busy is not None and now - busy <= self.busy_max_s:
            return True, {**body, "status": "ok", "busy_s": round(now - busy, 3)}
        reason = f"no loop tick for {age:.1f} s (limit {self.health_max_age_s:g} s)"
        if busy is not None:
            reason = f"busy with one batch for {now - busy:.1f} s (limit {self.busy_max_s:g} s)"
        return False, {**body, "status": "down", "reason": reason}

    def scrape(self) -> bytes:
        """The metrics in Prometheus text format (what /metrics serves)."""
        return generate_latest(self.registry)

    # -- serving --------------------------------------------------------------------------

    def wsgi_app(self) -> Callable[..., Iterable[bytes]]:
        """One WSGI app: `/healthz` here, everything else Prometheus's exposition app."""
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO", "").rstrip("/") == "/healthz":
                ok, body = self.health()
                status = "200 OK" if ok else "503 Service Unavailable"
                payload = json.dumps(body).encode()
                start_response(
                    status,
                    [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))],
                )
                return [payload]
            return metrics_app(environ, start_response)

        return app

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve /metrics and /healthz on a daemon thread; returns the bound port (pass 0 for
        any free one; the `consumer.metrics_port` setting's 0 means "do not call this")."""
        if self._server is not None:
            raise RuntimeError("metrics server already running")
        self._server = make_server(
            host, port, self.wsgi_app(), server_class=_ThreadingServer, handler_class=_Quiet
        )
        bound = int(self._server.server_port)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="tq-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics.serving", host=host, port=bound)
        return bound

    def close(self) -> None:
        """Stop the HTTP server (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request: a slow scraper must not block the health check."""

    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    """No access log on stderr: scrapes every few seconds would drown the JSON log."""

    def log_message(self, format: str, *args: Any) -> None:
        """Drop the access log line."""
