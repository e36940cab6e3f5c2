"""Reading work from the jobs stream as one consumer of the group.

Order of sources, per call of `next_entries`:
1. this consumer's own pending list (ID 0) until it is empty — work it held before a restart
   under the same name;
2. entries of dead consumers (consumer/serve/liveness.py: heartbeat silent for a few intervals, or
   stopped), taken over at once — without waiting for the visibility timeout;
3. entries idle past the visibility timeout (XPENDING IDLE, cursor kept across calls, so a long
   pending list is walked, not rescanned). Live consumers refresh their in-flight entries every
   heartbeat (`touch`), so only entries of dead or stuck consumers, or of one whose refresh
   failed, idle that long. When the owner is alive by its heartbeat, the takeover keeps the
   entry's delivery count (XCLAIM RETRYCOUNT): the owner's failed refresh is not a failed
   attempt of the job, and must not push it towards the dead-letter stream.
   Our own idle entries are taken again too, unless this process still works on them
   (`holding`): an entry delivered to us whose reply never arrived (Redis killed or failed
   over after the read ran, the client retrying the read) sits in our pending list unknown to
   us, and nobody else takes it while our heartbeat is fresh;
4. new entries (`>`), blocking up to `block_ms`.

Entries deleted by trimming while pending come back empty from Redis; they are reported as
deleted (logged and counted) and acknowledged so they do not linger in the pending list.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis
import structlog

from consumer.serve.liveness import Reaper, is_dead, peers
from shared import keys
from shared.redis_client import run_script
from shared.streams import Entry, StreamReply, Streams

log = structlog.get_logger("teacherq.claims")

# KEYS: jobs stream. ARGV: group, consumer, entry ids. Resets the idle time of those entries
# that this consumer still owns (XCLAIM JUSTID counts no delivery); an entry another consumer
# took over stays with it — a blind XCLAIM would take it back, and both would compute it.
# Not refused while Redis is full (XPENDING reads, XCLAIM is not a denyoom command).
_TOUCH = """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
"""


@dataclass
class ClaimStats:
    """Counts for logs, heartbeats and metrics."""

    reclaimed: int = 0
    reclaimed_from_dead: int = 0  # taken over because the owner's heartbeat stopped
    reclaimed_from_live: int = 0  # idle entries of a live owner (no delivery counted)
    touch_failures: int = 0
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
        consumers_key: str | None = None,
        heartbeat_interval_s: float = 5.0,
        dead_after_beats: int = 3,
    ) -> None:
        self.streams = streams
        self.r = streams.r
        self.name = name
        self.visibility_ms = int(visibility_timeout_s * 1000)
        self.block_ms = block_ms
        self.dead_after_s = dead_after_beats * heartbeat_interval_s
        self.scan_interval_s = heartbeat_interval_s
        self.consumers_key = consumers_key or keys.consumers_key(streams.queue)
        # Whether this process still works on an entry of ours (the heartbeat's held set, set
        # once the heartbeat exists); while None our own idle entries are left alone.
        self.holding: Callable[[str], bool] | None = None
        self.reaper = Reaper(
            self.r,
            stream=streams.jobs,
            group=streams.group,
            consumers_key=self.consumers_key,
            me=name,
            dead_after_s=self.dead_after_s,
            visibility_timeout_s=visibility_timeout_s,
        )
        self._touch = self.r.register_script(_TOUCH)
        self._orphans: list[bytes] = []  # entries of dead consumers, to take over one by one
        self._next_scan = 0.0
        self.stats = ClaimStats()
        self._own_pending_done = False
        self._own_cursor = "0-0"
        self.last_was_redelivery = False
        self._cursor = "-"
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
        if now >= self._next_scan:
            self._next_scan = now + self.scan_interval_s
            self._scan_dead()
        while self._orphans:
            claimed = self._take_orphan(self._orphans.pop(0))
            if claimed:
                return claimed
        if now >= self._next_claim:
            # Walk the whole pending list once per half visibility timeout.
            claimed = self._claim_idle()
            if claimed:
                return claimed
            if self._cursor == "-":
                self._next_claim = now + self.visibility_ms / 2000
        self.last_was_redelivery = False
        return self._read(">", count, block=self.block_ms)

    def _read(self, from_id: str, count: int, *, block: int | None) -> list[Entry]:
        reply = cast(
            StreamReply,
            self.r.xreadgroup(
                self.streams.group,
                self.name,
                {self.streams.jobs: from_id},
                count=count,
                block=block,
            ),
        )
        entries = reply[0][1] if reply else []
        return self._drop_deleted(entries)

    def _scan_dead(self) -> None:
        """Note the entries of dead consumers (taken over next, one per call), and prune dead
        consumers that hold nothing."""
        try:
            holding = self.reaper.sweep()
            for peer in holding:
                rows = self.r.xpending_range(
                    self.streams.jobs,
                    self.streams.group,
                    min="-",
                    max="+",
                    count=1000,
                    consumername=peer.name,
                )
                ids = [row["message_id"] for row in cast(list[dict[str, Any]], rows)]
                if ids:
                    log.info(
                        "claim.dead_consumer",
                        consumer=peer.name,
                        entries=len(ids),
                        beat_age_s=peer.beat_age_s,
                    )
                known = set(self._orphans)
                self._orphans += [i for i in ids if i not in known]
        except redis.ResponseError as exc:  # no group yet, or a script refused: next scan
            log.warning("claim.scan_failed", error=str(exc))

    def _take_orphan(self, entry_id: bytes) -> list[Entry]:
        """Take over one entry of a dead consumer; counts a delivery (its holder died)."""
        # min idle: the owner stopped refreshing at least `dead_after_s` ago; an entry
        # refreshed since (the owner came back) is left alone.
        raw = self.r.xclaim(
            self.streams.jobs,
            self.streams.group,
            self.name,
            min_idle_time=int(self.dead_after_s * 1000) // 2,
            message_ids=[entry_id],
        )
        entries = self._drop_deleted(cast(list[Entry], raw))
        if entries:
            self.stats.reclaimed += 1
            self.stats.reclaimed_from_dead += 1
            log.info("claim.reclaimed", count=1, consumer=self.name, from_dead=True)
        return entries

    def _claim_idle(self) -> list[Entry]:
        """Take over one entry idle past the visibility timeout, if any (walks a cursor)."""
        start = self._cursor if self._cursor == "-" else f"({self._cursor}"
        rows = cast(
            list[dict[str, Any]],
            self.r.xpending_range(
                self.streams.jobs,
                self.streams.group,
                min=start,
                max="+",
                count=20,
                idle=self.visibility_ms,
            ),
        )
        others = [row for row in rows if self._claimable(row)]
        self._cursor = _text(rows[-1]["message_id"]) if len(rows) == 20 else "-"
        if not others:
            return []
        row = others[0]
        if len(rows) == 20:
            self._cursor = _text(row["message_id"])  # come back for the rest next call
        owner = _text(row["consumer"])
        live = self._owner_alive(owner)
        raw = self.r.xclaim(
            self.streams.jobs,
            self.streams.group,
            self.name,
            min_idle_time=self.visibility_ms,
            message_ids=[row["message_id"]],
            # A live owner's refresh failed: keep the count, this is no new attempt.
            retrycount=int(row["times_delivered"]) if live else None,
        )
        entries = self._drop_deleted(cast(list[Entry], raw))
        if entries:
            self.stats.reclaimed += 1
            self.stats.reclaimed_from_live += live
            log.info("claim.reclaimed", count=1, consumer=self.name, owner=owner, owner_alive=live)
        return entries

    def _claimable(self, row: dict[str, Any]) -> bool:
        """Another consumer's idle entry, or one of ours that we do not work on (its
        delivery's reply was lost on the way)."""
        if _text(row["consumer"]) != self.name:
            return True
        return self.holding is not None and not self.holding(_text(row["message_id"]))

    def _owner_alive(self, owner: str) -> bool:
        for peer in peers(self.r, self.streams.jobs, self.streams.group, self.consumers_key):
            if peer.name == owner:
                return peer.beat_age_s is not None and not is_dead(
                    peer, dead_after_s=self.dead_after_s, visibility_timeout_s=1e18
                )
        return False

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

    def touch(self, entry_ids: Sequence[str]) -> int:
        """Reset the idle time of entries we still own and are still working on (XCLAIM
        JUSTID does not count as a delivery), so no other consumer takes them over. Returns
        how many were refreshed; never raises (a failure is logged, counted and retried by
        the next heartbeat)."""
        if not entry_ids:
            return 0
        try:
            return int(
                run_script(
                    self._touch,
                    keys=[self.streams.jobs],
                    args=[self.streams.group, self.name, *entry_ids],
                )
            )
        except redis.RedisError as exc:
            self.stats.touch_failures += 1
            log.warning("claim.touch_failed", error=str(exc), entries=len(entry_ids))
            return 0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
