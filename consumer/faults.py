"""Fault injection for the fault-tolerance tests: exit abruptly at a named point.

`consumer.crash_at = "<point>:<n>"` makes the process call os._exit(137) — as abrupt as
kill -9: no finally blocks, no flushes — the n-th time it reaches `<point>`. Points: `read`
(entries claimed, nothing computed), `compute` (inside a batch's scoring), `stored` (bulk
arrays uploaded, no result record yet), `acked` (record written and entry acknowledged).
Unset in production; the check is one comparison.

`consumer.raise_at = "<rank>:<n>"` makes global rank `<rank>` raise InjectedFault while
checking its n-th batch, before the group agrees to compute: the test that a failure on a
non-leader rank is agreed by the whole group and hangs no one.
"""

from __future__ import annotations

import os
import threading

POINTS = ("read", "compute", "stored", "acked")


class InjectedFault(RuntimeError):
    """Raised by `consumer.raise_at`."""


class FaultInjector:
    """Counts arrivals at each point and exits (or raises) at the configured one."""

    def __init__(self, spec: str | None, *, raise_at: str | None = None, rank: int = 0) -> None:
        self.raise_rank, self.raise_n, self._checks = -1, 0, 0
        if raise_at:
            r, _, n = raise_at.partition(":")
            if not (r.isdigit() and n.isdigit() and int(n) >= 1):
                raise ValueError(f"consumer.raise_at={raise_at!r}: expected <rank>:<n>, n >= 1")
            self.raise_rank, self.raise_n = int(r), int(n)
        self.rank = rank
        self.point: str | None = None
        self.at = 0
        if spec:
            point, _, n = spec.partition(":")
            if point not in POINTS or not n.isdigit() or int(n) < 1:
                raise ValueError(
                    f"consumer.crash_at={spec!r}: expected <point>:<n> with point in "
                    f"{POINTS} and n >= 1"
                )
            self.point, self.at = point, int(n)
        self._seen = 0
        self._lock = threading.Lock()

    def reached(self, point: str) -> None:
        """Call at each point; exits the process at the configured arrival."""
        if point != self.point:
            return
        with self._lock:
            self._seen += 1
            if self._seen == self.at:
                os._exit(137)

    def check_batch(self) -> None:
        """Call once per batch on every rank; raises on the configured rank and batch."""
        if self.rank != self.raise_rank:
            return
        self._checks += 1
        if self._checks == self.raise_n:
            raise InjectedFault(f"injected failure on rank {self.rank}, batch {self._checks}")
