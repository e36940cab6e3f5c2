"""Move dead letters back onto the jobs stream: `teacherq replay`.

A dead-letter entry keeps the job's original stream fields (`orig:<field>`); replaying one
re-adds those fields as a new jobs-stream entry, drops the job's failed result record (so the
job can complete again), removes the dead letter and counts the replay — atomically, in one
script. A job that already succeeded is skipped unless forced, and a job replayed
`queue.max_replays` times is skipped unless forced, so a poison job cannot cycle forever.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shared import keys
from shared.messages import entry_tokens

# KEYS: result hash, jobs stream, dead stream, pending-token counter, replays hash.
# ARGV: dead entry id, job id, tokens, then the original field/values.
_REPLAY = """
redis.call('DEL', KEYS[1])
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
redis.call('INCRBY', KEYS[4], ARGV[3])
redis.call('XDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
return id
"""


@dataclass(frozen=True)
class ReplayDecision:
    """What replay did (or, in a dry run, would do) with one dead letter."""

    job_id: str
    dead_entry_id: str
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
    matching dead letter; a dry run changes nothing.
    """
    r, queue = client.r, client.queue
    limit = client.settings.queue.max_replays if max_replays is None else max_replays
    start = f"{int(since * 1000)}-0" if since is not None else "-"
    wanted = set(job_ids or [])
    script = r.register_script(_REPLAY)
    decisions = []
    for entry_id, fields in r.xrange(keys.dead_stream(queue), min=start, max="+"):
        job_id = fields.get(b"job_id", b"").decode(errors="replace")
        why = fields.get(b"reason", b"").decode(errors="replace")
        if wanted and job_id not in wanted:
            continue
        if reason and reason not in why:
            continue
        eid = entry_id.decode()
        action = _decide(r, queue, job_id, force=force, limit=limit)
        if action is None:
            action = "would replay" if dry_run else "replayed"
            if not dry_run:
                orig = {k[5:]: v for k, v in fields.items() if k.startswith(b"orig:")}
                argv: list[Any] = [eid, job_id, entry_tokens(orig)]
                for k, v in orig.items():
                    argv += [k, v]
                replay_keys = [
                    keys.result_key(queue, job_id), keys.jobs_stream(queue),
                    keys.dead_stream(queue), keys.pending_tokens_key(queue),
                    keys.replays_key(queue),
                ]  # fmt: skip
                script(keys=replay_keys, args=argv)
        decisions.append(ReplayDecision(job_id, eid, why, action))
    return decisions


def _decide(r: Any, queue: str, job_id: str, *, force: bool, limit: int) -> str | None:
    """None to replay, or 'skipped: <why>'."""
    if force:
        return None
    status = r.hget(keys.result_key(queue, job_id), "status")
    if status == b"ok":
        return "skipped: already succeeded (use --force to recompute)"
    replays = int(r.hget(keys.replays_key(queue), job_id) or 0)
    if replays >= limit:
        return f"skipped: replayed {replays} times already (queue.max_replays={limit}; --force)"
    return None
