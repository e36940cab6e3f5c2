"""Memory pressure: when a consumer stops taking new work, and when it resumes.

Sampled by the heartbeat thread every interval (INFO memory is a read, answered while Redis is
full). The consumer takes no new work — neither new entries nor takeovers — while Redis uses
more than `consumer.memory_pause_fraction` of its maxmemory, or while its own result writes are
refused as out of memory: results it computed could not be stored, would be held in the
process, and their entries would idle towards a takeover elsewhere — computing them twice.
It resumes once Redis has room again (acknowledgements, trimming, results read, TTLs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
import structlog

from shared.memory import GrowthTracker, MemoryInfo, memory_fields, read_memory

log = structlog.get_logger("teacherq.pressure")


class MemoryWatch:
    """Redis memory as this consumer sees it; `paused` says whether to take new work."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        pause_fraction: float,
        writes_refused: Callable[[], bool],
        window_s: float = 300.0,
        key: str | None = None,
    ) -> None:
        self.r = client
        self.key = key  # a key of the queue: on a cluster, its shard's memory is watched
        self.pause_fraction = pause_fraction
        self.writes_refused = writes_refused
        self.growth = GrowthTracker(window_s)
        self.info: MemoryInfo | None = None
        self._above = False
        self._paused = False
        self.pauses = 0

    def sample(self) -> dict[str, Any]:
        """Read Redis memory now; returns the fields heartbeats and metrics carry."""
        self.info = read_memory(self.r, key=self.key)
        self.growth.add(self.info)
        self._above = self.info.above(self.pause_fraction)
        self.update()
        return memory_fields(self.info, self.growth.bytes_per_s())

    @property
    def paused(self) -> bool:
        """True while the consumer should take no new work."""
        return self.update()

    def update(self) -> bool:
        """Re-evaluate (the writers' state changes between samples); logs transitions."""
        now = self._above or self.writes_refused()
        if now != self._paused:
            self._paused = now
            if now:
                self.pauses += 1
                log.warning(
                    "consumer.paused",
                    reason="redis_memory" if self._above else "writes_refused",
                    memory=self.info.describe() if self.info else None,
                    pause_fraction=self.pause_fraction,
                )
            else:
                log.info("consumer.resumed", memory=self.info.describe() if self.info else None)
        return now
