"""Fault injection for the fault-tolerance tests: exit abruptly at a named point.

`consumer.crash_at = "<point>:<n>"` makes the process call os._exit(137) — as abrupt as
kill -9: no finally blocks, no flushes — the n-th time it reaches `<point>`. Points: `read`
(entries claimed, nothing computed), `compute` (inside a batch's scoring), `stored` (bulk
arrays uploaded, no result record yet), `acked` (record written and entry acknowledged).
Unset in production; the check is one comparison.

`consumer.poison = "<mode>:<token id>"` turns every job whose input_ids contain that token into
a poison job: `raise` (scoring it raises), `exit` (the process exits abruptly) or `hang` (it
never finishes, so the hang watchdog fires).

`consumer.raise_at = "<rank>:<n>"` makes global rank `<rank>` raise InjectedFault while
checking its n-th batch, before the group agrees to compute: the test that a failure on a
non-leader rank is agreed by the whole group and hangs no one.
"""

from __future__ import annotations

import os
import threading
import time

import torch

POINTS = ("read", "compute", "stored", "acked")
POISON_MODES = ("raise", "exit", "hang")


class InjectedFault(RuntimeError):
    """Raised by `consumer.raise_at`."""


class FaultInjector:
    """Counts arrivals at each point and exits (or raises) at the configured one."""

    def __init__(
        self,
        spec: str | None,
        *,
        raise_at: str | None = None,
        poison: str | None = None,
        rank: int = 0,
    ) -> None:
        self.poison_mode, self.poison_token = None, -1
        if poison:
            mode, _, token = poison.partition(":")
            if mode not in POISON_MODES or not token.isdigit():
                raise ValueError(
                    f"consumer.poison={poison!r}: expected <mode>:<token id>, "
                    f"mode in {POISON_MODES}"
                )
            self.poison_mode, self.poison_token = mode, int(token)
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

    def check_batch(self, input_ids: torch.Tensor) -> None:
        """Call once per batch on every rank: poison jobs and injected rank failures fire."""
        if self.poison_mode and bool((input_ids == self.poison_token).any()):
            if self.poison_mode == "exit":
                os._exit(137)
            if self.poison_mode == "hang":
                while True:
                    time.sleep(3600)
            raise InjectedFault(f"poison job (token {self.poison_token})")
        if self.rank != self.raise_rank:
            return
        self._checks += 1
        if self._checks == self.raise_n:
            raise InjectedFault(f"injected failure on rank {self.rank}, batch {self._checks}")
