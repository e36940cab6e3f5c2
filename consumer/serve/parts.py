"""`LeaderParts`: the record of what a `Leader` runs, between the wiring and the loop.

`build_leader` (consumer/serve/assemble.py) fills it; `Leader` (consumer/serve/leader.py) only
reads it. It lives in a module of its own so that both import it and neither imports the
other's module for it: the assembly imports the loop, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from consumer.group.faults import FaultInjector
from consumer.serve.batch_runner import BatchRunner
from consumer.serve.claims import Claimer
from consumer.serve.control import Control
from consumer.serve.failures import DeadLetters
from consumer.serve.heartbeat import Heartbeat
from consumer.serve.intake import Intake
from consumer.serve.metrics import ConsumerMetrics
from consumer.serve.pressure import MemoryWatch
from consumer.serve.replica import Counters, LoadedModel
from consumer.serve.retention import Janitor
from consumer.serve.stop import StopFlag
from consumer.serve.writer import ResultWriter
from shared.settings import Settings
from shared.streams import Streams


@dataclass
class LeaderParts:
    """Everything a `Leader` runs, built and connected by `build_leader`."""

    settings: Settings
    client: redis.Redis
    stop: StopFlag
    faults: FaultInjector
    name: str
    streams: Streams
    loaded: LoadedModel
    counters: Counters
    claimer: Claimer
    heartbeat: Heartbeat
    writer: ResultWriter
    memory: MemoryWatch
    metrics: ConsumerMetrics
    dead_letters: DeadLetters
    intake: Intake
    runner: BatchRunner
    control: Control
    janitor: Janitor
