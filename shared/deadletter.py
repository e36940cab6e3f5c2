"""The dead-letter record and its replay: the one module that writes, reads and replays them.

A job that must not (invalid input) or can no longer (failed on every delivery) be computed
is moved to the dead-letter stream `teacherq:{<queue>}:dead` as one `DeadLetter`: why, how
often it was delivered and computed, by which consumer, and the job's original stream fields
(`orig:<field>`), so it can be replayed as it was submitted. The consumer writes the record
with the job's failed result in one script (shared/streams.py `Streams.complete`); everything
else reads it with `DeadLetter.from_fields` / `read_dead_letters`.

Replaying a job (`teacherq replay`, a dataset's replay) is one atomic script per job: it
re-adds the newest dead letter's original fields as a new jobs-stream entry, drops the job's
failed result record, removes the job's dead letters and counts the replay. A job that
already succeeded, that was replayed `queue.max_replays` times, or that is in flight again (no
record yet, submitted marker present) is skipped unless forced; a dry run runs the same
checks and changes nothing. Writes that must stay atomic with the caller's take `pipeline=`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
from pydantic import BaseModel, ConfigDict, Field

from shared import keys
from shared.messages import REQUIRED_FIELDS, entry_tokens
from shared.redis_client import run_script

DEAD_LETTER_VERSION = 1
_ORIG = "orig:"

Pipeline = redis.client.Pipeline


class DeadLetter(BaseModel):
    """One dead-letter stream entry. Entries written before the record was versioned (no
    `v` field) have the same layout and read as version 1."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    v: int = DEAD_LETTER_VERSION
    job_id: str
    entry_id: str = ""  # the jobs-stream entry that was dead-lettered
    reason: str = ""
    exception: str = ""  # the error's type name, or InvalidJob / TooManyDeliveries
    deliveries: int = 0  # how often the entry was delivered
    attempts: int = 0  # how often it was actually computed (0 for invalid input)
    consumer: str = ""
    time: float = 0.0  # unix seconds
    original: dict[str, bytes] = Field(default_factory=dict, repr=False)  # the job's fields
    dead_entry_id: str = ""  # this record's id on the dead-letter stream, once read

    @classmethod
    def for_entry(
        cls,
        entry_id: str,
        fields: dict[bytes, bytes],
        *,
        reason: str,
        exception: str,
        deliveries: int,
        attempts: int,
        consumer: str,
    ) -> DeadLetter:
        """The record for a jobs-stream entry (its job id is `entry-<id>` if unreadable)."""
        try:
            job_id = fields.get(b"job_id", b"").decode() or f"entry-{entry_id}"
        except UnicodeDecodeError:
            job_id = f"entry-{entry_id}"
        return cls(
            job_id=job_id,
            entry_id=entry_id,
            reason=reason,
            exception=exception,
            deliveries=deliveries,
            attempts=attempts,
            consumer=consumer,
            time=time.time(),
            original={k.decode(errors="replace"): v for k, v in fields.items()},
        )

    def to_fields(self) -> dict[str, Any]:
        """The stream fields of this record (the original payload as `orig:<field>`)."""
        out: dict[str, Any] = {
            "v": self.v,
            "job_id": self.job_id,
            "entry_id": self.entry_id,
            "reason": self.reason,
            "exception": self.exception,
            "deliveries": self.deliveries,
            "attempts": self.attempts,
            "consumer": self.consumer,
            "time": self.time,
        }
        for k, v in self.original.items():
            out[_ORIG + k] = v
        return out

    @classmethod
    def from_fields(cls, dead_entry_id: bytes | str, fields: dict[bytes, bytes]) -> DeadLetter:
        """Parse a dead-letter stream entry; fields it lacks take their defaults."""
        text: dict[str, Any] = {}
        original: dict[str, bytes] = {}
        for k, v in fields.items():
            name = k.decode(errors="replace")
            if name.startswith(_ORIG):
                original[name[len(_ORIG) :]] = v
            else:
                text[name] = v.decode(errors="replace")
        for name, kind in (("v", int), ("deliveries", int), ("attempts", int), ("time", float)):
            try:
                text[name] = kind(text[name])
            except (KeyError, ValueError):
                text.pop(name, None)
        eid = dead_entry_id.decode() if isinstance(dead_entry_id, bytes) else dead_entry_id
        return cls(**{**text, "original": original, "dead_entry_id": eid})

    @property
    def has_payload(self) -> bool:
        """Whether the original job fields are all here (a record of a job whose entry was
        unreadable keeps only its id, and cannot be replayed)."""
        return set(REQUIRED_FIELDS) <= self.original.keys()

    @property
    def tokens(self) -> int:
        """The token count the job was submitted with (the pending-token counter's unit)."""
        return entry_tokens({k.encode(): v for k, v in self.original.items()})


def read_dead_letters(
    client: redis.Redis,
    queue: str,
    *,
    since: float | None = None,
    job_ids: Iterable[str] | None = None,
    reason: str | None = None,
    page: int = 1000,
) -> list[DeadLetter]:
    """The queue's dead letters, oldest first, that match every given filter: dead-lettered
    at or after `since` (unix seconds), one of `job_ids`, `reason` a substring of theirs."""
    wanted = set(job_ids or [])
    start = f"{int(since * 1000)}-0" if since is not None else "-"
    out = []
    for eid, fields in _xrange_all(client, keys.dead_stream(queue), start=start, page=page):
        letter = DeadLetter.from_fields(eid, fields)
        if wanted and letter.job_id not in wanted:
            continue
        if reason and reason not in letter.reason:
            continue
        out.append(letter)
    return out


def _xrange_all(
    client: redis.Redis, stream: str, *, start: str, page: int
) -> Iterator[tuple[bytes, dict[bytes, bytes]]]:
    while True:
        batch = cast(
            list[tuple[bytes, dict[bytes, bytes]]], client.xrange(stream, min=start, count=page)
        )
        if not batch:
            return
        yield from batch
        start = "(" + batch[-1][0].decode()


def by_job(letters: Iterable[DeadLetter]) -> dict[str, list[DeadLetter]]:
    """Dead letters grouped by job id, each group oldest first (the newest is last)."""
    groups: dict[str, list[DeadLetter]] = {}
    for letter in letters:
        groups.setdefault(letter.job_id, []).append(letter)
    return groups


# KEYS: result hash, submitted marker, jobs stream, dead stream, pending-token counter, replays
#       hash, then bitmaps whose bit ARGV[6] is cleared on replay (a dataset's row marks).
# ARGV: job id, force (1/0), max replays, dry run (1/0), drop the letters of a job that already
#       succeeded (1/0), bit offset, tokens, marker TTL, n dead ids, dead ids..., then the
#       original field/values.
# Returns {verdict, replays}: 1 replayed (or would be), 2 already succeeded, 3 replayed too
# often, 4 in flight (resubmitted, no record yet).
_REPLAY = """
local n_dead = tonumber(ARGV[9])
local dead = {unpack(ARGV, 10, 9 + n_dead)}
local replays = tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or '0')
if ARGV[2] ~= '1' then
  local status = redis.call('HGET', KEYS[1], 'status')
  if status == 'ok' then
    if ARGV[5] == '1' and ARGV[4] ~= '1' then redis.call('XDEL', KEYS[4], unpack(dead)) end
    return {2, replays}
  end
  if replays >= tonumber(ARGV[3]) then return {3, replays} end
  if not status and redis.call('EXISTS', KEYS[2]) == 1 then return {4, replays} end
end
if ARGV[4] == '1' then return {1, replays} end
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[8])
redis.call('INCRBY', KEYS[5], ARGV[7])
redis.call('XADD', KEYS[3], '*', unpack(ARGV, 10 + n_dead))
redis.call('XDEL', KEYS[4], unpack(dead))
for i = 7, #KEYS do redis.call('SETBIT', KEYS[i], ARGV[6], 0) end
return {1, redis.call('HINCRBY', KEYS[6], ARGV[1], 1)}
"""

REPLAYED, SUCCEEDED, TOO_OFTEN, IN_FLIGHT = 1, 2, 3, 4


def replay_job(
    client: redis.Redis,
    queue: str,
    letters: Sequence[DeadLetter],
    *,
    max_replays: int,
    force: bool = False,
    dry_run: bool = False,
    drop_if_succeeded: bool = False,
    clear_bits: tuple[Sequence[str], int] | None = None,
    pipeline: Pipeline | None = None,
) -> Any:
    """Replay one job from its dead letters (all of one job id; the newest one's original
    fields are re-added, and all of them removed), atomically.

    Returns `[verdict, replays]` (REPLAYED, SUCCEEDED, TOO_OFTEN or IN_FLIGHT, and how often
    the job has been replayed), or, with `pipeline=`, queues the script there and returns the
    pipeline (its reply comes from `pipeline.execute()`). `clear_bits=(bitmaps, offset)`
    clears that bit in each bitmap in the same step; `drop_if_succeeded` removes the letters
    of a job that succeeded since. Raises ValueError for letters without the job's payload.
    """
    newest = letters[-1]
    if not newest.has_payload:
        raise ValueError(f"dead letter {newest.dead_entry_id} of {newest.job_id} has no payload")
    bitmaps, offset = clear_bits if clear_bits else ((), 0)
    argv: list[Any] = [
        newest.job_id,
        int(force),
        max_replays,
        int(dry_run),
        int(drop_if_succeeded),
        offset,
        newest.tokens,
        keys.SUBMITTED_TTL_S,
        len(letters),
        *[letter.dead_entry_id for letter in letters],
    ]
    for k, v in newest.original.items():
        argv += [k, v]
    script_keys = [
        keys.result_key(queue, newest.job_id),
        keys.submitted_key(queue, newest.job_id),
        keys.jobs_stream(queue),
        keys.dead_stream(queue),
        keys.pending_tokens_key(queue),
        keys.replays_key(queue),
        *bitmaps,
    ]
    script = client.register_script(_REPLAY)
    return run_script(script, keys=script_keys, args=argv, client=pipeline or client)


@dataclass(frozen=True)
class ReplayDecision:
    """What replay did (or, in a dry run, would do) with one job's dead letters."""

    job_id: str
    dead_entry_id: str  # the newest dead letter of the job (the one replayed)
    reason: str  # why it was dead-lettered
    action: str  # "replayed", "would replay", or "skipped: <why>"

    def to_json(self) -> dict[str, str]:
        """JSON form for CLI output."""
        return {
            "job_id": self.job_id,
            "dead_entry_id": self.dead_entry_id,
            "reason": self.reason,
            "action": self.action,
        }


def replay(
    client: redis.Redis,
    queue: str,
    *,
    max_replays: int,
    job_ids: Iterable[str] | None = None,
    reason: str | None = None,
    since: float | None = None,
    dry_run: bool = False,
    force: bool = False,
) -> list[ReplayDecision]:
    """Replay the queue's dead letters that match every given filter (see
    `read_dead_letters`), one atomic step per job; returns one decision per job, oldest
    dead letter first. A dry run changes nothing."""
    groups = by_job(read_dead_letters(client, queue, since=since, job_ids=job_ids, reason=reason))
    decisions = []
    for job_id, letters in groups.items():
        newest = letters[-1]
        if not newest.has_payload:  # e.g. an entry whose fields were unreadable
            action = "skipped: the dead letter keeps no job payload to replay"
        else:
            verdict, replays = replay_job(
                client, queue, letters, max_replays=max_replays, force=force, dry_run=dry_run
            )
            action = describe_verdict(int(verdict), int(replays), max_replays, dry_run=dry_run)
        decisions.append(ReplayDecision(job_id, newest.dead_entry_id, newest.reason, action))
    return decisions


def describe_verdict(verdict: int, replays: int, max_replays: int, *, dry_run: bool) -> str:
    """The action words for a `replay_job` verdict."""
    if verdict == REPLAYED:
        return "would replay" if dry_run else "replayed"
    if verdict == SUCCEEDED:
        return "skipped: already succeeded (use --force to recompute)"
    if verdict == TOO_OFTEN:
        return (
            f"skipped: replayed {replays} times already (queue.max_replays={max_replays}; --force)"
        )
    return "skipped: in flight again (resubmitted, no result yet; --force)"
