"""Time spent in each phase of loading a teacher (build, read, copy), for the start-up log.

The caller that wants the split opens `recording()`; loaders mark their phases with
`phase(name)`, which costs nothing when nobody records. A context variable carries the
record, so the loaders' signatures stay as they are.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_current: ContextVar[dict[str, float] | None] = ContextVar("teacherq_load_phases", default=None)


@contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Collect the seconds of every `phase` run inside, summed by name, into the dict
    yielded."""
    phases: dict[str, float] = {}
    token = _current.set(phases)
    try:
        yield phases
    finally:
        _current.reset(token)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the time inside to phase `name` of the current recording (if any)."""
    phases = _current.get()
    if phases is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
