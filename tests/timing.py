"""Every deadline a test waits under comes from here, so that a busy machine (a shared CI
runner, a laptop compiling something) can stretch them all at once: `TEACHERQ_TEST_TIMEOUT_SCALE`
(a positive number, default 1) multiplies each one. Tests wait on conditions (a consumer's
state, a stream entry, a log line) with `wait_until`; a deadline is only how long to give up
after, never how long to sleep."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

ENV = "TEACHERQ_TEST_TIMEOUT_SCALE"


def _scale() -> float:
    raw = os.environ.get(ENV, "1")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected a positive number, e.g. 2") from None
    if not value > 0:
        raise ValueError(f"{ENV}={raw!r}: expected a positive number, e.g. 2")
    return value


SCALE = _scale()


def scaled(seconds: float) -> float:
    """`seconds` stretched by TEACHERQ_TEST_TIMEOUT_SCALE: the one place deadlines come from."""
    return seconds * SCALE


def wait_until(
    check: Callable[[], T],
    what: str,
    *,
    timeout: float = 30.0,
    interval: float = 0.05,
) -> T:
    """Call `check` until it returns something truthy and return that; raise TimeoutError
    naming `what` after `timeout` seconds (scaled). `interval` is the poll period, not a wait
    for anything to happen."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {limit:.0f} s")
        time.sleep(interval)
