"""Weight updates: which checkpoint a queue's replicas serve, and how they switch safely.

State lives in `keys.weights_key(queue)` and commands in `keys.control_stream(queue)`, which
every replica reads (plain XREAD, not a consumer group: each replica must see each command).

The record holds the latest request (`path`, `generation`, `request_id`, `state`,
`started_at`; `state` is `updating`, `done` or `failed`, with `error` and `failed_by` when
failed) and the weights a replica starts on (`active_path`, `active_generation`). A `path` of
"" means "the consumers' own configured model" (`update-weights --reset`).

- A request (`request_update`) atomically bumps the generation and appends an `update-weights`
  command — unless an update is still running: a request for the same path then coalesces
  into it (same request id and generation), and one for another path is refused with the path
  in progress named. An update older than `stale_after_s`, or one no live consumer is left
  to finish (`take_over`, decided by the client), no longer blocks new ones; a failed one
  never does.
- Each replica checks and loads the new weights, then records the generation it serves
  (`ack_update`). The ack that finds every live replica at the new generation marks the update
  done, makes it the active weights and appends `weights-done`, which waiting clients block on.
- A replica that cannot load them keeps its current weights and calls `fail_update`: the
  update is marked failed (reason, replica), `weights-failed` is appended (replicas that did
  load it go back to the active weights) and waiting clients get `WeightUpdateFailed`.

What a consumer starts on (`start_choice`): the active weights of its queue — a queue serves
one model, so an update outlives the consumers that applied it — and its configured
`model.path` when there is no update (or after `--reset`). The one documented case where
Redis state wins over settings; the consumer logs the choice (`model.selected`).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import cast

import redis

from shared import keys
from shared.errors import TeacherqError, WeightUpdateFailed
from shared.redis_client import run_script
from shared.streams import Fields, StreamReply

# A reset (back to each consumer's configured model) travels as this path.
CONFIGURED = ""

# KEYS: weights hash, control stream. ARGV: path, new request id, now, stale-after seconds,
# "1" to take over a running update (nobody is left to finish it).
_REQUEST = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'updating' and ARGV[5] ~= '1' then
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
if redis.call('HEXISTS', KEYS[1], 'active_path') == 0 then
  -- a record written before active_path existed: a done update is the active one
  local old = redis.call('HGET', KEYS[1], 'path')
  if state == 'done' and old then
    redis.call('HSET', KEYS[1], 'active_path', old, 'active_generation',
               redis.call('HGET', KEYS[1], 'generation'))
  end
end
local gen = redis.call('HINCRBY', KEYS[1], 'generation', 1)
redis.call('HDEL', KEYS[1], 'error', 'failed_by', 'failed_at')
redis.call('HSET', KEYS[1], 'path', ARGV[1], 'request_id', ARGV[2], 'state', 'updating',
           'started_at', ARGV[3])
redis.call('DEL', KEYS[1] .. ':acks')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1000, '*', 'cmd', 'update-weights', 'path', ARGV[1],
           'generation', gen, 'request_id', ARGV[2])
return {'started', ARGV[2], tostring(gen)}
"""

# KEYS: weights hash, control stream. ARGV: generation, replica, reason, now.
_FAIL = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'state') ~= 'updating' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'failed', 'error', ARGV[3], 'failed_by', ARGV[2],
           'failed_at', ARGV[4])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1000, '*', 'cmd', 'weights-failed',
           'generation', ARGV[1])
return 1
"""

# KEYS: weights hash, control stream. ARGV: generation.
_DONE = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'state') ~= 'updating' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'active_path', redis.call('HGET', KEYS[1], 'path'),
           'active_generation', ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1000, '*', 'cmd', 'weights-done', 'generation', ARGV[1])
return 1
"""


class UpdateInProgress(TeacherqError, RuntimeError):
    """Another path is being loaded; the message names it."""


@dataclass(frozen=True)
class UpdateRequest:
    """What `request_update` decided."""

    request_id: str
    generation: int
    coalesced: bool
    no_consumer: bool = False  # no live consumer: the next one to start applies it


@dataclass(frozen=True)
class Served:
    """A queue's weight record. `path` is the latest request's (None: the configured model);
    `active_path` what replicas start on (None: their configured model)."""

    path: str | None
    generation: int
    state: str
    active_path: str | None = None
    active_generation: int = 0
    error: str | None = None
    failed_by: str | None = None
    started_at: float | None = None
    request_id: str | None = None  # the latest request's id (a call joining it reports it)

    def to_json(self) -> dict[str, object]:
        """The record as `teacherq status --json` shows it."""
        return {
            "path": self.path,
            "generation": self.generation,
            "state": self.state,
            "active_path": self.active_path,
            "active_generation": self.active_generation,
            "error": self.error,
            "failed_by": self.failed_by,
            "started_at": self.started_at,
        }


def _text(raw: Fields, name: bytes) -> str | None:
    value = raw.get(name)
    return value.decode() if value else None


def current(r: redis.Redis, queue: str) -> Served:
    """The queue's weight record (generation 0, no path, state idle, before any update)."""
    return served_from_fields(cast(Fields, r.hgetall(keys.weights_key(queue))))


def served_from_fields(raw: Fields) -> Served:
    """`current` from the record's hash fields (read by the caller, e.g. asyncio)."""
    state = raw.get(b"state", b"idle").decode()
    path = _text(raw, b"path")
    if b"active_path" in raw:
        active, active_gen = _text(raw, b"active_path"), int(raw.get(b"active_generation", 0))
    elif state == "done":  # written before active_path existed
        active, active_gen = path, int(raw.get(b"generation", 0))
    else:
        active, active_gen = None, 0
    started = raw.get(b"started_at")
    return Served(
        path=path,
        generation=int(raw.get(b"generation", 0)),
        state=state,
        active_path=active,
        active_generation=active_gen,
        error=_text(raw, b"error"),
        failed_by=_text(raw, b"failed_by"),
        started_at=float(started) if started else None,
        request_id=_text(raw, b"request_id"),
    )


@dataclass(frozen=True)
class StartChoice:
    """What a starting consumer loads: `path` None means its configured model."""

    path: str | None
    generation: int
    source: str  # "settings" | "update-weights" | "update-weights (in progress)"
    trying_update: bool  # True: loading the running update's path; on failure, fail_update


def start_choice(served: Served, *, stale_after_s: float = 1800.0) -> StartChoice:
    """Which weights a consumer starting now serves (see the module doc for the rule)."""
    running = served.state == "updating" and (
        served.started_at is None or time.time() - served.started_at < stale_after_s
    )
    if running:
        return StartChoice(served.path, served.generation, "update-weights (in progress)", True)
    if served.active_path:
        return StartChoice(served.active_path, served.active_generation, "update-weights", False)
    return StartChoice(None, served.generation, "settings", False)


def request_update(
    r: redis.Redis,
    queue: str,
    path: str,
    *,
    stale_after_s: float = 1800.0,
    take_over: bool = False,
) -> UpdateRequest:
    """Ask every replica of `queue` to reload from `path` ("" = their configured model;
    coalescing, see module doc). `take_over` replaces a running update instead of joining or
    refusing it: for when no live consumer is left to finish it."""
    script = r.register_script(_REQUEST)
    status, value, gen = run_script(
        script,
        keys=[keys.weights_key(queue), keys.control_stream(queue)],
        args=[path, secrets.token_hex(6), time.time(), stale_after_s, "1" if take_over else "0"],
    )
    status, value = status.decode(), value.decode()
    if status == "busy":
        shown = repr(value) if value else "the configured model (reset)"
        raise UpdateInProgress(
            f"an update to {shown} (generation {int(gen)}) is in progress on queue {queue}; "
            f"wait for it to finish before asking for {path or 'a reset'!r}"
        )
    return UpdateRequest(request_id=value, generation=int(gen), coalesced=status == "coalesced")


def fail_update(r: redis.Redis, queue: str, *, generation: int, replica: str, reason: str) -> bool:
    """Record that `replica` could not load `generation`: the update is failed (if it is
    still the running one). Returns True if this call marked it failed."""
    script = r.register_script(_FAIL)
    done = run_script(
        script,
        keys=[keys.weights_key(queue), keys.control_stream(queue)],
        args=[generation, replica, reason[:2000], time.time()],
    )
    return bool(done)


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
    script = r.register_script(_DONE)
    return bool(
        run_script(
            script, keys=[keys.weights_key(queue), keys.control_stream(queue)], args=[generation]
        )
    )


def wait_done(r: redis.Redis, queue: str, generation: int, *, timeout_s: float) -> None:
    """Block (XREAD on the control stream) until `generation` is served by every replica.

    Raises `WeightUpdateFailed` as soon as a replica reports it cannot load the weights, and
    TimeoutError when `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    cursor: bytes | str = "0-0"
    while True:
        state = current(r, queue)
        if state.generation == generation and state.state == "failed":
            raise WeightUpdateFailed(
                generation=generation,
                path=state.path,
                reason=state.error or "unknown",
                consumer=state.failed_by,
            )
        if state.generation > generation or (
            state.generation == generation and state.state == "done"
        ):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"weights generation {generation} not served by every live consumer after "
                f"{timeout_s:g}s (see `teacherq status`)"
            )
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
