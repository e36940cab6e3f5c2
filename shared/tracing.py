"""Spans on structlog contextvars: nested, cross-process, logged as `<name>.start` / `.end`.

A span binds `trace_id`, `span_id` and `parent_span_id` into structlog's context for its
duration, so every log line inside it carries them. Ids follow W3C trace context: 128-bit trace
ids (32 hex chars), 64-bit span ids (16 hex). A trace crosses processes through a small
carrier dict that travels inside the TeacherRequest: `{"traceparent": "00-<trace>-<span>-01",
"trace_id": ..., "span_id": ...}`. A carrier given from outside may hold only a W3C
`traceparent` (what an OpenTelemetry propagator injects), so a trainer's span can parent a
job's spans; with none, a trainer's current OpenTelemetry span (if the trainer uses it) is the
parent of a `submit` span.
Phases measured inside one call can be attached afterwards as children with explicit offsets
(`Span.child`), e.g. the h2d / forward / head / d2h phases of a batch; phases measured at known
wall-clock times (a job's queue wait) are recorded with `record`.

Every finished span becomes a record (a plain dict, see `SpanRecord`) handed to the span sink,
if one is configured (`configure_sink`, once in `main()`); `shared.trace_store.RedisSpanSink` stores
them so `teacherq trace` can rebuild a job's tree from every process it crossed. This module
knows nothing about Redis: a sink is any callable taking one record.

Usage::

    with span("submit", job_id=job_id) as s:          # context manager
        ...
    async with span("fetch"):                         # async context manager
        ...
    @span("store")                                    # decorator, sync or async
    def store(...): ...
    pool.submit(propagate(fn), ...)                   # keep the current span in a thread
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import structlog

from shared.log import get_logger

F = TypeVar("F", bound=Callable[..., Any])
_log = get_logger("teacherq.trace")

# A record as handed to the sink: trace_id, span_id, parent_span_id (None for a root), name,
# start_time (unix seconds), duration_ms, attrs (dict), pid, host, and when known rank,
# process, error (str) and remote_parent (True when the parent ran elsewhere, so the span
# need not lie inside its parent's interval: a consumer's work follows a producer's submit).
SpanRecord = dict[str, Any]
SpanSink = Callable[[SpanRecord], None]

# The keys a span binds into structlog's context; attrs named like these are also bound so
# every log line inside a job's or batch's span names it.
_CONTEXT_ATTRS = ("job_id", "batch_id")

# Names a span's own fields use in its log events and records; an attribute may not shadow them.
_RESERVED = frozenset(
    {"event", "trace_id", "span_id", "parent_span_id", "start_time", "duration_ms", "error"}
)


def _check_attrs(name: str, attrs: dict[str, Any]) -> None:
    clash = _RESERVED.intersection(attrs)
    if clash:
        raise ValueError(f"span {name!r}: attribute names {sorted(clash)} are reserved")


# One clock per process: wall time at import plus the monotonic time elapsed since, so spans
# of one process nest exactly (time.time() can step backwards under NTP; perf_counter cannot)
# while staying comparable with other processes' wall clocks.
_WALL0 = time.time()
_PERF0 = time.perf_counter()


def now() -> float:
    """Current time in unix seconds on the span clock; use it for `record` start/end times."""
    return _WALL0 + (time.perf_counter() - _PERF0)


def new_id() -> str:
    """A random 64-bit span id (also a batch id) as 16 hex chars."""
    return secrets.token_hex(8)


def new_trace_id() -> str:
    """A random 128-bit trace id as 32 hex chars (W3C trace context)."""
    return secrets.token_hex(16)


_HEX = frozenset("0123456789abcdef")


def _hex_id(value: str, size: int) -> bool:
    return len(value) == size and set(value) <= _HEX and value != "0" * size


def traceparent(trace_id: str, span_id: str, *, sampled: bool = True) -> str:
    """The W3C `traceparent` header value of a span (a 64-bit trace id is left-padded)."""
    return f"00-{trace_id.rjust(32, '0')}-{span_id}-{'01' if sampled else '00'}"


def make_carrier(trace_id: str, span_id: str) -> dict[str, str]:
    """The carrier of a span: its W3C `traceparent` and, for readers of older versions,
    `trace_id` and `span_id`."""
    return {
        "traceparent": traceparent(trace_id, span_id),
        "trace_id": trace_id,
        "span_id": span_id,
    }


def parse_carrier(carrier: dict[str, str] | None) -> tuple[str, str | None] | None:
    """(trace id, parent span id) from a carrier: its `trace_id` / `span_id`, else a valid W3C
    `traceparent` (version 00, or a later one read as 00). None when it names no trace; an
    invalid `traceparent` is ignored, as the W3C recommendation says (a new trace starts)."""
    if not carrier:
        return None
    if carrier.get("trace_id"):
        return carrier["trace_id"], carrier.get("span_id") or None
    header = str(carrier.get("traceparent") or "").strip().lower()
    parts = header.split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or not set(parts[0]) <= _HEX:
        return None
    if parts[0] == "00" and len(parts) != 4:
        return None
    _version, trace_id, span_id = parts[:3]
    if not (_hex_id(trace_id, 32) and _hex_id(span_id, 16)):
        return None
    return trace_id, span_id


def _ambient_parent() -> tuple[str, str] | None:
    """The caller's current OpenTelemetry span (trace id, span id), when the process uses
    OpenTelemetry and has one open; looked up only if `opentelemetry.trace` is imported."""
    otel = sys.modules.get("opentelemetry.trace")
    if otel is None:
        return None
    try:
        ctx = otel.get_current_span().get_span_context()
    except Exception:  # noqa: BLE001 - another library's state: never break the traced code
        return None
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


def current_carrier() -> dict[str, str]:
    """The carrier of the innermost open span (empty outside any span)."""
    ctx = structlog.contextvars.get_contextvars()
    if not ctx.get("trace_id") or not ctx.get("span_id"):
        return {}
    return make_carrier(ctx["trace_id"], ctx["span_id"])


# -- the sink ------------------------------------------------------------------------------


class _SinkState:
    """Process-wide sink configuration (set once in main(), read on every finished span)."""

    def __init__(self) -> None:
        self.sink: SpanSink | None = None
        self.process: str | None = None
        self.rank: Any = None
        self.failures = 0
        self.lock = threading.Lock()


_state = _SinkState()


@functools.cache
def _host() -> str:
    return socket.gethostname()


def current_sink() -> SpanSink | None:
    """The sink configured now (None: spans are logged, not recorded)."""
    return _state.sink


def configure_sink(
    sink: SpanSink | None, *, process: str | None = None, rank: Any = None
) -> SpanSink | None:
    """Send every finished span record to `sink` (None: stop recording); returns the previous
    sink. `process` names this process in records (e.g. "consumer gpu3-dp0"), which trace
    viewers show instead of host:pid; `rank` (default: the `rank` bound in the log context
    now) is recorded for spans finished where the context has none, such as a thread pool's
    threads. Call once in main()."""
    if rank is None:
        rank = structlog.contextvars.get_contextvars().get("rank")
    with _state.lock:
        previous, _state.sink = _state.sink, sink
        _state.process, _state.rank = process, rank
    return previous


def sink_failures() -> int:
    """How many span records the sink raised on (they were dropped, the traced code went on)."""
    return _state.failures


def _emit(record: SpanRecord) -> None:
    sink = _state.sink
    if sink is None:
        return
    if _state.process:
        record["process"] = _state.process
    try:
        sink(record)
    except Exception as exc:  # noqa: BLE001 - tracing must never break the traced code; counted
        _state.failures += 1
        error = f"{type(exc).__name__}: {exc}"
        _log.warning("trace.sink_failed", failures=_state.failures, error=error)
        _log.debug("trace.sink_failed", exc_info=True)


def _make_record(
    *,
    name: str,
    trace_id: str,
    span_id: str,
    parent_span_id: str | None,
    start_time: float,
    duration_ms: float,
    attrs: dict[str, Any],
    error: str | None = None,
    remote_parent: bool = False,
) -> SpanRecord:
    rec: SpanRecord = {
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_span_id": parent_span_id,
        "name": name,
        "start_time": start_time,
        # Records keep ns: children must stay inside parents after a round trip (logs keep µs).
        "duration_ms": round(duration_ms, 6),
        "attrs": attrs,
        "pid": os.getpid(),
        "host": _host(),
    }
    rank = structlog.contextvars.get_contextvars().get("rank", _state.rank)
    if rank is not None:
        rec["rank"] = rank
    if error is not None:
        rec["error"] = error
    if remote_parent:
        rec["remote_parent"] = True
    return rec


# -- finished spans -------------------------------------------------------------------------


class SpanRef:
    """A finished span (a child or a recorded span): carries its identity so more children
    can hang under it, at offsets from its start."""

    def __init__(
        self, name: str, trace_id: str, span_id: str, start_time: float, end_time: float
    ) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = span_id
        self.start_time = start_time
        self.end_time = end_time

    @property
    def carrier(self) -> dict[str, str]:
        """Carrier that makes other work a child of this span."""
        return make_carrier(self.trace_id, self.span_id)

    def child(self, name: str, *, start_s: float, end_s: float, **attrs: Any) -> SpanRef:
        """Record a child at offsets (seconds) from this span's start; returns it."""
        return _finished(
            name,
            trace_id=self.trace_id,
            parent=self.span_id,
            start_time=self.start_time + start_s,
            end_time=self.start_time + end_s,
            attrs=attrs,
            level="info",
        )


def _finished(
    name: str,
    *,
    trace_id: str,
    parent: str | None,
    start_time: float,
    end_time: float,
    attrs: dict[str, Any],
    level: str,
    remote_parent: bool = False,
) -> SpanRef:
    _check_attrs(name, attrs)
    if end_time < start_time:
        raise ValueError(f"span {name!r} ends before it starts ({end_time} < {start_time})")
    ref = SpanRef(name, trace_id, new_id(), start_time, end_time)
    duration = (end_time - start_time) * 1000
    getattr(_log, level)(
        f"{name}.span",
        trace_id=trace_id,
        span_id=ref.span_id,
        parent_span_id=parent,
        start_time=start_time,
        duration_ms=round(duration, 3),
        **attrs,
    )
    _emit(
        _make_record(
            name=name,
            trace_id=trace_id,
            span_id=ref.span_id,
            parent_span_id=parent,
            start_time=start_time,
            duration_ms=duration,
            attrs=attrs,
            remote_parent=remote_parent,
        )
    )
    return ref


def record(
    name: str,
    *,
    start_time: float,
    end_time: float,
    carrier: dict[str, str] | None = None,
    **attrs: Any,
) -> SpanRef:
    """Record a span that already happened, at wall-clock times (unix seconds, e.g. from
    `now()` or a job's `submitted_at`), under `carrier` (a remote parent) or else the current
    span. Logged at debug level as `<name>.span`: a consumer records several per job. An end
    before the start (clocks of two hosts) gives an empty span with `clock_skew_ms`."""
    remote_ids = parse_carrier(carrier)
    if remote_ids is not None:
        (trace_id, parent), remote = remote_ids, True
    else:
        here = current_carrier()
        trace_id, parent = here.get("trace_id") or new_trace_id(), here.get("span_id")
        remote = False
    if end_time < start_time:
        # Times from two hosts (a producer's submitted_at, a consumer's claim) can disagree:
        # keep the span, empty, and say by how much rather than fail the caller.
        attrs = {**attrs, "clock_skew_ms": round((start_time - end_time) * 1000, 3)}
        end_time = start_time
    return _finished(
        name,
        trace_id=trace_id,
        parent=parent,
        start_time=start_time,
        end_time=end_time,
        attrs=attrs,
        level="debug",
        remote_parent=remote,
    )


# -- open spans -----------------------------------------------------------------------------


class Span:
    """An open span; use `span()` to create one."""

    def __init__(
        self,
        name: str,
        trace_id: str,
        parent: str | None,
        attrs: dict[str, Any],
        *,
        remote_parent: bool = False,
    ) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = new_id()
        self.parent_span_id = parent
        self.attrs = attrs
        self.remote_parent = remote_parent
        self._start = time.perf_counter()
        self.start_wall = _WALL0 + (self._start - _PERF0)

    @property
    def carrier(self) -> dict[str, str]:
        """Carrier that makes remote work a child of this span (W3C `traceparent` included)."""
        return make_carrier(self.trace_id, self.span_id)

    def set(self, **attrs: Any) -> None:
        """Add attributes reported on the `.end` event."""
        _check_attrs(self.name, attrs)
        self.attrs.update(attrs)

    def elapsed(self) -> float:
        """Seconds since this span started: take offsets for `child` with it."""
        return time.perf_counter() - self._start

    def child(self, name: str, *, start_s: float, end_s: float, **attrs: Any) -> SpanRef:
        """Record a child measured inside this span, at offsets (seconds) from its start;
        returns it, so grandchildren (a rank's phases under its rank span) can follow."""
        return _finished(
            name,
            trace_id=self.trace_id,
            parent=self.span_id,
            start_time=self.start_wall + start_s,
            end_time=self.start_wall + end_s,
            attrs=attrs,
            level="info",
        )


def _parent(carrier: dict[str, str] | None, root: bool) -> tuple[str, str | None, bool]:
    """(trace id, parent span id, remote) of a new span: the carrier's trace, else a new one
    (root), else the current teacherq span's, else the caller's OpenTelemetry span's, else a
    new trace."""
    remote_ids = parse_carrier(carrier)
    if remote_ids is not None:
        return remote_ids[0], remote_ids[1], True
    if root:
        return new_trace_id(), None, False
    ctx = structlog.contextvars.get_contextvars()
    if ctx.get("trace_id"):
        return ctx["trace_id"], ctx.get("span_id"), False
    ambient = _ambient_parent()
    if ambient is not None:
        return ambient[0], ambient[1], True
    return new_trace_id(), None, False


def start_span(
    name: str, *, carrier: dict[str, str] | None = None, root: bool = False, **attrs: Any
) -> Span:
    """Open a span without making it the current one: for work that starts in one place and
    ends in another while other spans open and close in between (a batch the device computes
    while the host stores the previous one, a job's `submit` inside a transaction). Its
    children are recorded with `Span.child`, its end with `end_span`. Logs in between carry no
    trace ids of it. Parents as `span` does (`carrier`, `root`)."""
    _check_attrs(name, attrs)
    trace_id, parent, remote = _parent(carrier, root)
    s = Span(name, trace_id, parent, dict(attrs), remote_parent=remote)
    _log.debug(f"{name}.start", start_time=s.start_wall, **attrs)
    return s


def end_span(s: Span, exc: BaseException | None = None) -> None:
    """End a span: its `.end` event (a warning with the error, if any) and its record."""
    duration = (time.perf_counter() - s._start) * 1000
    error = None
    if exc is not None:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    extra = {"error": error} if error else {}
    level = "warning" if error else "info"
    # One dict: attrs set late through Span.set() must not collide with our own fields.
    fields = {**s.attrs, "start_time": s.start_wall, "duration_ms": round(duration, 3), **extra}
    getattr(_log, level)(f"{s.name}.end", **fields)
    _emit(
        _make_record(
            name=s.name,
            trace_id=s.trace_id,
            span_id=s.span_id,
            parent_span_id=s.parent_span_id,
            start_time=s.start_wall,
            duration_ms=duration,
            attrs=dict(s.attrs),
            error=error,
            remote_parent=s.remote_parent,
        )
    )


_MISSING = object()


class _SpanScope:
    """What `span()` returns: a (sync or async) context manager and a decorator. Each `with`
    or decorated call opens a fresh Span."""

    def __init__(
        self, name: str, carrier: dict[str, str] | None, root: bool, attrs: dict[str, Any]
    ) -> None:
        self._name = name
        self._carrier = carrier
        self._root = root
        self._attrs = attrs
        # (span, tokens, previous values) per entry, innermost last: one scope object may be
        # entered again while open (recursion through a decorated function).
        self._open: list[tuple[Span, dict[str, contextvars.Token[Any]], dict[str, Any]]] = []

    # -- context manager

    def __enter__(self) -> Span:
        ctx = structlog.contextvars.get_contextvars()
        trace_id, parent, remote = _parent(self._carrier, self._root)
        s = Span(self._name, trace_id, parent, dict(self._attrs), remote_parent=remote)
        bind: dict[str, Any] = {"trace_id": trace_id, "span_id": s.span_id}
        bind["parent_span_id"] = parent
        bind.update({k: self._attrs[k] for k in _CONTEXT_ATTRS if k in self._attrs})
        previous = {k: ctx.get(k, _MISSING) for k in bind}
        tokens = structlog.contextvars.bind_contextvars(**bind)
        self._open.append((s, dict(tokens), previous))
        _log.debug(f"{self._name}.start", start_time=s.start_wall, **self._attrs)
        return s

    def __exit__(self, exc_type: Any, exc: BaseException | None, _tb: Any) -> None:
        s, tokens, previous = self._open.pop()
        end_span(s, exc)
        _restore(tokens, previous)

    async def __aenter__(self) -> Span:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    # -- decorator

    def __call__(self, fn: F) -> F:
        """Wrap `fn` (sync or async) so each call runs in a new span of this name."""
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            # A generator would leave the span bound in its caller's context between yields.
            raise TypeError(f"span cannot decorate generator {fn.__qualname__}; open it inside")
        name, carrier, root, attrs = self._name, self._carrier, self._root, self._attrs
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                async with _SpanScope(name, carrier, root, attrs):
                    return await fn(*args, **kwargs)

            return async_inner  # type: ignore[return-value]  # same signature as fn

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with _SpanScope(name, carrier, root, attrs):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]  # same signature as fn


def _restore(tokens: dict[str, contextvars.Token[Any]], previous: dict[str, Any]) -> None:
    """Undo a span's bindings. Tokens only reset in the context that made them; a span closed
    elsewhere (an async generator finalized by another task) falls back to the saved values."""
    try:
        structlog.contextvars.reset_contextvars(**tokens)
    except ValueError:
        gone = [k for k, v in previous.items() if v is _MISSING]
        structlog.contextvars.unbind_contextvars(*gone)
        structlog.contextvars.bind_contextvars(
            **{k: v for k, v in previous.items() if v is not _MISSING}
        )


def span(
    name: str, *, carrier: dict[str, str] | None = None, root: bool = False, **attrs: Any
) -> _SpanScope:
    """Open a span named `name`: logs `<name>.start`, then `<name>.end` with duration_ms and
    the error if the body raised (the exception propagates), and hands the finished record to
    the sink. Use as `with`, `async with`, or as a decorator of a sync or async function.

    With `carrier`, the span continues a remote trace (its parent ran in another process);
    with `root=True` it starts a new trace even inside another span (a batch shared by many
    jobs' traces). `job_id` / `batch_id` attrs are also bound into the log context.
    """
    _check_attrs(name, attrs)
    return _SpanScope(name, carrier, root, attrs)


def traced(name: str | None = None, **attrs: Any) -> Callable[[F], F]:
    """Decorator form of `span` for sync and async functions (name defaults to the
    function's qualified name)."""

    def wrap(fn: F) -> F:
        return span(name or fn.__qualname__, **attrs)(fn)

    return wrap


class PhaseClock:
    """Times named phases of one call (h2d, forward, head, d2h of a batch on one rank) as
    offsets in seconds from the clock's creation, for `attach_phases` — also on ranks that
    record no spans themselves: their offsets travel to the leader in a small collective.

    Device work is asynchronous: the host leaves a phase as soon as the work is queued. Give
    `device_mark` (e.g. `consumer.group.agreement.cuda_marks`) to charge each phase until its device
    work is done: called at the end of each phase it marks the device's queue and returns a
    callable that later resolves to the moment, in seconds from the clock's creation, the
    device got there. Marks are read only in `offsets`, so the clock never makes the host wait
    for the device; a phase then ends at the later of its host end and its device end.
    """

    def __init__(self, *, device_mark: Callable[[], Callable[[], float]] | None = None) -> None:
        self._t0 = time.perf_counter()
        self._mark = device_mark
        self._host: dict[str, tuple[float, float]] = {}
        self._device_end: dict[str, Callable[[], float]] = {}

    @property
    def phases(self) -> dict[str, tuple[float, float]]:
        """name -> (start, end) in seconds from the clock's creation (resolves device marks)."""
        out = {}
        for name, (start, end) in self._host.items():
            resolve = self._device_end.get(name)
            out[name] = (start, max(end, resolve()) if resolve else end)
        return out

    @contextmanager
    def phase(self, name: str, *, on_device: bool = True) -> Iterator[None]:
        """Time the body as phase `name` (a repeated name extends the first start to the
        last end: a head run in chunks is one `head` phase). `on_device`=False: host work
        only, no device mark (a mark queued behind later work would end the phase late)."""
        start = time.perf_counter() - self._t0
        try:
            yield
        finally:
            if self._mark is not None and on_device:
                self._device_end[name] = self._mark()
            end = time.perf_counter() - self._t0
            first = self._host.get(name)
            self._host[name] = (first[0] if first else start, end)

    def offsets(self, names: Sequence[str]) -> list[float]:
        """[start, end] per name, flattened, in the order given (0, 0 for a phase that did not
        run): a fixed-size vector every rank can all-gather."""
        phases = self.phases
        flat: list[float] = []
        for name in names:
            flat += list(phases.get(name, (0.0, 0.0)))
        return flat


def attach_phases(
    parent: Span | SpanRef,
    name: str,
    names: Sequence[str],
    offsets: Sequence[float],
    *,
    at_s: float,
    **attrs: Any,
) -> SpanRef | None:
    """Hang one rank's phases under `parent`: a `name` span from the first phase's start to
    the last one's end, with a child per phase that ran. `offsets` is `PhaseClock.offsets`
    (from any rank); `at_s` is where, in seconds from the parent's start, the rank's clock
    started (the leader's moment after the broadcast). Returns the rank span (None if no
    phase ran)."""
    ran = [
        (n, float(offsets[2 * i]), float(offsets[2 * i + 1]))
        for i, n in enumerate(names)
        if offsets[2 * i + 1] > 0  # (0, 0): the phase did not run on that rank
    ]
    if not ran:
        return None
    lo, hi = min(r[1] for r in ran), max(r[2] for r in ran)
    rank_span = parent.child(name, start_s=at_s + lo, end_s=at_s + hi, **attrs)
    for phase, start, end in ran:
        rank_span.child(phase, start_s=start - lo, end_s=end - lo)
    return rank_span


def propagate(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `fn` to run in a copy of the current context, so spans opened in another thread
    (threading.Thread, ThreadPoolExecutor, which do not copy contexts) nest under the span
    open here. Each call gets its own copy: one callable may run in many threads at once."""
    ctx = contextvars.copy_context()

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return ctx.copy().run(fn, *args, **kwargs)

    return inner
