"""Control of one replica: commands from other processes (weight updates) and idle sleep.

`teacherq update-weights` puts a command on the queue's control stream; the leader reads it
between batches (`check`), drains, has every rank of its group reload (a RELOAD broadcast),
stamps the new version and acknowledges the update. A replica idle for
`consumer.sleep_after_idle_s` offloads its weights (SLEEP) and takes them back (WAKE) when
work arrives. A new control command goes in `check`; one the followers must obey too gets
its own broadcast word in consumer/batching.py and a branch in consumer/follower.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import redis
import structlog
import torch.distributed as dist

from consumer.batching import RELOAD, SLEEP, WAKE, broadcast_header, broadcast_text
from consumer.heartbeat import Heartbeat
from consumer.replica import LoadedModel
from consumer.scoring import Scorer
from consumer.writer import ResultWriter
from shared import keys, weights
from shared.settings import ConsumerSettings
from shared.streams import StreamReply

log = structlog.get_logger("teacherq.consumer")


class Control:
    """Weight updates and sleep/wake for one leader; `asleep` is read by its loop."""

    def __init__(
        self,
        *,
        settings: ConsumerSettings,
        client: redis.Redis,
        queue: str,
        consumer: str,
        loaded: LoadedModel,
        heartbeat: Heartbeat,
        writer: ResultWriter,
        finish_inflight: Callable[[], None],
        reload: Callable[[str], tuple[Scorer, str]] | None,
        cursor: str = "0-0",
    ) -> None:
        self.c = settings
        self.r = client
        self.queue = queue
        self.consumer = consumer
        self.loaded = loaded
        self.heartbeat = heartbeat
        self.writer = writer
        self.finish_inflight = finish_inflight
        self.reload = reload
        self.cursor = cursor
        self.asleep = False
        self._idle_since = time.monotonic()

    @property
    def _group(self) -> dist.ProcessGroup | None:
        return self.loaded.scorer.layout.tp_group

    def publish_model(self) -> None:
        """Record the vocabulary size and version this queue is served with (for clients)."""
        self.r.hset(
            keys.model_key(self.queue),
            mapping={
                "vocab_size": self.loaded.scorer.spec.vocab_size,
                "version": self.loaded.version,
            },
        )

    def check(self) -> None:
        """Apply commands other processes put on the control stream (weight updates)."""
        reply = cast(
            StreamReply,
            self.r.xread({keys.control_stream(self.queue): self.cursor}, count=100),
        )
        newest: tuple[str, int] | None = None
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.cursor = entry_id.decode()
                if fields.get(b"cmd") == b"update-weights":
                    gen = int(fields[b"generation"])
                    if gen > self.loaded.generation:
                        newest = (fields[b"path"].decode(), gen)
        if newest:
            self.update_weights(*newest)

    def update_weights(self, path: str, generation: int) -> None:
        """Drain, reload every rank from `path`, stamp the new version, acknowledge."""
        if self.reload is None:
            return
        log.info("weights.update", path=path, generation=generation)
        self.heartbeat.state = "updating"
        self.finish_inflight()
        self.writer.flush()  # results computed with the old weights are stored as such
        was_asleep = self.asleep
        self.wake()
        layout = self.loaded.scorer.layout
        broadcast_header(RELOAD, src=layout.leader_rank, group=self._group)
        broadcast_text(path, src=layout.leader_rank, group=self._group)
        self.loaded.scorer, self.loaded.version = self.reload(path)
        self.loaded.generation = generation
        self.publish_model()
        if was_asleep:
            self.sleep()
        self.heartbeat.state = "sleeping" if self.asleep else "ready"
        self.heartbeat.beat()
        live = weights.live_replicas(self.r, self.queue, fresh_s=3 * self.c.heartbeat_interval_s)
        done = weights.ack_update(
            self.r, self.queue, replica=self.consumer, generation=generation, live_replicas=live
        )
        log.info(
            "weights.updated",
            model_version=self.loaded.version,
            generation=generation,
            completed_update=done,
        )

    def worked(self) -> None:
        """The replica just processed work: the idle clock starts again."""
        self._idle_since = time.monotonic()

    def maybe_sleep(self) -> None:
        """Offload the weights once idle for `consumer.sleep_after_idle_s` (0: never)."""
        idle = self.c.sleep_after_idle_s
        if idle and not self.asleep and time.monotonic() - self._idle_since > idle:
            self.sleep()

    def sleep(self) -> None:
        """Offload the weights on every rank of the group."""
        self.finish_inflight()
        broadcast_header(SLEEP, src=self.loaded.scorer.layout.leader_rank, group=self._group)
        self.loaded.scorer.offload()
        self.asleep = True
        self.heartbeat.state = "sleeping"
        log.info("consumer.sleeping")

    def wake(self) -> None:
        """Take the weights back on every rank (a no-op when awake)."""
        if not self.asleep:
            return
        broadcast_header(WAKE, src=self.loaded.scorer.layout.leader_rank, group=self._group)
        self.loaded.scorer.onload()
        self.asleep = False
        log.info("consumer.awake")
