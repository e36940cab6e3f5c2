"""Reading work from the jobs stream as one consumer of the group.

Order of sources, per call of `next_entries`:
1. this consumer's own pending list (ID 0) until it is empty — work it held before a restart
   under the same name;
2. entries idle past the visibility timeout, taken over with XAUTOCLAIM (cursor kept across
   calls, so a long pending list is walked, not rescanned). Live consumers refresh their
   in-flight entries every heartbeat (`touch`), so only entries of dead or stuck consumers
   ever idle that long;
3. new entries (`>`), blocking up to `block_ms`.

Entries deleted by trimming while pending come back empty from Redis; they are reported as
deleted (logged and counted) and acknowledged so they do not linger in the pending list.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis
import structlog

from shared.streams import Entry, StreamReply, Streams

log = structlog.get_logger("teacherq.claims")


@dataclass
class ClaimStats:
    """Counts for logs, heartbeats and metrics."""

    reclaimed: int = 0
    deleted: int = 0
    deleted_ids: list[str] = field(default_factory=list)


class Claimer:
    """Fetches entries for one consumer name of the group."""

    def __init__(
        self,
        streams: Streams,
        name: str,
        *,
        visibility_timeout_s: float,
        block_ms: int,
    ) -> None:
        self.streams = streams
        self.r = streams.r
        self.name = name
        self.visibility_ms = int(visibility_timeout_s * 1000)
        self.block_ms = block_ms
        self.stats = ClaimStats()
        self._own_pending_done = False
        self._own_cursor = "0-0"
        self.last_was_redelivery = False
        self._cursor = "0-0"
        self._next_claim = 0.0

    def next_entries(self, count: int) -> list[Entry]:
        """Up to `count` new entries, or one redelivered entry (possibly none after blocking).

        `last_was_redelivery` tells whether the returned entries were delivered before."""
        self.last_was_redelivery = True
        # Redelivered entries come one at a time: each read counts a delivery for every entry
        # it returns, and one of them may be the poison that killed the last holder — reading
        # them in bulk would count deliveries against innocent entries behind it.
        if not self._own_pending_done:
            # Walk our pending list forward from a cursor: entries handed out earlier may not
            # be acknowledged yet (writes finish in the background) and must not come again.
            reply = cast(
                StreamReply,
                self.r.xreadgroup(
                    self.streams.group, self.name, {self.streams.jobs: self._own_cursor}, count=1
                ),
            )
            raw = reply[0][1] if reply else []
            if raw:
                self._own_cursor = raw[-1][0].decode()
                entries = self._drop_deleted(raw)
                return entries if entries else self.next_entries(count)
            self._own_pending_done = True
        now = time.monotonic()
        if now >= self._next_claim:
            # Walk the whole pending list once per half visibility timeout.
            claimed = self._autoclaim(1)
            if claimed:
                return claimed
            if self._cursor == "0-0":
                self._next_claim = now + self.visibility_ms / 2000
        self.last_was_redelivery = False
        return self._read(">", count, block=self.block_ms)

    def _read(self, from_id: str, count: int, *, block: int | None) -> list[Entry]:
        reply = cast(
            StreamReply,
            self.r.xreadgroup(
                self.streams.group, self.name, {self.streams.jobs: from_id}, count=count,
                block=block,
            ),
        )  # fmt: skip
        entries = reply[0][1] if reply else []
        return self._drop_deleted(entries)

    def _autoclaim(self, count: int) -> list[Entry]:
        reply = self.r.xautoclaim(
            self.streams.jobs,
            self.streams.group,
            self.name,
            min_idle_time=self.visibility_ms,
            start_id=self._cursor,
            count=count,
        )
        cursor, entries, deleted = cast(tuple[bytes, list[Entry], list[bytes]], reply)
        self._cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        if deleted:
            # XAUTOCLAIM already removed these from the pending list.
            ids = [d.decode() if isinstance(d, bytes) else str(d) for d in deleted]
            self.stats.deleted += len(ids)
            self.stats.deleted_ids = (self.stats.deleted_ids + ids)[-100:]
            log.warning("claim.deleted_entries", count=len(ids), ids=ids[:10])
        entries = self._drop_deleted(entries)
        if entries:
            self.stats.reclaimed += len(entries)
            log.info("claim.reclaimed", count=len(entries), consumer=self.name)
        return entries

    def _drop_deleted(self, entries: list[Entry]) -> list[Entry]:
        kept: list[Entry] = []
        gone: list[Entry] = []
        for entry_id, fields in entries:
            (kept if fields else gone).append((entry_id, fields))
        if gone:
            ids = [eid.decode() for eid, _ in gone]
            self.stats.deleted += len(ids)
            log.warning("claim.deleted_entries", count=len(ids), ids=ids[:10])
            self.r.xack(self.streams.jobs, self.streams.group, *[eid for eid, _ in gone])
        return kept

    def delivery_counts(self, entry_ids: Sequence[bytes]) -> dict[bytes, int]:
        """How often each entry has been delivered (XPENDING), for the dead-letter rule."""
        if not entry_ids:
            return {}
        rows = self.r.xpending_range(
            self.streams.jobs,
            self.streams.group,
            min=min(entry_ids),
            max=max(entry_ids),
            count=max(len(entry_ids) * 2, 100),
            consumername=self.name,
        )
        return {
            row["message_id"]: int(row["times_delivered"])
            for row in cast(list[dict[str, Any]], rows)
        }

    def touch(self, entry_ids: Sequence[str]) -> None:
        """Reset the idle time of entries we are still working on (XCLAIM JUSTID to ourselves
        does not count as a delivery), so no other consumer takes them over."""
        if entry_ids:
            try:
                self.r.xclaim(
                    self.streams.jobs,
                    self.streams.group,
                    self.name,
                    min_idle_time=0,
                    message_ids=list(entry_ids),
                    justid=True,
                )
            except redis.RedisError as exc:
                log.warning("claim.touch_failed", error=str(exc))
