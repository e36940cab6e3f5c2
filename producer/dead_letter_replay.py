"""`teacherq replay` from Python: replay a queue's dead letters, and read `--since`.

The dead-letter record and the atomic replay are shared/deadletter.py's (one path for every
caller, datasets included); this module applies a TeacherClient's settings to it.
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Any

from shared.deadletter import ReplayDecision
from shared.deadletter import replay as replay_queue

__all__ = ["ReplayDecision", "parse_since", "replay"]


def parse_since(text: str, *, now: float | None = None) -> float:
    """Unix seconds from an age such as '90s', '10m', '2h', '1d' (that long before now), unix
    seconds, or an ISO 8601 time (local time unless it has an offset)."""
    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])", text.strip())
    if m:
        scale = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        return now - float(m.group(1)) * scale
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(
            f"{text!r}: expected an age like 30m / 2h / 1d, unix seconds, or an ISO 8601 time"
        ) from None


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
