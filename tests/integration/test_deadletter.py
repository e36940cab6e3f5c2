"""The dead-letter record and its one replay path (shared/deadletter.py) on a real valkey-server:
the record round-trips through the stream, and a replay is one atomic script per job that
counts replays, runs the same checks dry, and never replays a job twice."""

from __future__ import annotations

import pytest
import redis

from shared import keys
from shared.deadletter import (
    IN_FLIGHT,
    REPLAYED,
    DeadLetter,
    read_dead_letters,
    replay,
    replay_job,
)
from shared.messages import TeacherRequest, encode_job, entry_tokens
from shared.streams import Streams
from tests.redis_monitor import monitored

pytestmark = pytest.mark.integration


def submitted_fields(streams: Streams, job_id: str, input_ids: list[int]) -> dict[bytes, bytes]:
    """Submit a job the way the client does and return its stream entry's fields."""
    fields = encode_job(TeacherRequest(input_ids=input_ids), job_id=job_id)
    entry_id = streams.submit(job_id, fields, tokens=len(input_ids))
    [(_, raw)] = streams.r.xrange(streams.jobs, min=entry_id, max=entry_id)
    return raw


def dead_letter(streams: Streams, job_id: str, raw: dict[bytes, bytes], reason: str) -> None:
    """Dead-letter a job as a consumer does: failed record, dead letter and XACK in one step."""
    letter = DeadLetter.for_entry(
        "0-1", raw, reason=reason, exception="Boom", deliveries=3, attempts=3, consumer="c1"
    )
    streams.complete(
        job_id=job_id,
        entry_id="",
        status="failed",
        record={"status": "failed", "error": reason},
        ttl_s=600,
        dead_letter=letter,
    )


def add_letter(streams: Streams, job_id: str, raw: dict[bytes, bytes], reason: str) -> None:
    """Add a dead letter alone (no result record written)."""
    letter = DeadLetter.for_entry(
        "0-2", raw, reason=reason, exception="Boom", deliveries=1, attempts=1, consumer="c2"
    )
    streams.r.xadd(streams.dead, letter.to_fields())


@pytest.fixture
def streams(r: redis.Redis, settings) -> Streams:
    s = Streams(r, settings.queue.name)
    s.ensure_group()
    return s


def test_record_round_trips_and_old_records_parse(streams: Streams, r: redis.Redis) -> None:
    """What the consumer writes is what every reader parses (version, counts, original
    payload, token count); a record written before versioning (no `v`) reads as version 1;
    an unreadable job id becomes `entry-<id>`."""
    raw = submitted_fields(streams, "j1", [1, 2, 3, 4])
    dead_letter(streams, "j1", raw, "failed on each of 3 deliveries: Boom")
    r.xadd(streams.dead, {"job_id": "old", "reason": "legacy", "attempts": "2"})
    new, old = read_dead_letters(r, streams.queue)
    assert (new.v, new.job_id, new.reason, new.exception) == (
        1,
        "j1",
        "failed on each of 3 deliveries: Boom",
        "Boom",
    )
    assert (new.deliveries, new.attempts, new.consumer) == (3, 3, "c1")
    assert new.original == {k.decode(): v for k, v in raw.items()}
    assert new.has_payload and new.tokens == entry_tokens(raw) == 4
    assert (old.v, old.job_id, old.attempts, old.has_payload) == (1, "old", 2, False)
    bad = DeadLetter.for_entry(
        "5-7",
        {b"job_id": b"\xff"},
        reason="r",
        exception="I",
        deliveries=1,
        attempts=0,
        consumer="",
    )
    assert bad.job_id == "entry-5-7"
    assert read_dead_letters(r, streams.queue, reason="legacy") == [old]
    assert read_dead_letters(r, streams.queue, job_ids=["j1"]) == [new]


def test_replay_is_one_script_per_job_and_counts(streams: Streams, r, redis_url) -> None:
    """Each job's replay (re-add, drop the failed record, remove all of its dead letters,
    count) is executed by Redis inside one script: no other client sees a half-replayed job.
    A dry run runs the same checks and changes nothing."""
    q = streams.queue
    a = submitted_fields(streams, "a", [1, 2, 3])
    b = submitted_fields(streams, "b", [4, 5, 6, 7])
    dead_letter(streams, "a", a, "boom")
    dead_letter(streams, "b", b, "boom")
    r.delete(keys.result_key(q, "b"))
    dead_letter(streams, "b", b, "boom again")  # b was dead-lettered twice
    jobs_before = r.xlen(streams.jobs)
    dry = replay(r, q, max_replays=3, dry_run=True)
    assert [(d.job_id, d.action) for d in dry] == [("a", "would replay"), ("b", "would replay")]
    assert r.xlen(streams.dead) == 3 and r.xlen(streams.jobs) == jobs_before
    with monitored(redis_url) as commands:
        done = replay(r, q, max_replays=3)
    assert [(d.job_id, d.action) for d in done] == [("a", "replayed"), ("b", "replayed")]
    assert r.xlen(streams.dead) == 0 and r.xlen(streams.jobs) == jobs_before + 2
    assert {k: int(v) for k, v in r.hgetall(keys.replays_key(q)).items()} == {b"a": 1, b"b": 1}
    assert not r.exists(keys.result_key(q, "a"), keys.result_key(q, "b"))
    writes = [c for c in commands if c.name in ("XADD", "XDEL", "DEL", "HINCRBY", "INCRBY", "SET")]
    assert len(writes) == 2 * 6, writes
    assert all(c.from_script for c in writes), [c for c in writes if not c.from_script]
    calls = [c for c in commands if c.name in ("EVALSHA", "EVAL")]
    assert len(calls) == 2, "one script call per job"
    # The re-added entries are the submitted ones (same fields, token count included).
    readded = r.xrange(streams.jobs)[-2:]
    assert [f for _, f in readded] == [a, b]


def test_replay_skips_done_in_flight_and_too_often(streams: Streams, r) -> None:
    """A job that succeeded is skipped (its letters kept, or dropped when asked); a replay
    racing another one finds the job in flight and adds nothing; past max_replays a job is
    skipped unless forced."""
    q = streams.queue
    raw = submitted_fields(streams, "x", [9, 9])
    dead_letter(streams, "x", raw, "boom")
    letters = read_dead_letters(r, q)
    assert list(replay_job(r, q, letters, max_replays=1)) == [REPLAYED, 1]
    jobs = r.xlen(streams.jobs)
    # A second replayer that read the same dead letter before the first removed it.
    assert list(replay_job(r, q, letters, max_replays=5)) == [IN_FLIGHT, 1]
    assert r.xlen(streams.jobs) == jobs
    dead_letter(streams, "x", raw, "boom again")
    [d] = replay(r, q, max_replays=1)
    assert d.action == "skipped: replayed 1 times already (queue.max_replays=1; --force)"
    [d] = replay(r, q, max_replays=1, force=True)
    assert d.action == "replayed" and int(r.hget(keys.replays_key(q), "x")) == 2
    r.hset(keys.result_key(q, "x"), "status", "ok")
    add_letter(streams, "x", raw, "stale")
    [d] = replay(r, q, max_replays=9)
    assert d.action.startswith("skipped: already succeeded") and r.xlen(streams.dead) == 1
    replay_job(r, q, read_dead_letters(r, q), max_replays=9, drop_if_succeeded=True)
    assert r.xlen(streams.dead) == 0


def test_replay_composes_on_a_callers_pipeline(streams: Streams, r) -> None:
    """With `pipeline=`, replays queue on the caller's MULTI/EXEC with the caller's own writes
    and happen only when it executes, together."""
    q = streams.queue
    for job_id in ("p1", "p2"):
        dead_letter(streams, job_id, submitted_fields(streams, job_id, [3, 4]), "boom")
    by_id = {letter.job_id: [letter] for letter in read_dead_letters(r, q)}
    pipe = r.pipeline(transaction=True)
    for job_id in ("p1", "p2"):
        replay_job(r, q, by_id[job_id], max_replays=3, pipeline=pipe)
    pipe.set(f"{q}-marker", "1")
    assert r.xlen(streams.dead) == 2  # nothing ran yet
    replies = pipe.execute()
    assert [list(x) for x in replies[:2]] == [[REPLAYED, 1], [REPLAYED, 1]] and replies[2]
    assert r.xlen(streams.dead) == 0
