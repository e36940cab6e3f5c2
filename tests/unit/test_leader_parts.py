"""The leader's parts built on their own (consumer/serve/assemble.py wires them for the Leader):
the result writer, the intake, the batch runner and the control channel, each on a real Redis
and, where it computes, a real tiny model on the CPU."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch

from consumer.forward.model import TINY, build_model
from consumer.forward.scoring import Scorer
from consumer.group.faults import FaultInjector
from consumer.serve.assemble import build_leader, build_writer
from consumer.serve.batch_runner import BatchRunner
from consumer.serve.claims import Claimer
from consumer.serve.control import Control
from consumer.serve.failures import DeadLetters
from consumer.serve.heartbeat import Heartbeat
from consumer.serve.intake import Intake
from consumer.serve.metrics import ConsumerMetrics
from consumer.serve.replica import Counters, LoadedModel
from consumer.serve.stop import StopFlag
from producer.client import TeacherClient
from shared import keys
from shared.messages import Limits, TeacherRequest
from shared.settings import Settings
from shared.streams import Entry, Streams
from tests.helpers import job_set
from tests.timing import scaled, wait_until

NAME = "parts-test"


@pytest.fixture(scope="module")
def scorer(layout) -> Scorer:
    model = build_model(TINY, layout, params_dtype=torch.float32, device="cpu")
    return Scorer(model=model, spec=TINY, layout=layout, device=torch.device("cpu"))


class Deps:
    """The small parts the big ones take, built directly (no Leader, no assembly)."""

    def __init__(self, settings: Settings, r: redis.Redis, scorer: Scorer) -> None:
        self.settings = settings
        self.r = r
        self.c = settings.consumer
        self.streams = Streams(r, settings.queue.name, settings.queue.group)
        self.streams.ensure_group()
        self.loaded = LoadedModel(scorer=scorer, version="tiny-v1")
        self.counters = Counters()
        self.faults = FaultInjector(None)
        self.claimer = Claimer(
            self.streams,
            NAME,
            visibility_timeout_s=self.c.visibility_timeout_s,
            block_ms=self.c.block_ms,
            consumers_key=keys.consumers_key(settings.queue.name),
            heartbeat_interval_s=self.c.heartbeat_interval_s,
            dead_after_beats=self.c.dead_after_beats,
        )
        self.heartbeat = Heartbeat(
            client=r,
            key=keys.consumers_key(settings.queue.name),
            name=NAME,
            claimer=self.claimer,
            interval_s=self.c.heartbeat_interval_s,
            job_timeout_s=self.c.job_timeout_s,
            describe=dict,
        )
        self.writer = build_writer(settings, self.streams, None, self.faults)
        self.metrics = ConsumerMetrics(
            queue=settings.queue.name, consumer=NAME, health_max_age_s=30.0, busy_max_s=60.0
        )
        self.dead_letters = DeadLetters(
            writer=self.writer,
            metrics=self.metrics,
            loaded=self.loaded,
            consumer=NAME,
            heartbeat=self.heartbeat,
        )

    def claim(self, n: int) -> list[Entry]:
        entries = self.claimer.next_entries(n)
        assert len(entries) == n
        return entries

    def intake(self) -> Intake:
        limits = Limits.for_queue(
            self.settings.queue,
            vocab_size=self.loaded.scorer.spec.vocab_size,
            model_max_tokens=self.loaded.scorer.spec.max_input_tokens,
        )
        return Intake(
            client=self.r,
            streams=self.streams,
            heartbeat=self.heartbeat,
            metrics=self.metrics,
            counters=self.counters,
            dead_letters=self.dead_letters,
            loaded=self.loaded,
            limits=limits,
            max_deliveries=self.c.max_deliveries,
            consumer=NAME,
            writer=self.writer,
        )

    def runner(self) -> BatchRunner:
        return BatchRunner(
            loaded=self.loaded,
            client=self.r,
            streams=self.streams,
            writer=self.writer,
            heartbeat=self.heartbeat,
            metrics=self.metrics,
            counters=self.counters,
            faults=self.faults,
            dead_letters=self.dead_letters,
            max_deliveries=self.c.max_deliveries,
            consumer=NAME,
            batches_in_flight=self.c.batches_in_flight,
        )


def tiny_leader(settings: Settings, r: redis.Redis, scorer: Scorer, faults: FaultInjector):
    """A leader assembled by `build_leader` on the tiny model; no object store (nothing here
    stores bulk arrays: results ride inline in their records)."""
    return build_leader(
        settings=settings,
        scorer=scorer,
        client=r,
        store=None,  # type: ignore[arg-type]
        model_version="tiny-v1",
        stop=StopFlag(),
        faults=faults,
    )


@pytest.fixture
def deps(settings: Settings, r: redis.Redis, scorer: Scorer):
    d = Deps(settings, r, scorer)
    yield d
    d.writer.close()


def test_writer_acknowledges_a_dead_letter(deps: Deps, r: redis.Redis) -> None:
    """The writer alone: a dead letter written through it is recorded and its entry acked."""
    TeacherClient(deps.settings).submit(job_set(1))
    (eid, fields) = deps.claim(1)[0]
    deps.dead_letters.send(eid.decode(), fields, reason="test", exc_type="Test", deliveries=1)
    deps.writer.flush()
    assert r.xlen(keys.dead_stream(deps.settings.queue.name)) == 1
    assert r.xpending(deps.streams.jobs, deps.streams.group)["pending"] == 0


def test_intake_admits_valid_jobs_and_dead_letters_the_rest(deps: Deps, r: redis.Redis) -> None:
    """The intake alone: a valid entry becomes a job; an undecodable one is dead-lettered."""
    TeacherClient(deps.settings).submit(job_set(2))
    r.xadd(deps.streams.jobs, {b"garbage": b"1"})
    entries = deps.claim(3)
    jobs = deps.intake().admit(entries, deliveries={}, claimed_at=time.time())
    deps.writer.flush()
    assert sorted(j.job_id for j in jobs) == ["job-0-000", "job-0-001"]
    assert r.xlen(keys.dead_stream(deps.settings.queue.name)) == 1


def test_jobs_for_a_newer_generation_go_back_with_one_pause_a_read(
    deps: Deps, r: redis.Redis
) -> None:
    """Jobs that want a newer model generation than the loaded one go back on the stream as
    fresh entries; a job of the same read that the loaded model can compute is admitted with
    no pause, and a read holding only jobs for a newer generation pauses once, however many
    it holds (the pause was once a job: a read of 64 held the serving loop 6.4 s)."""
    later = [TeacherRequest(input_ids=[1, 2, 3], job_id=f"later-{i}", min_model_generation=1)
             for i in range(3)]  # fmt: skip
    now = TeacherRequest(input_ids=[4, 5, 6], job_id="now")
    TeacherClient(deps.settings).submit([later[0], now, *later[1:]])
    intake = deps.intake()
    pauses: list[None] = []
    intake._pause = lambda: pauses.append(None)  # type: ignore[method-assign]
    jobs = intake.admit(deps.claim(4), deliveries={}, claimed_at=time.time())
    assert [j.job_id for j in jobs] == ["now"] and pauses == []
    pending = r.xpending(deps.streams.jobs, deps.streams.group)["pending"]
    assert pending == 1  # the three left for newer are acknowledged, requeued as new entries
    back = deps.claim(3)
    assert intake.admit(back, deliveries={}, claimed_at=time.time()) == []
    assert pauses == [None]
    deps.loaded.generation = 1  # the update landed: the same jobs, back again, are computed
    jobs = intake.admit(deps.claim(3), deliveries={}, claimed_at=time.time())
    assert sorted(j.job_id for j in jobs) == ["later-0", "later-1", "later-2"]
    assert pauses == [None]


def test_batch_runner_scores_and_stores(deps: Deps) -> None:
    """The batch runner alone, on the tiny model: jobs scored, stored and acknowledged."""
    client = TeacherClient(deps.settings)
    ids = client.submit(job_set(3))
    entries = deps.claim(3)
    jobs = deps.intake().admit(entries, deliveries={}, claimed_at=time.time())
    runner = deps.runner()
    runner.score_and_store(jobs, batch_id="b1", claimed_at=time.time(), deliveries={})
    runner.finish_inflight()
    deps.writer.flush()
    results = client.results(ids)
    assert all(res is not None and res.model_version == "tiny-v1" for res in results)
    assert all(res is not None and res.logprobs is not None for res in results)
    assert deps.r.xpending(deps.streams.jobs, deps.streams.group)["pending"] == 0


def test_control_publishes_the_model_and_checks_quietly(deps: Deps, r: redis.Redis) -> None:
    """The control channel alone: it publishes the served model; with no command, a check
    changes nothing."""
    control = Control(
        settings=deps.c,
        client=r,
        queue=deps.settings.queue.name,
        consumer=NAME,
        loaded=deps.loaded,
        heartbeat=deps.heartbeat,
        writer=deps.writer,
        finish_inflight=lambda: None,
        reload=None,
    )
    control.publish_model()
    control.check()
    assert deps.loaded.version == "tiny-v1"
    assert not control.asleep
    assert any(r.scan_iter(f"*{deps.settings.queue.name}*"))


def test_build_leader_connects_the_parts(settings: Settings, r: redis.Redis, scorer) -> None:
    """The assembly hands every part the same streams, writer and heartbeat, and the leader's
    hooks are in place (what the heartbeat records, what a finished write counts)."""
    leader = tiny_leader(settings, r, scorer, FaultInjector(None))
    try:
        assert leader.intake.writer is leader.writer is leader.runner.writer
        assert leader.control.heartbeat is leader.heartbeat is leader.intake.heartbeat
        assert leader.writer.on_done == leader._written
        assert leader.heartbeat.describe()["model_version"] == "tiny-v1"
    finally:
        leader.writer.close()


def test_a_dead_letter_waiting_on_a_full_redis_stops_the_hang_clock(
    deps: Deps, r: redis.Redis
) -> None:
    """A dead letter is written on the loop's own thread. While Redis refuses it (full:
    maxmemory reached under noeviction) the loop waits on Redis, not on the device, so the
    hang watchdog's clock for the batch in hand is stopped; once the write lands the clock
    starts afresh (a batch timed since before the wait would be killed as hung)."""
    TeacherClient(deps.settings).submit(job_set(1))
    (eid, fields) = deps.claim(1)[0]
    before = time.monotonic() - 3600.0  # a batch in hand for an hour: past any job_timeout_s
    deps.heartbeat.batch_started = before
    policy = r.config_get("maxmemory-policy")["maxmemory-policy"]
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)  # every write is refused from now on
    sender = threading.Thread(
        target=deps.dead_letters.send,
        args=(eid.decode(), fields),
        kwargs={"reason": "test", "exc_type": "Test", "deliveries": 1},
    )
    try:
        sender.start()
        wait_until(lambda: deps.writer.under_pressure, timeout=30, what="the write refused")
        assert sender.is_alive() and deps.heartbeat.batch_started is None
    finally:
        r.config_set("maxmemory", 0)
        r.config_set("maxmemory-policy", policy)
        sender.join(timeout=scaled(30))
    assert not sender.is_alive()
    assert deps.heartbeat.batch_started is not None and deps.heartbeat.batch_started > before
    assert r.xlen(keys.dead_stream(deps.settings.queue.name)) == 1


class SlowStore(FaultInjector):
    """Results reach Redis late (a slow object store, say); each batch checked on the device
    records how many entries were pending in the group at that moment."""

    def __init__(self, r: redis.Redis, streams: Streams) -> None:
        super().__init__(None)
        self.r, self.streams = r, streams
        self.pending_at_batch: list[int] = []

    def reached(self, point: str) -> None:
        if point == "stored":
            time.sleep(0.3)  # the injected latency itself, not a test waiting

    def check_batch(self, input_ids: torch.Tensor) -> None:
        pending = self.r.xpending(self.streams.jobs, self.streams.group)["pending"]
        self.pending_at_batch.append(pending)


def test_a_redelivered_job_runs_once_everything_before_it_is_stored(
    settings: Settings, r: redis.Redis, scorer
) -> None:
    """Entries delivered before (their consumer died holding them) each run alone, and only
    once every result before them is stored and acknowledged: any one of them may be the
    poison that kills the process again, and a result still on its way would be delivered
    once more, charged a delivery it never failed — a good job dead-lettered after its
    neighbour's crashes (seen on CI: `test_poison_jobs_dead_letter_after_k_attempts[exit]`)."""
    streams = Streams(r, settings.queue.name, settings.queue.group)
    faults = SlowStore(r, streams)
    leader = tiny_leader(settings, r, scorer, faults)
    try:
        streams.ensure_group()
        ids = TeacherClient(settings).submit(job_set(3))
        # Delivered once to this consumer's name, which died before computing anything.
        r.xreadgroup(streams.group, leader.name, {streams.jobs: ">"}, count=3)
        for _ in ids:  # the restarted consumer drains its own pending list, one by one
            leader._process(leader.claimer.next_entries(4))
        leader.writer.flush()
    finally:
        leader.writer.close()
    assert faults.pending_at_batch == [3, 2, 1], "a job ran while one before it was unstored"
    assert r.xpending(streams.jobs, streams.group)["pending"] == 0
