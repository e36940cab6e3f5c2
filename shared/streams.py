"""Atomic stream operations (Lua), shared by producers and consumers.

Each script touches only keys of one queue (one hash slot), so it is atomic on a single
Redis and legal on a cluster. Atomicity is what makes retries safe: redis-py may resend a
command after a connection error, and a resent script finds its own effects and does nothing.

Scripts that write start with a `#!lua` line: Redis then decides once, before the script
runs, whether it may write (refused as a whole while Redis is at maxmemory) — without it a
script would be refused at its first memory-growing command, its earlier commands done and
kept (e.g. a submit marker set but no entry added). The ack-only script is flagged
`allow-oom`: it frees memory.
"""

from __future__ import annotations

from typing import Any

import redis

from shared import keys
from shared.deadletter import DeadLetter
from shared.redis_client import run_script

# Reply shapes. redis-py types a reply as any of its RESP2 / RESP3, bytes / str forms;
# teacherq's clients speak RESP2 and keep bytes (decode_responses=False), so these are the
# shapes that arrive. Call sites `cast` a reply to one of them.
Entry = tuple[bytes, dict[bytes, bytes]]  # a stream entry: id, fields
StreamReply = list[tuple[bytes, list[Entry]]]  # XREAD / XREADGROUP: per stream, its entries
Fields = dict[bytes, bytes]  # HGETALL

# KEYS: submitted marker, jobs stream, pending-token counter, result hash. ARGV: marker TTL,
# token count, minimum model generation, then stream field/value pairs. Returns the new entry
# id, or false if the job id was submitted before. With a minimum generation, a stored
# successful result computed by an older generation (its `meta` JSON's `model_generation`) does
# not count: it is dropped first, with the marker, so newer weights compute the job again. A
# failed or cancelled record stays (`teacherq replay` is the way to run a failed job again).
SUBMIT_SCRIPT = """#!lua
local min_gen = tonumber(ARGV[3])
if min_gen > 0 and redis.call('HGET', KEYS[4], 'status') == 'ok' then
  local ok, meta = pcall(cjson.decode, redis.call('HGET', KEYS[4], 'meta') or '{}')
  local gen = 0
  if ok and type(meta) == 'table' then gen = tonumber(meta['model_generation']) or 0 end
  if gen < min_gen then
    redis.call('DEL', KEYS[4], KEYS[1])
  end
end
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  redis.call('INCRBY', KEYS[3], ARGV[2])
  return redis.call('XADD', KEYS[2], '*', 'n_tokens', ARGV[2], unpack(ARGV, 4))
end
return false
"""

# Acknowledge an entry once: XACK returns 1 only the first time, and only then are its tokens
# taken off the pending-token counter. Used by the scripts below.
_ACK = """
local function ack(jobs, counter, group, entry_id, tokens)
  if entry_id ~= '' and redis.call('XACK', jobs, group, entry_id) == 1 then
    if redis.call('DECRBY', counter, tokens) < 0 then redis.call('SET', counter, 0) end
  end
end
"""

# KEYS: jobs stream, pending-token counter. ARGV: group, entry id, tokens.
# Allowed while Redis is full: acknowledging frees memory (the pending-list entry) and the
# counter is decremented in place, so a consumer can always let go of work it skips.
_ACK_ONLY = (
    "#!lua flags=allow-oom\n"
    + _ACK
    + """
ack(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
return 1
"""
)

# KEYS: result hash, done stream, jobs stream, dead stream, pending-token counter.
# ARGV: group, entry id, result TTL, job id, status, done-stream maxlen, tokens,
#       n result values, result field/values..., then dead-letter field/values (none: no dead
#       letter). Writes the record only if none exists (first writer wins), announces it on the
#       done stream, and always acknowledges the entry. Returns 1 if it wrote.
# A dead letter never wins over a real result: it is written only with its failure record,
# only when the job has no record yet, and the record notes the dead letter's id (field
# `dead_entry`); a real result that arrives later (its write was waiting for room in Redis while
# another consumer gave up on the job) replaces that record and removes the dead letter.
COMPLETE_SCRIPT = (
    "#!lua\n"
    + _ACK
    + """
local n = tonumber(ARGV[8])
local wrote = 0
if ARGV[5] == 'ok' and redis.call('EXISTS', KEYS[1]) == 1 then
  local dead_entry = redis.call('HGET', KEYS[1], 'dead_entry')
  if dead_entry then
    redis.call('XDEL', KEYS[4], dead_entry)
    redis.call('DEL', KEYS[1])
  end
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 9, 8 + n))
  if #ARGV > 8 + n then
    local dead_id = redis.call('XADD', KEYS[4], '*', unpack(ARGV, 9 + n))
    redis.call('HSET', KEYS[1], 'dead_entry', dead_id)
  end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'job_id', ARGV[4], 'status', ARGV[5])
  wrote = 1
end
ack(KEYS[3], KEYS[5], ARGV[1], ARGV[2], ARGV[7])
return wrote
"""
)

# KEYS: jobs stream. ARGV: group, entry id, then the entry's field/values. Re-adds an entry
# as a new one and acknowledges the old, atomically; its tokens stay counted as pending.
_REQUEUE = """#!lua
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
"""


class Streams:
    """The queue's stream protocol on one Redis client."""

    def __init__(self, client: redis.Redis, queue: str, group: str = "consumers") -> None:
        self.r = client
        self.queue = queue
        self.group = group
        self.jobs = keys.jobs_stream(queue)
        self.done = keys.done_stream(queue)
        self.dead = keys.dead_stream(queue)
        self._submit = client.register_script(SUBMIT_SCRIPT)
        self._complete = client.register_script(COMPLETE_SCRIPT)
        self._ack = client.register_script(_ACK_ONLY)
        self._requeue = client.register_script(_REQUEUE)
        self.pending_tokens_key = keys.pending_tokens_key(queue)

    def ensure_group(self) -> None:
        """Create the jobs stream and consumer group if missing (idempotent). An existing
        group is never an error, also while Redis is full: XGROUP CREATE is refused under
        OOM even when the group exists, so the group is looked up first (a read), and an OOM
        refusal is re-checked against the group before it is raised."""
        if self._group_exists():
            return
        try:
            self.r.xgroup_create(self.jobs, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:  # OutOfMemoryError is one
            if "BUSYGROUP" in str(exc) or self._group_exists():
                return
            raise

    def _group_exists(self) -> bool:
        try:
            groups = self.r.xinfo_groups(self.jobs)
        except redis.ResponseError:  # no such stream yet
            return False
        return any(g["name"] in (self.group, self.group.encode()) for g in groups)

    def submit(
        self,
        job_id: str,
        fields: dict[str, Any],
        *,
        tokens: int,
        min_generation: int = 0,
        client: redis.Redis | redis.client.Pipeline | None = None,
    ) -> bytes | None:
        """Add a job unless its id was submitted before; returns the entry id or None (on a
        pipeline `client`, its execute() returns it). `tokens` is added to the pending-token
        counter when the job is enqueued. With `min_generation` > 0, a stored successful
        result of an older model generation does not count (see SUBMIT_SCRIPT)."""
        keys_, argv = submit_call(
            self.queue, job_id, fields, tokens=tokens, min_generation=min_generation
        )
        return run_script(self._submit, keys=keys_, args=argv, client=client)  # type: ignore[no-any-return]

    def ack(self, entry_id: str, *, tokens: int) -> None:
        """Acknowledge an entry without writing a result (e.g. a duplicate)."""
        run_script(
            self._ack,
            keys=[self.jobs, self.pending_tokens_key],
            args=[self.group, entry_id, tokens],
        )

    def requeue(self, entry_id: str, fields: dict[bytes, bytes]) -> None:
        """Put an entry back at the end of the stream as a new entry (for another consumer)."""
        argv: list[Any] = [self.group, entry_id]
        for k, v in fields.items():
            argv += [k, v]
        run_script(self._requeue, keys=[self.jobs], args=argv)

    def pending_tokens(self) -> int:
        """Tokens submitted through `submit` and not yet acknowledged."""
        return int(self.r.get(self.pending_tokens_key) or 0)

    def complete(
        self,
        *,
        job_id: str,
        entry_id: str,
        status: str,
        record: dict[str, Any],
        ttl_s: int,
        tokens: int = 0,
        dead_letter: DeadLetter | None = None,
        client: redis.Redis | redis.client.Pipeline | None = None,
    ) -> bool:
        """Write the result record (first writer wins), announce, maybe dead-letter, XACK
        (taking `tokens` off the pending-token counter if this call acknowledged the entry)."""
        keys_, argv = complete_call(
            self.queue,
            self.group,
            job_id=job_id,
            entry_id=entry_id,
            status=status,
            record=record,
            ttl_s=ttl_s,
            tokens=tokens,
            dead_letter=dead_letter,
        )
        return bool(run_script(self._complete, keys=keys_, args=argv, client=client or self.r))


# Keys and arguments of the scripts, built in one place for `Streams` and the asyncio client
# (which registers the same scripts on its own connection).


def submit_call(
    queue: str, job_id: str, fields: dict[str, Any], *, tokens: int, min_generation: int = 0
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of SUBMIT_SCRIPT for one job."""
    argv: list[Any] = [keys.SUBMITTED_TTL_S, tokens, max(0, int(min_generation))]
    for k, v in fields.items():
        argv += [k, v]
    keys_ = [
        keys.submitted_key(queue, job_id),
        keys.jobs_stream(queue),
        keys.pending_tokens_key(queue),
        keys.result_key(queue, job_id),
    ]
    return keys_, argv


def complete_call(
    queue: str,
    group: str,
    *,
    job_id: str,
    entry_id: str,
    status: str,
    record: dict[str, Any],
    ttl_s: int,
    tokens: int = 0,
    dead_letter: DeadLetter | None = None,
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of COMPLETE_SCRIPT (see `Streams.complete`)."""
    argv: list[Any] = [group, entry_id, ttl_s, job_id, status, keys.DONE_STREAM_MAXLEN, tokens]
    flat: list[Any] = []
    for k, v in record.items():
        flat += [k, v]
    argv += [len(flat), *flat]
    for k, v in (dead_letter.to_fields() if dead_letter else {}).items():
        argv += [k, v]
    keys_ = [
        keys.result_key(queue, job_id),
        keys.done_stream(queue),
        keys.jobs_stream(queue),
        keys.dead_stream(queue),
        keys.pending_tokens_key(queue),
    ]
    return keys_, argv
