"""`teacherq replay` from Python: replay a queue's dead letters.

The dead-letter record and the atomic replay are shared/deadletter.py's (one path for every
caller, datasets included); this module applies a TeacherClient's settings to it.
"""

from __future__ import annotations

from typing import Any

from shared.deadletter import ReplayDecision
from shared.deadletter import replay as replay_queue

__all__ = ["ReplayDecision", "replay"]


def replay(
    client: Any,
    *,
    job_ids: list[str] | None = None,
    reason: str | None = None,
    since: float | None = None,
    dry_run: bool = False,
    force: bool = False,
    max_replays: int | None = None,
) -> list[ReplayDecision]:
    """Replay the dead letters of `client`'s queue that match every given filter.

    `client` is a TeacherClient. Filters: exact job ids, a substring of the dead-letter
    reason, and dead-lettered at or after `since` (unix seconds). Returns one decision per
    matching job (its newest dead letter); a dry run changes nothing. `max_replays` defaults
    to the client's `queue.max_replays`.
    """
    limit = client.settings.queue.max_replays if max_replays is None else max_replays
    return replay_queue(
        client.r,
        client.queue,
        max_replays=limit,
        job_ids=job_ids,
        reason=reason,
        since=since,
        dry_run=dry_run,
        force=force,
    )
