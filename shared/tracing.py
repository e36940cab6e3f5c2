"""Spans on structlog contextvars: nested, cross-process, logged as `<name>.start` / `.end`.

A span binds `trace_id`, `span_id` and `parent_span_id` into structlog's context for its
duration, so every log line inside it carries them. A trace crosses processes through a small
carrier dict (`{"trace_id": ..., "span_id": ...}`) that travels inside the TeacherRequest.
Phases measured inside one call can be attached afterwards as children with explicit offsets
(`Span.child`), e.g. the h2d / forward / head / d2h phases of a batch.
"""

from __future__ import annotations

import functools
import inspect
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import structlog

F = TypeVar("F", bound=Callable[..., Any])
_log = structlog.get_logger("teacherq.trace")


def new_id() -> str:
    """A random 64-bit span/trace id as 16 hex chars."""
    return secrets.token_hex(8)


def current_carrier() -> dict[str, str]:
    """The carrier of the innermost open span (empty outside any span)."""
    ctx = structlog.contextvars.get_contextvars()
    if "trace_id" not in ctx:
        return {}
    return {"trace_id": ctx["trace_id"], "span_id": ctx["span_id"]}


class Span:
    """An open span; use `span()` to create one."""

    def __init__(self, name: str, trace_id: str, parent: str | None, attrs: dict[str, Any]):
        self.name = name
        self.trace_id = trace_id
        self.span_id = new_id()
        self.parent_span_id = parent
        self.attrs = attrs
        self.start_wall = time.time()
        self._start = time.perf_counter()

    @property
    def carrier(self) -> dict[str, str]:
        """Carrier that makes remote work a child of this span."""
        return {"trace_id": self.trace_id, "span_id": self.span_id}

    def set(self, **attrs: Any) -> None:
        """Add attributes reported on the `.end` event."""
        self.attrs.update(attrs)

    def child(self, name: str, *, start_s: float, end_s: float, **attrs: Any) -> None:
        """Record a child measured inside this span, at offsets (seconds) from its start."""
        _log.info(
            f"{name}.span",
            trace_id=self.trace_id,
            span_id=new_id(),
            parent_span_id=self.span_id,
            start_time=self.start_wall + start_s,
            duration_ms=round((end_s - start_s) * 1000, 3),
            **attrs,
        )


@contextmanager
def span(name: str, *, carrier: dict[str, str] | None = None, **attrs: Any) -> Iterator[Span]:
    """Open a span named `name`: logs `<name>.start`, then `<name>.end` with duration_ms and
    the error if the body raised. With `carrier`, the span continues a remote trace."""
    ctx = structlog.contextvars.get_contextvars()
    if carrier and "trace_id" in carrier:
        trace_id, parent = carrier["trace_id"], carrier.get("span_id")
    else:
        trace_id, parent = ctx.get("trace_id") or new_id(), ctx.get("span_id")
    s = Span(name, trace_id, parent, dict(attrs))
    tokens = structlog.contextvars.bind_contextvars(
        trace_id=trace_id, span_id=s.span_id, parent_span_id=parent
    )
    _log.debug(f"{name}.start", start_time=s.start_wall, **attrs)
    error: BaseException | None = None
    try:
        yield s
    except BaseException as exc:
        error = exc
        raise
    finally:
        duration = round((time.perf_counter() - s._start) * 1000, 3)
        extra = {"error": f"{type(error).__name__}: {error}"} if error else {}
        _log.info(f"{name}.end", start_time=s.start_wall, duration_ms=duration, **s.attrs, **extra)
        structlog.contextvars.reset_contextvars(**tokens)


def traced(name: str | None = None, **attrs: Any) -> Callable[[F], F]:
    """Decorator form of `span` for sync and async functions."""

    def wrap(fn: F) -> F:
        span_name = name or fn.__qualname__
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                with span(span_name, **attrs):
                    return await fn(*args, **kwargs)

            return async_inner  # type: ignore[return-value]  # same signature as fn

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with span(span_name, **attrs):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]  # same signature as fn

    return wrap
