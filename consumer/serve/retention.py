"""Stream retention: trim job entries every consumer group is done with."""

from __future__ import annotations

import time

import redis
import structlog

log = structlog.get_logger("teacherq.consumer")


class Janitor:
    """Trims a jobs stream at most once per `interval_s` (called from the leader's loop)."""

    def __init__(self, client: redis.Redis, stream: str, *, interval_s: float) -> None:
        self.r = client
        self.stream = stream
        self.interval_s = interval_s
        self._next = 0.0

    def maybe_trim(self) -> None:
        """Trim if the interval has passed; a Redis error is logged, never raised."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        try:
            trimmed = trim_acknowledged(self.r, self.stream)
        except redis.RedisError as exc:
            log.warning("janitor.failed", error=str(exc))
            return
        if trimmed:
            log.info("janitor.trimmed", stream=self.stream, entries=trimmed)


def trim_acknowledged(r: redis.Redis, stream: str) -> int:
    """Trim a stream below the oldest entry any group still needs; returns entries removed.

    An entry is still needed while it is pending in some group or not yet delivered to some
    group, so the cut is the minimum over groups of (oldest pending id, first undelivered id).
    Trimming with MINID never removes an entry at or above the cut: no unacknowledged work is
    ever deleted.
    """
    groups = r.xinfo_groups(stream)
    if not groups:
        return 0
    cuts = []
    for g in groups:
        summary = r.xpending(stream, g["name"])
        if summary["pending"]:
            cuts.append(_id_tuple(summary["min"]))
        ms, seq = _id_tuple(g["last-delivered-id"])
        cuts.append((ms, seq + 1))
    ms, seq = min(cuts)
    return int(r.xtrim(stream, minid=f"{ms}-{seq}", approximate=False))


def _id_tuple(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
