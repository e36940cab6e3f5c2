"""Redis memory as a limit every teacherq process watches.

teacherq needs `maxmemory-policy noeviction`: a full Redis refuses writes instead of dropping
queued jobs or results. So memory is a hard limit like the pending-token bound: submit refuses
(or blocks) above `queue.max_memory_fraction` of `maxmemory`, consumers stop taking new work
above `consumer.memory_pause_fraction` (and resume when there is room), and `teacherq status`
and the consumer metrics show used / limit and the projected time to full.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster


@dataclass(frozen=True)
class MemoryInfo:
    """`used` bytes of a `limit` (maxmemory; 0 means no limit)."""

    used: int
    limit: int

    @property
    def fraction(self) -> float | None:
        """used / limit, or None without a limit."""
        return self.used / self.limit if self.limit else None

    def above(self, fraction: float) -> bool:
        """True when a limit is set and usage is above `fraction` of it."""
        f = self.fraction
        return f is not None and f > fraction

    def describe(self) -> str:
        """E.g. '461.2 MiB of 512.0 MiB (90.1 %)'."""
        if not self.limit:
            return f"{_mib(self.used)} (no maxmemory set)"
        return f"{_mib(self.used)} of {_mib(self.limit)} ({100 * self.used / self.limit:.1f} %)"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def read_memory(r: redis.Redis, *, key: str | None = None) -> MemoryInfo:
    """Used memory and maxmemory from INFO memory (a read: answered while Redis is full).
    On a cluster, of the primary holding `key` (a queue's key: the shard the queue fills);
    without a key, of whichever node the client picks."""
    node = r
    if key is not None and isinstance(r, RedisCluster):
        node = r.get_redis_connection(r.get_node_from_key(key))
    return memory_from_info(node.info("memory"))


def memory_from_info(info: dict[str, Any]) -> MemoryInfo:
    """MemoryInfo from an `INFO memory` reply (read by the caller, e.g. asyncio)."""
    return MemoryInfo(used=int(info.get("used_memory", 0)), limit=int(info.get("maxmemory", 0)))


class GrowthTracker:
    """Memory samples over a sliding window: growth rate and projected time to full."""

    def __init__(self, window_s: float = 300.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, info: MemoryInfo, at: float | None = None) -> None:
        """Record a sample (monotonic seconds)."""
        t = time.monotonic() if at is None else at
        self._samples.append((t, info.used))
        while self._samples and t - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def bytes_per_s(self) -> float | None:
        """Growth over the window (negative: shrinking); None with fewer than two samples
        a second apart."""
        if len(self._samples) < 2:
            return None
        (t0, u0), (t1, u1) = self._samples[0], self._samples[-1]
        return (u1 - u0) / (t1 - t0) if t1 - t0 >= 1.0 else None

    def seconds_to_full(self, info: MemoryInfo) -> float | None:
        """At the current growth rate, seconds until `maxmemory`; None if not growing or no
        limit (0 when already full)."""
        return seconds_to_full(info, self.bytes_per_s())


def seconds_to_full(info: MemoryInfo, rate: float | None) -> float | None:
    """Seconds until `info.limit` at `rate` bytes/s; None if not growing or no limit."""
    if not info.limit:
        return None
    if info.used >= info.limit:
        return 0.0
    if rate is None or rate <= 0:
        return None
    return (info.limit - info.used) / rate


def memory_fields(info: MemoryInfo, rate: float | None) -> dict[str, float | int | None]:
    """The JSON fields heartbeats and `status --json` carry."""
    eta = seconds_to_full(info, rate)
    return {
        "used_bytes": info.used,
        "limit_bytes": info.limit,
        "fraction": None if info.fraction is None else round(info.fraction, 4),
        "growth_bytes_per_s": None if rate is None else round(rate, 1),
        "seconds_to_full": None if eta is None else round(eta, 1),
    }
