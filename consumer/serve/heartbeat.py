"""The consumer's heartbeat thread: liveness for others, and a watchdog for itself.

Every `interval_s` it (1) refreshes the idle time of every entry the consumer holds, so the
reclaim loop of other consumers never takes work from a live, slow one, (2) records this
consumer's state in the queue's consumers hash, and (3) checks the batch in hand: one running
longer than `job_timeout_s` is hung, so the thread stops refreshing and exits the process —
its entries are then redelivered elsewhere (up to the dead-letter limit).

(1) and (2) are independent: a failed heartbeat write never skips the refresh. Both work while
Redis is full (maxmemory, noeviction): XCLAIM is not refused under OOM, and the heartbeat
record, one small field overwritten in place, is written by a script flagged `allow-oom` — a
full Redis must not make live consumers look dead.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
import structlog

from consumer.serve.claims import Claimer
from shared.redis_client import run_script

log = structlog.get_logger("teacherq.heartbeat")

# Overwrites one field of the consumers hash; allowed while Redis is at maxmemory (the record
# replaces one of the same size), so liveness stays visible when every other write is refused.
_BEAT = """#!lua flags=allow-oom
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

EXIT_HUNG = 124  # like timeout(1)


class Heartbeat:
    """Background heartbeat; `state`, `held` and `batch_started` are set by the loop."""

    def __init__(
        self,
        *,
        client: redis.Redis,
        key: str,
        name: str,
        claimer: Claimer,
        interval_s: float,
        job_timeout_s: float,
        describe: Callable[[], dict[str, Any]],
    ) -> None:
        self.r = client
        self.key = key
        self.name = name
        self.claimer = claimer
        self.interval_s = interval_s
        self.job_timeout_s = job_timeout_s
        self.describe = describe
        self.state = "starting"
        self.held: set[str] = set()  # entry ids claimed and not yet acknowledged
        self.batch_started: float | None = None  # monotonic start of the batch in hand
        self.last_beat = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tq-heartbeat", daemon=True)
        self._beat = client.register_script(_BEAT)
        self.extra: dict[str, Any] = {}  # more fields for the record (e.g. Redis memory)
        # Called on this thread before each beat (sampling Redis memory, noticing a stop).
        self.on_beat: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def clock_stopped(self) -> Iterator[None]:
        """The hang watchdog does not count while the block runs (the loop waits on Redis, for
        room among the writers or for a write to land, which is not the device hanging); a
        batch in hand is timed afresh after it."""
        started, self.batch_started = self.batch_started, None
        try:
            yield
        finally:
            if started is not None:
                self.batch_started = time.monotonic()

    def start(self) -> None:
        """Beat once now (if Redis lets us), then every interval."""
        try:
            self.beat()
        except redis.RedisError as exc:  # the thread keeps trying
            log.warning("heartbeat.failed", error=str(exc))
        self._thread.start()

    def stop(self, final_state: str = "stopped") -> None:
        """Stop the thread and record a final state."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        self.state = final_state
        try:
            self.beat()
        except redis.RedisError as exc:
            log.warning("heartbeat.final_failed", error=str(exc))

    def hold(self, entry_ids: list[str]) -> None:
        """Entries just claimed."""
        with self._lock:
            self.held.update(entry_ids)

    def holds(self, entry_id: str) -> bool:
        """Whether an entry is claimed here and not yet acknowledged."""
        with self._lock:
            return entry_id in self.held

    def release(self, entry_id: str) -> None:
        """An entry acknowledged."""
        with self._lock:
            self.held.discard(entry_id)

    def beat(self) -> None:
        """Record state now."""
        with self._lock:
            held = sorted(self.held)
        record = {"state": self.state, "time": time.time(), "in_flight": len(held)}
        record.update(self.describe())
        record.update(self.extra)
        run_script(self._beat, keys=[self.key], args=[self.name, json.dumps(record)])
        self.last_beat = time.monotonic()

    def refresh(self) -> None:
        """Reset the idle time of the entries we hold (see Claimer.touch)."""
        with self._lock:
            held = list(self.held)
        self.claimer.touch(held)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            started = self.batch_started
            if started is not None and time.monotonic() - started > self.job_timeout_s:
                log.error(
                    "consumer.hung",
                    batch_running_s=round(time.monotonic() - started, 1),
                    job_timeout_s=self.job_timeout_s,
                )
                os._exit(EXIT_HUNG)
            # Refresh first and on its own: our entries must not idle out because some other
            # write failed (a failed refresh is logged inside and retried next interval).
            self.refresh()
            for hook in self.on_beat:
                try:
                    hook()
                except redis.RedisError as exc:
                    log.warning("heartbeat.hook_failed", error=str(exc))
            try:
                self.beat()
            except redis.RedisError as exc:  # Redis restarting: keep beating once it is back
                log.warning("heartbeat.failed", error=str(exc))
