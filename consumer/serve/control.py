"""Control of one replica: commands from other processes (weight updates) and idle sleep.

`teacherq update-weights` puts a command on the queue's control stream; the leader reads it
between batches (`check`), checks the checkpoint, drains, has every rank of its group reload
(a RELOAD broadcast; the ranks agree on the outcome), stamps the new version and acknowledges
the update. A checkpoint that fails the check or the load on any rank fails the update
(reason and consumer recorded, see shared/weights.py) and the replica keeps its weights; a
replica that loaded an update another replica failed on goes back to the active weights.
A replica idle for `consumer.sleep_after_idle_s` offloads its weights (SLEEP) and takes them
back (WAKE) when work arrives. A new control command goes in `check`; one the followers must
obey too gets its own broadcast word in consumer/group/batching.py and a branch in
consumer/serve/follower.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import cast

import redis
import structlog
import torch.distributed as dist

from consumer.forward.scoring import Scorer
from consumer.group.batching import RELOAD, SLEEP, WAKE, broadcast_header, broadcast_text
from consumer.serve.heartbeat import Heartbeat
from consumer.serve.reload import check_weights, load_agreed
from consumer.serve.replica import LoadedModel
from consumer.serve.writer import ResultWriter
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
        configured_path: str = "",
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
        self.configured_path = configured_path  # what a reset ("" path) goes back to
        self.asleep = False
        self._idle_since = time.monotonic()
        self.updated_to: int | None = None  # generation this replica loaded by an update
        self._load_error: str | None = None
        self.last_swap: dict[str, object] = {}  # how the last swap went, for weights.updated

    @property
    def _group(self) -> dist.ProcessGroup | None:
        return self.loaded.scorer.layout.replica_group

    def publish_model(self) -> None:
        """Record the vocabulary size, longest input and version this queue is served with
        (clients take their limits from it)."""
        spec = self.loaded.scorer.spec
        self.r.hset(
            keys.model_key(self.queue),
            mapping={
                "vocab_size": spec.vocab_size,
                "version": self.loaded.version,
                "path": self.loaded.path,
                "max_input_tokens": spec.max_input_tokens,
            },
        )

    def check(self) -> None:
        """Apply commands other processes put on the control stream: a weight update, or the
        news that one failed elsewhere (a replica that loaded it goes back). While Redis is
        unreachable there is nothing to apply: the next loop's claim waits for it to return,
        and the commands are read then (the cursor has not moved)."""
        try:
            reply = cast(
                StreamReply,
                self.r.xread({keys.control_stream(self.queue): self.cursor}, count=100),
            )
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("control.redis_unavailable", error=str(exc))
            return
        newest: tuple[str, int] | None = None
        failed: set[int] = set()
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.cursor = entry_id.decode()
                cmd = fields.get(b"cmd")
                if cmd == b"update-weights":
                    gen = int(fields[b"generation"])
                    if gen > self.loaded.generation:
                        newest = (fields[b"path"].decode(), gen)
                elif cmd == b"weights-failed":
                    failed.add(int(fields[b"generation"]))
        if newest and newest[1] in failed:
            newest = None  # failed on another replica before this one got to it
        if newest:
            self.update_weights(*newest)
        elif self.loaded.generation in failed and self.updated_to == self.loaded.generation:
            self.revert()

    def update_weights(self, path: str, generation: int) -> None:
        """Check `path` here, then drain, reload every rank, stamp the new version and
        acknowledge. A checkpoint that fails the check, or fails to load on any rank, fails
        the update (`weights.fail_update`: reason and consumer recorded) while this replica
        goes on serving its current weights."""
        if self.reload is None:
            return
        log.info("weights.update", path=path or "(configured model)", generation=generation)
        layout = self.loaded.scorer.layout
        # before any rank is told to load it
        problem = check_weights(path, tp=layout.tp, ep=layout.ep)
        if problem is None and not self._swap(path, generation):
            problem = self._load_error or "load failed"
        if problem is not None:
            weights.fail_update(
                self.r, self.queue, generation=generation, replica=self.consumer, reason=problem
            )
            log.error(
                "weights.update_failed",
                path=path,
                generation=generation,
                error=problem,
                serving=self.loaded.version,
            )
            return
        self.updated_to = generation
        served = weights.current(self.r, self.queue)
        if served.generation == generation and served.state == "failed":
            self.revert()  # failed on another replica while this one loaded it: serve nothing
            return
        self.publish_model()
        live = weights.live_replicas(self.r, self.queue, fresh_s=self.c.live_after_s)
        done = weights.ack_update(
            self.r, self.queue, replica=self.consumer, generation=generation, live_replicas=live
        )
        log.info(
            "weights.updated",
            model_version=self.loaded.version,
            generation=generation,
            completed_update=done,
            **self.last_swap,
        )

    def revert(self) -> None:
        """The update this replica applied failed on another one: go back to the queue's
        active weights (those before it, or the configured model)."""
        served = weights.current(self.r, self.queue)
        path = served.active_path or ""
        log.warning(
            "weights.revert",
            failed_generation=self.loaded.generation,
            path=path or "(configured model)",
        )
        if self._swap(path, served.active_generation):
            self.updated_to = None
            self.publish_model()
        else:
            log.error("weights.revert_failed", error=self._load_error, serving=self.loaded.version)

    def _swap(self, path: str, generation: int) -> bool:
        """Drain, have every rank load `path` ("" = the configured model) and agree; True if
        the replica now serves it as `generation`, False (reason in `_load_error`) if it kept
        its weights."""
        assert self.reload is not None
        started = time.monotonic()
        self.heartbeat.state = "updating"
        self.finish_inflight()
        drained = time.monotonic()  # the last batch on the old weights is done
        self.writer.flush()  # results computed with the old weights are stored as such
        was_asleep = self.asleep
        self.wake()
        layout = self.loaded.scorer.layout
        broadcast_header(RELOAD, src=layout.leader_rank, group=self._group)
        broadcast_text(path, src=layout.leader_rank, group=self._group)
        loaded, self._load_error = load_agreed(
            self.reload,
            path,
            group=self._group,
            device=self.loaded.scorer.device,
            undo=getattr(self.reload, "undo", None),
        )
        if loaded is not None:
            self.loaded.scorer, self.loaded.version = loaded
            self.loaded.generation = generation  # before the beat below reports it
            # The drain-to-serving gap: from the last batch on the old weights until the next
            # batch can run on the new ones (storing the old results, then in place:
            # parameters overwritten, graphs kept; else a new model built and warmed up).
            self.last_swap = {
                "in_place": bool(getattr(self.reload, "last_in_place", False)),
                "gap_s": round(time.monotonic() - drained, 3),
                "drain_s": round(drained - started, 3),
            }
            self.loaded.path = path or self.configured_path
        if was_asleep:
            self.sleep()
        self.heartbeat.state = "sleeping" if self.asleep else "ready"
        self.heartbeat.beat()
        return loaded is not None

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
