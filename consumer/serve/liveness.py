"""Which consumers of a queue are alive, by their heartbeat; pruning the dead ones.

A consumer records a heartbeat every `heartbeat_interval_s` (consumer/serve/heartbeat.py), also
while Redis is full. One whose record is older than `dead_after_beats` intervals, or that recorded
`stopped`, is dead: its pending entries are taken over at once (consumer/serve/claims.py) rather
than after the visibility timeout, and once its pending list is empty its name is removed from the
group (XGROUP DELCONSUMER) and its heartbeat record deleted, so restarts under new names
leave nothing behind. A consumer that beats again meanwhile (restarted under the same name)
is left alone.

Names (`consumer_name`): stable across restarts where the supervisor gives one, so a
restarted consumer first finishes its own pending list. `consumer.name`
(TEACHERQ_CONSUMER__NAME) if set; else, under Kubernetes (KUBERNETES_SERVICE_HOST set), the
pod name (HOSTNAME; a StatefulSet's pod keeps it across restarts); else
`<hostname>-<pid>` (a new name per process). With more than one data-parallel replica,
`-dp<rank>` is appended to the first two.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import redis
import structlog

from shared.redis_client import run_script
from shared.streams import Fields

log = structlog.get_logger("teacherq.liveness")

# KEYS: jobs stream, consumers hash. ARGV: group, consumer name. Removes the consumer from the
# group and its heartbeat record, only if it holds no pending entry: checked and done in one
# step, so an entry it reads in between can never be dropped with it.
# ARGV[3]: the heartbeat record as the reaper read it ('' for none): a consumer that has
# beaten since (restarted under the same, stable name) is not pruned.
_PRUNE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if #p > 0 then return 0 end
local beat = redis.call('HGET', KEYS[2], ARGV[2])
if (beat or '') ~= ARGV[3] then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[2])
return 1
"""


def consumer_name(configured: str | None, *, dp_rank: int, dp: int, env: Mapping[str, str]) -> str:
    """This consumer's name in the group (the rule is in the module docstring)."""
    stable = configured
    if stable is None and env.get("KUBERNETES_SERVICE_HOST") and env.get("HOSTNAME"):
        stable = env["HOSTNAME"]
    if stable is not None:
        return stable if dp == 1 else f"{stable}-dp{dp_rank}"
    return f"{socket.gethostname()}-{os.getpid()}-dp{dp_rank}"


@dataclass(frozen=True)
class Peer:
    """A consumer as the group and the heartbeat hash see it."""

    name: str
    pending: int
    idle_ms: int  # since its last read or claim (XINFO CONSUMERS)
    beat_age_s: float | None  # None: no heartbeat record
    state: str
    record: bytes = b""  # the heartbeat record as read (b"": none)


def peers(r: redis.Redis, stream: str, group: str, consumers_key: str) -> list[Peer]:
    """Every consumer that is in the group or has a heartbeat record."""
    now = time.time()
    beats: dict[str, dict] = {}
    raw = {k.decode(): v for k, v in cast(Fields, r.hgetall(consumers_key)).items()}
    for k, v in raw.items():
        try:
            beats[k] = json.loads(v)
        except ValueError:
            beats[k] = {}
    try:
        rows = r.xinfo_consumers(stream, group)
    except redis.ResponseError:  # no stream or group yet
        rows = []
    seen: dict[str, Peer] = {}
    for row in rows:
        name = row["name"].decode() if isinstance(row["name"], bytes) else str(row["name"])
        beat = beats.get(name)
        seen[name] = Peer(
            name=name,
            pending=int(row["pending"]),
            idle_ms=int(row["idle"]),
            beat_age_s=now - float(beat.get("time", 0)) if beat is not None else None,
            state=str(beat.get("state", "")) if beat is not None else "",
            record=raw.get(name, b""),
        )
    for name, beat in beats.items():
        if name not in seen:
            age = now - float(beat.get("time", 0))
            seen[name] = Peer(name, 0, 0, age, str(beat.get("state")), raw[name])
    return list(seen.values())


def is_dead(peer: Peer, *, dead_after_s: float, visibility_timeout_s: float) -> bool:
    """Dead: stopped, or silent for `dead_after_s`; a consumer without a heartbeat record
    (not a teacherq consumer, or already pruned) only once idle past the visibility timeout."""
    if peer.beat_age_s is None:
        return peer.idle_ms > visibility_timeout_s * 1000
    return peer.state == "stopped" or peer.beat_age_s > dead_after_s


class Reaper:
    """Finds dead consumers of a queue and prunes the ones whose pending lists are empty."""

    def __init__(
        self,
        r: redis.Redis,
        *,
        stream: str,
        group: str,
        consumers_key: str,
        me: str,
        dead_after_s: float,
        visibility_timeout_s: float,
    ) -> None:
        self.r = r
        self.stream = stream
        self.group = group
        self.consumers_key = consumers_key
        self.me = me
        self.dead_after_s = dead_after_s
        self.visibility_timeout_s = visibility_timeout_s
        self.pruned = 0
        self._prune = r.register_script(_PRUNE)

    def dead(self) -> list[Peer]:
        """Dead consumers other than this one."""
        return [
            p
            for p in peers(self.r, self.stream, self.group, self.consumers_key)
            if p.name != self.me
            and is_dead(
                p, dead_after_s=self.dead_after_s, visibility_timeout_s=self.visibility_timeout_s
            )
        ]

    def sweep(self) -> list[Peer]:
        """Prune dead consumers holding nothing; returns the dead that still hold entries."""
        holding = []
        for peer in self.dead():
            if peer.pending:
                holding.append(peer)
                continue
            args: list[str | bytes] = [self.group, peer.name, peer.record]
            if run_script(self._prune, keys=[self.stream, self.consumers_key], args=args):
                self.pruned += 1
                log.info("consumer.pruned", consumer=peer.name, beat_age_s=peer.beat_age_s)
        return holding
