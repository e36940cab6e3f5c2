"""Optional export of teacherq's spans to an OpenTelemetry collector over OTLP/HTTP.

The Redis span sink (`shared.trace_store`) and `teacherq trace` stay the zero-setup default.
With the `otel` extra installed (`pip install 'teacherq[otel]'`) and one of the standard
variables `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set, every
process that records spans (trainer client, CLI, gateway, consumers) also sends them to that
collector, with the OpenTelemetry SDK's own exporter: its other standard variables
(`OTEL_EXPORTER_OTLP_HEADERS`, `..._TIMEOUT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_BSP_*`) apply as usual, and `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turns
it off. Span ids are already W3C ones (`shared.tracing`), so a job's spans join the trace of the
trainer span that submitted it.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from typing import Any

from shared.log import get_logger
from shared.tracing import SpanRecord

log = get_logger("teacherq.otlp")

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXPORT_DELAY_MS = 1000  # batch for at most this long (OTEL_BSP_SCHEDULE_DELAY overrides)


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for OTLP export (an endpoint set, the SDK not disabled)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(environ.get(name, "").strip() for name in ENDPOINT_VARS)


def _attr_value(value: Any) -> Any:
    """An attribute value OpenTelemetry accepts (str, bool, int, float or a list of one of
    them); anything else as its text."""
    if isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, str | int | float) for v in value):
        kinds = {type(v) for v in value}
        return list(value) if len(kinds) <= 1 else [str(v) for v in value]
    return str(value)


class OtlpSpanSink:
    """A span sink (`shared.tracing.configure_sink`) that turns each record into an
    OpenTelemetry span and exports it in batches, in a background thread of the SDK, to the
    collector the `OTEL_EXPORTER_OTLP_*` variables name. Never raises into traced code: export
    errors are the SDK's to log."""

    def __init__(self, *, exporter: Any = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "teacherq"}
        self._resource = Resource.create(attrs)
        self._scope = InstrumentationScope("teacherq")
        delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else EXPORT_DELAY_MS
        self._processor = BatchSpanProcessor(
            exporter or OTLPSpanExporter(), schedule_delay_millis=delay
        )
        self._closed = False
        atexit.register(self.close)

    def __call__(self, record: SpanRecord) -> None:
        self._processor.on_end(self._span(record))

    def _span(self, rec: SpanRecord) -> Any:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        flags = TraceFlags(TraceFlags.SAMPLED)
        trace_id = int(rec["trace_id"], 16)
        context = SpanContext(trace_id, int(rec["span_id"], 16), is_remote=False, trace_flags=flags)
        parent = None
        if rec.get("parent_span_id"):
            parent = SpanContext(
                trace_id,
                int(rec["parent_span_id"], 16),
                is_remote=bool(rec.get("remote_parent")),
                trace_flags=flags,
            )
        attributes = {k: _attr_value(v) for k, v in (rec.get("attrs") or {}).items()}
        attributes["process.pid"] = rec.get("pid", 0)
        attributes["host.name"] = rec.get("host", "")
        for key in ("process", "rank"):
            if rec.get(key) is not None:
                attributes[f"teacherq.{key}"] = _attr_value(rec[key])
        start_ns = int(rec["start_time"] * 1e9)
        error = rec.get("error")
        return ReadableSpan(
            name=rec["name"],
            context=context,
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            kind=SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
            start_time=start_ns,
            end_time=start_ns + int(rec["duration_ms"] * 1e6),
            instrumentation_scope=self._scope,
        )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export what is batched now; False if it did not finish within `timeout_s`."""
        return bool(self._processor.force_flush(int(timeout_s * 1000)))

    def close(self) -> None:
        """Export what is batched and stop the export thread (idempotent; also run at exit)."""
        if self._closed:
            return
        self._closed = True
        self._processor.shutdown()
        atexit.unregister(self.close)


def sink_from_environment() -> OtlpSpanSink | None:
    """An OtlpSpanSink when the environment asks for one and the `otel` extra is installed;
    None otherwise (a missing extra is said once, as a warning naming it)."""
    if not enabled():
        return None
    try:
        return OtlpSpanSink()
    except ImportError:
        log.warning(
            "otlp.unavailable",
            reason="an OTEL_EXPORTER_OTLP_* endpoint is set but OpenTelemetry is not installed",
            fix="pip install 'teacherq[otel]'",
        )
        return None
