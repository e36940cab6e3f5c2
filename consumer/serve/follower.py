"""A non-leader rank of a TP group: it never talks to Redis, it obeys the leader's broadcasts."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from consumer.forward.scoring import Scorer
from consumer.group.agreement import GroupFailure, score_agreed
from consumer.group.batching import (
    BATCH,
    RELOAD,
    SLEEP,
    STOP,
    WAKE,
    broadcast_header,
    broadcast_text,
    receive_batch,
)
from consumer.group.faults import FaultInjector
from consumer.serve.reload import load_agreed

log = structlog.get_logger("teacherq.consumer")


def follow(
    scorer: Scorer,
    faults: FaultInjector,
    *,
    reload: Callable[[str], tuple[Scorer, str]] | None = None,
) -> None:
    """A non-leader rank: obey the leader's commands — score batches, reload, sleep, wake —
    until it signals stop."""
    layout = scorer.layout
    src, group = layout.leader_rank, layout.replica_group
    while True:
        word, a, b, c = broadcast_header(STOP, src=src, group=group)
        if word == STOP:
            return
        if word == BATCH:
            batch = receive_batch(a, b, c, src=src, group=group)
            try:
                score_agreed(scorer, batch, faults)
            except GroupFailure as exc:
                log.warning("batch.failed", rank=layout.rank, error=str(exc))
        elif word == RELOAD:
            path = broadcast_text("", src=src, group=group)
            if reload is not None:
                # Every rank loads and all agree (as the leader does in consumer/serve/control.py):
                # a failure anywhere leaves every rank on its current weights.
                loaded, _ = load_agreed(
                    reload,
                    path,
                    group=group,
                    device=scorer.device,
                    undo=getattr(reload, "undo", None),
                )
                if loaded is not None:
                    scorer = loaded[0]
        elif word == SLEEP:
            scorer.offload()
        elif word == WAKE:
            scorer.onload()
