"""Weight updates: which checkpoint a queue's replicas should serve, and how they switch.

State lives in `keys.weights_key(queue)` (path, generation, request_id, state, started_at) and
commands in `keys.control_stream(queue)`, which every replica reads (plain XREAD, not a
consumer group: each replica must see each command).

- A request (`request_update`) atomically bumps the generation and appends an `update-weights`
  command — unless an update is already running: a request for the same path then coalesces
  into it (same request id and generation), and one for another path is refused with the path
  in progress named. An update older than `stale_after_s` no longer blocks new ones.
- Each replica drains its in-flight work, reloads, then records the generation it serves
  (`ack_update`). The ack that finds every live replica at the new generation marks the update
  done and appends a `weights-done` command, which waiting clients block on.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import cast

import redis

from shared import keys
from shared.streams import Fields, StreamReply

# KEYS: weights hash, control stream. ARGV: path, new request id, now, stale-after seconds.
_REQUEST = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'updating' then
  local started = tonumber(redis.call('HGET', KEYS[1], 'started_at') or '0')
  if tonumber(ARGV[3]) - started < tonumber(ARGV[4]) then
    local path = redis.call('HGET', KEYS[1], 'path')
    local gen = redis.call('HGET', KEYS[1], 'generation')
    if path == ARGV[1] then
      return {'coalesced', redis.call('HGET', KEYS[1], 'request_id'), gen}
    end
    return {'busy', path, gen}
  end
end
local gen = redis.call('HINCRBY', KEYS[1], 'generation', 1)
redis.call('HSET', KEYS[1], 'path', ARGV[1], 'request_id', ARGV[2], 'state', 'updating',
           'started_at', ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1000, '*', 'cmd', 'update-weights', 'path', ARGV[1],
           'generation', gen, 'request_id', ARGV[2])
return {'started', ARGV[2], tostring(gen)}
"""


class UpdateInProgress(RuntimeError):
    """Another path is being loaded; the message names it."""


@dataclass(frozen=True)
class UpdateRequest:
    """What `request_update` decided."""

    request_id: str
    generation: int
    coalesced: bool


@dataclass(frozen=True)
class Served:
    """The weights a queue serves: `path` None means the consumers' own configured model."""

    path: str | None
    generation: int
    state: str


def current(r: redis.Redis, queue: str) -> Served:
    """The queue's weight record (generation 0, no path, before any update)."""
    raw = cast(Fields, r.hgetall(keys.weights_key(queue)))
    path = raw.get(b"path")
    return Served(
        path=path.decode() if path else None,
        generation=int(raw.get(b"generation", 0)),
        state=raw.get(b"state", b"idle").decode(),
    )


def request_update(
    r: redis.Redis, queue: str, path: str, *, stale_after_s: float = 1800.0
) -> UpdateRequest:
    """Ask every replica of `queue` to reload from `path` (coalescing, see module doc)."""
    script = r.register_script(_REQUEST)
    status, value, gen = script(
        keys=[keys.weights_key(queue), keys.control_stream(queue)],
        args=[path, secrets.token_hex(6), time.time(), stale_after_s],
    )
    status, value = status.decode(), value.decode()
    if status == "busy":
        raise UpdateInProgress(
            f"an update to {value!r} (generation {int(gen)}) is in progress on queue {queue}; "
            f"wait for it to finish before asking for {path!r}"
        )
    return UpdateRequest(request_id=value, generation=int(gen), coalesced=status == "coalesced")


def ack_update(
    r: redis.Redis, queue: str, *, replica: str, generation: int, live_replicas: list[str]
) -> bool:
    """Record that `replica` serves `generation`; mark the update done if every live replica
    does. Returns True if this ack completed the update."""
    acks_key = keys.weights_key(queue) + ":acks"
    r.hset(acks_key, replica, generation)
    acks = {k.decode(): int(v) for k, v in cast(Fields, r.hgetall(acks_key)).items()}
    if any(acks.get(name, -1) < generation for name in live_replicas):
        return False
    pipe = r.pipeline(transaction=True)
    pipe.hget(keys.weights_key(queue), "generation")
    pipe.hget(keys.weights_key(queue), "state")
    current_gen, state = pipe.execute()
    if int(current_gen or 0) != generation or state != b"updating":
        return False
    r.hset(keys.weights_key(queue), "state", "done")
    r.xadd(keys.control_stream(queue), {"cmd": "weights-done", "generation": generation},
           maxlen=1000, approximate=True)  # fmt: skip
    return True


def wait_done(r: redis.Redis, queue: str, generation: int, *, timeout_s: float) -> None:
    """Block (XREAD on the control stream) until `generation` is served by every replica."""
    deadline = time.monotonic() + timeout_s
    cursor: bytes | str = "0-0"
    while True:
        state = current(r, queue)
        if state.generation > generation or (
            state.generation == generation and state.state == "done"
        ):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"weights generation {generation} not served everywhere yet")
        reply = r.xread({keys.control_stream(queue): cursor}, block=int(min(left, 1) * 1000))
        for _stream, entries in cast(StreamReply, reply) or []:
            cursor = entries[-1][0]


def live_replicas(
    r: redis.Redis, queue: str, *, fresh_s: float, states: tuple[str, ...] | None = None
) -> list[str]:
    """Names of consumers whose heartbeat is younger than fresh_s and whose state is one of
    `states` (None: any state but stopped)."""
    now = time.time()
    names = []
    for name, raw in cast(Fields, r.hgetall(keys.consumers_key(queue))).items():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(rec, dict) or now - rec.get("time", 0) >= fresh_s:
            continue
        state = rec.get("state")
        if (state in states) if states is not None else state != "stopped":
            names.append(name.decode())
    return names
