"""Traces a trainer can join: a trainer's span (W3C `traceparent`, or its current
OpenTelemetry span) parents a job's spans, the Python API records `submit` as the CLI does, and
with OTEL_EXPORTER_OTLP_ENDPOINT set the trainer and a real consumer process export every span
over OTLP/HTTP to a real receiver (an HTTP server decoding the protobuf export requests),
while the Redis sink and `teacherq trace` keep working."""

from __future__ import annotations

import gzip
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import redis

from producer import AsyncTeacherClient, TeacherClient, TeacherRequest
from shared import tracing
from shared.settings import Settings
from shared.trace_store import TraceStore
from tests.timing import scaled

pytestmark = pytest.mark.integration

CONSUMER_PHASES = ("queue_wait", "claim", "pack", "forward", "head", "store", "ack")


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: decodes each ExportTraceServiceRequest into
    plain span dicts (hex ids, attributes, the resource's service name)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the base class's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(self.path, request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, path: str, request: Any) -> None:
        assert path == "/v1/traces", path
        out = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(
                        {
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex() or None,
                            "attrs": {a.key: _value(a.value) for a in s.attributes},
                            "service": resource.get("service.name"),
                            "scope": ss.scope.name,
                            "start_ns": s.start_time_unix_nano,
                            "end_ns": s.end_time_unix_nano,
                        }
                    )
        with self.lock:
            self.requests += 1
            self.spans.extend(out)

    def job_spans(self, job_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["attrs"].get("job_id") == job_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver()
    yield rec
    rec.close()


def _wait_for(
    receiver: Receiver, job_id: str, names: set[str], timeout: float = scaled(60)
) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got = {s["name"]: s for s in receiver.job_spans(job_id)}
        if names <= set(got) or time.monotonic() > deadline:
            missing = names - set(got)
            assert not missing, f"no {sorted(missing)} spans of {job_id} reached the collector"
            return got
        time.sleep(0.1)


def test_trainer_spans_parent_job_spans_in_redis_and_over_otlp(
    settings: Settings, start_consumer, receiver: Receiver, monkeypatch
) -> None:
    """A trainer's OpenTelemetry span and a raw W3C traceparent each parent a job: its
    `submit` span (recorded by the Python API itself, sync and asyncio) and every consumer
    span lie in the trainer's 128-bit trace, chained submit -> consumer phases; the same
    spans are in Redis for `teacherq trace` and, through OTLP/HTTP, at the receiver, from the
    trainer process and from the consumer process."""
    from opentelemetry.sdk.trace import TracerProvider

    otel_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    for k, v in otel_env.items():
        monkeypatch.setenv(k, v)
    start_consumer(settings, extra_env=otel_env)
    tracing.configure_sink(None)  # the client installs the default sink itself
    client = TeacherClient(settings, trace_process="trainer")

    tracer = TracerProvider().get_tracer("trainer")
    with tracer.start_as_current_span("rollout") as rollout:
        [ambient_job] = client.submit([TeacherRequest(input_ids=[1, 2, 3, 4], job_id="amb")])
    rollout_ctx = rollout.get_span_context()
    trainer_trace, trainer_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    header = f"00-{trainer_trace}-{trainer_span}-01"
    [w3c_job] = client.submit(
        [TeacherRequest(input_ids=[5, 6, 7], job_id="w3c", trace={"traceparent": header})]
    )

    async def submit_async() -> str:
        async with AsyncTeacherClient(settings) as ac:
            req = TeacherRequest(input_ids=[8, 9, 10], job_id="aio", trace={"traceparent": header})
            [job] = await ac.submit([req])
            await ac.wait([job], timeout=scaled(120))
            return job

    import asyncio

    aio_job = asyncio.run(submit_async())
    results = client.wait([ambient_job, w3c_job], timeout=scaled(120))
    assert all(r.ok for r in results), [r.error for r in results]

    expected = {
        ambient_job: (format(rollout_ctx.trace_id, "032x"), format(rollout_ctx.span_id, "016x")),
        w3c_job: (trainer_trace, trainer_span),
        aio_job: (trainer_trace, trainer_span),
    }
    store = TraceStore(redis.Redis.from_url(settings.redis.url), settings.queue.name)
    for job, (trace_id, parent) in expected.items():
        got = _wait_for(receiver, job, {"submit", *CONSUMER_PHASES})
        submit = got["submit"]
        assert submit["trace_id"] == trace_id and submit["parent_span_id"] == parent, job
        assert submit["attrs"]["teacherq.process"] == "trainer"
        assert submit["attrs"]["process.pid"] == os.getpid()
        assert submit["service"] == "teacherq" and submit["scope"] == "teacherq"
        for name in CONSUMER_PHASES:
            s = got[name]
            assert s["trace_id"] == trace_id, (job, name)
            assert s["attrs"]["process.pid"] != os.getpid(), (job, name)
            assert s["end_ns"] >= s["start_ns"]
            assert s["parent_span_id"] == submit["span_id"], (job, name)
        # The Redis sink holds the same tree for `teacherq trace`.
        deadline = time.monotonic() + scaled(10)
        while True:
            in_redis = {s["name"]: s for s in store.job_spans(job)}
            if {"submit", *CONSUMER_PHASES} <= set(in_redis) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert in_redis["submit"]["span_id"] == submit["span_id"], job
        assert in_redis["submit"]["trace_id"] == trace_id
        assert in_redis["forward"]["parent_span_id"] == submit["span_id"]
    # Each job carries its submit span's traceparent to the consumer (W3C, in and out).
    fields = client.r.xrange(client.streams.jobs)
    carried = [f for _id, f in fields if f[b"job_id"] == b"w3c"]
    assert carried and f"00-{trainer_trace}-".encode() in carried[0][b"meta"]


def test_otlp_export_is_off_without_the_variables_and_says_so_without_the_extra(
    monkeypatch,
) -> None:
    """No endpoint variable, or the SDK disabled: no exporter. An endpoint set without the
    `otel` extra installed: no exporter, and a warning naming the extra."""
    from shared import otlp

    for name in (*otlp.ENDPOINT_VARS, "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    assert not otlp.enabled() and otlp.sink_from_environment() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    assert otlp.enabled()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not otlp.enabled()
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not otlp.enabled()
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")

    import builtins

    real_import = builtins.__import__

    def no_otel(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("opentelemetry"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return real_import(name, *args, **kwargs)

    warnings: list[dict[str, Any]] = []
    monkeypatch.setattr(builtins, "__import__", no_otel)
    monkeypatch.setattr(otlp.log, "warning", lambda event, **kw: warnings.append(kw))
    assert otlp.sink_from_environment() is None
    assert warnings and warnings[0]["fix"] == "pip install 'teacherq[otel]'"
