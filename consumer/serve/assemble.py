"""The leader's wiring: build the parts of one replica's Redis-facing loop and hand them to
`Leader` (consumer/serve/leader.py), which only runs them.

Each part is built here from the settings and the parts before it: the claimer, the heartbeat,
the result writer, the memory watch, the metrics, the dead letters, the intake, the batch
runner, the control channel and the janitor, handed over in one `LeaderParts`
(consumer/serve/parts.py). Each can be built on its own (tests/unit/test_leader_parts.py);
`build_leader` is the one place that knows how they connect.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import redis

from consumer.forward.scoring import Scorer
from consumer.group.faults import FaultInjector
from consumer.serve.batch_runner import BatchRunner
from consumer.serve.claims import Claimer
from consumer.serve.control import Control
from consumer.serve.failures import DeadLetters
from consumer.serve.heartbeat import Heartbeat
from consumer.serve.intake import Intake
from consumer.serve.leader import Leader
from consumer.serve.liveness import consumer_name
from consumer.serve.metrics import ConsumerMetrics
from consumer.serve.parts import LeaderParts
from consumer.serve.pressure import MemoryWatch
from consumer.serve.replica import Counters, LoadedModel
from consumer.serve.retention import Janitor
from consumer.serve.stop import StopFlag
from consumer.serve.writer import ResultWriter
from shared import keys
from shared.messages import Limits
from shared.settings import Settings
from shared.storage import ObjectStore
from shared.streams import Streams


def build_writer(
    settings: Settings, streams: Streams, store: ObjectStore | None, faults: FaultInjector
) -> ResultWriter:
    """The background result writer of a consumer with these settings (no `on_done` yet: the
    leader counts finished writes)."""
    c = settings.consumer
    return ResultWriter(
        streams=streams,
        store=store,
        queue=settings.queue.name,
        inline_max_bytes=settings.queue.inline_max_bytes,
        ttl_s=settings.queue.result_ttl_s,
        threads=c.store_threads,
        faults=faults,
        max_queued=c.max_queued_writes,
        redis_cfg=settings.redis,
    )


def build_leader(
    *,
    settings: Settings,
    scorer: Scorer,
    client: redis.Redis,
    store: ObjectStore,
    model_version: str,
    stop: StopFlag,
    faults: FaultInjector,
    reload: Callable[[str], tuple[Scorer, str]] | None = None,
    generation: int = 0,
    control_cursor: str = "0-0",
    ready_phases: Callable[[], dict[str, float]] | None = None,
    model_path: str = "",
) -> Leader:
    """The leader of one replica, its parts built from `settings` and connected."""
    c = settings.consumer
    queue = settings.queue.name
    loaded = LoadedModel(
        scorer=scorer, version=model_version, generation=generation, path=model_path
    )
    counters = Counters()
    streams = Streams(client, queue, settings.queue.group)
    layout = scorer.layout
    name = consumer_name(c.name, dp_rank=layout.dp_rank, dp=layout.dp, env=os.environ)
    claimer = Claimer(
        streams,
        name,
        visibility_timeout_s=c.visibility_timeout_s,
        block_ms=c.block_ms,
        consumers_key=keys.consumers_key(queue),
        heartbeat_interval_s=c.heartbeat_interval_s,
        dead_after_beats=c.dead_after_beats,
    )
    heartbeat = Heartbeat(
        client=client,
        key=keys.consumers_key(queue),
        name=name,
        claimer=claimer,
        interval_s=c.heartbeat_interval_s,
        job_timeout_s=c.job_timeout_s,
        describe=dict,  # the Leader describes itself (its counters, its model)
    )
    claimer.holding = heartbeat.holds  # our own idle entries not in hand are taken again
    writer = build_writer(settings, streams, store, faults)
    memory = MemoryWatch(
        client,
        pause_fraction=c.memory_pause_fraction,
        writes_refused=lambda: writer.under_pressure,
        key=streams.jobs,
    )
    metrics = ConsumerMetrics(
        queue=queue,
        consumer=name,
        health_max_age_s=max(30.0, 3 * c.heartbeat_interval_s),
        busy_max_s=c.job_timeout_s,
    )
    dead_letters = DeadLetters(
        writer=writer, metrics=metrics, loaded=loaded, consumer=name, heartbeat=heartbeat
    )
    # The queue's limits, capped to what the served model takes.
    limits = Limits.for_queue(
        settings.queue,
        vocab_size=scorer.spec.vocab_size,
        model_max_tokens=scorer.spec.max_input_tokens,
    )
    intake = Intake(
        client=client,
        streams=streams,
        heartbeat=heartbeat,
        metrics=metrics,
        counters=counters,
        dead_letters=dead_letters,
        loaded=loaded,
        limits=limits,
        max_deliveries=c.max_deliveries,
        consumer=name,
        writer=writer,
    )
    runner = BatchRunner(
        loaded=loaded,
        client=client,
        streams=streams,
        writer=writer,
        heartbeat=heartbeat,
        metrics=metrics,
        counters=counters,
        faults=faults,
        dead_letters=dead_letters,
        max_deliveries=c.max_deliveries,
        consumer=name,
        batches_in_flight=c.batches_in_flight,
    )
    control = Control(
        settings=c,
        client=client,
        queue=queue,
        consumer=name,
        loaded=loaded,
        heartbeat=heartbeat,
        writer=writer,
        finish_inflight=runner.finish_inflight,
        reload=reload,
        cursor=control_cursor,
        configured_path=settings.model.path or "",
    )
    janitor = Janitor(client, streams.jobs, interval_s=c.janitor_interval_s)
    parts = LeaderParts(
        settings=settings,
        client=client,
        stop=stop,
        faults=faults,
        name=name,
        streams=streams,
        loaded=loaded,
        counters=counters,
        claimer=claimer,
        heartbeat=heartbeat,
        writer=writer,
        memory=memory,
        metrics=metrics,
        dead_letters=dead_letters,
        intake=intake,
        runner=runner,
        control=control,
        janitor=janitor,
    )
    return Leader(parts, ready_phases=ready_phases)
