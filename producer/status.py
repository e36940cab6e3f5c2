"""A snapshot of one queue for `teacherq status`: backlog, work in flight, dead letters,
consumers and recent throughput, read from Redis without changing anything.

Figures and where they come from:

- `queued`: entries not yet delivered to any consumer (the group's lag); `in_flight`:
  delivered, not acknowledged (XPENDING); `pending_jobs` = both; `pending_tokens`: the
  counter the submit script increments and acknowledgement decrements;
- `in_flight_by_consumer`: per group member, its pending count, how long since it last read
  (XINFO CONSUMERS idle) and the oldest of its entries (XPENDING ... IDLE per entry);
- `consumers`: the heartbeat records (`keys.consumers_key`), with their age and `alive`;
- `throughput`: completions in the last `window_s` seconds from the done stream's entry ids
  (their millisecond timestamps), tokens from the throughput stream the consumers append one
  entry per batch to (`shared.keys.throughput_stream`); windows use the server's clock;
- `memory`: Redis's used memory and maxmemory (INFO memory), the growth rate the freshest live
  consumer measured (its heartbeat's `redis_memory`), and the projected seconds to full;
- `replication`: the replicas in sync with the queue's shard (INFO replication) and, from the
  live consumers' heartbeats (`replica_ack`), whether result writes wait for replica
  acknowledgement (since when, results held) or go without it (shared/replication.py).
"""

from __future__ import annotations

import json
from typing import Any

import redis
from rich.console import Group
from rich.table import Table

from shared import keys, weights
from shared.keys import throughput_stream
from shared.memory import memory_fields, read_memory
from shared.replication import replica_ack_figures, shard_replicas

SAMPLE_ENTRIES = 10  # in-flight entries listed per consumer


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _group_info(r: redis.Redis, stream: str, group: str) -> dict[str, Any] | None:
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet: nothing was ever submitted
        return None
    return next((g for g in groups if _s(g["name"]) == group), None)


def _in_flight(r: redis.Redis, stream: str, group: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in r.xinfo_consumers(stream, group):
        name = _s(c["name"])
        info: dict[str, Any] = {
            "entries": int(c["pending"]),
            "idle_s": round(int(c["idle"]) / 1000, 3),
            "inactive_s": round(int(c["inactive"]) / 1000, 3)
            if c.get("inactive", -1) >= 0
            else None,
            "oldest_idle_s": None,
            "max_deliveries": None,
            "sample": [],
        }
        if info["entries"]:
            rows = r.xpending_range(
                stream, group, min="-", max="+", count=SAMPLE_ENTRIES, consumername=name
            )
            info["sample"] = [
                {
                    "id": _s(row["message_id"]),
                    "idle_s": round(int(row["time_since_delivered"]) / 1000, 3),
                    "deliveries": int(row["times_delivered"]),
                }
                for row in rows
            ]
            if info["sample"]:
                info["oldest_idle_s"] = max(e["idle_s"] for e in info["sample"])
                info["max_deliveries"] = max(e["deliveries"] for e in info["sample"])
        out[name] = info
    return out


def _window_entries(r: redis.Redis, stream: str, since_ms: int) -> list[dict[bytes, bytes]]:
    out: list[dict[bytes, bytes]] = []
    start = f"{since_ms}-0"
    while True:
        page: list[Any] = r.xrange(stream, min=start, max="+", count=10_000) or []
        out += [fields for _, fields in page]
        if len(page) < 10_000:
            return out
        start = "(" + _s(page[-1][0])


def _throughput(r: redis.Redis, queue: str, now_ms: int, window_s: float) -> dict[str, Any]:
    since_ms = now_ms - int(window_s * 1000)
    done = _window_entries(r, keys.done_stream(queue), since_ms)
    ok = sum(1 for f in done if f.get(b"status") == b"ok")
    batches = _window_entries(r, throughput_stream(queue), since_ms)
    tokens = sum(int(f.get(b"tokens", 0)) for f in batches)
    return {
        "window_s": window_s,
        "jobs": len(done),
        "jobs_ok": ok,
        "jobs_failed": len(done) - ok,
        "jobs_per_s": round(len(done) / window_s, 3),
        "batches": len(batches),
        # None, not 0, when no consumer reports batches: "unknown" is not "idle".
        "tokens": tokens if batches or not done else None,
        "tokens_per_s": round(tokens / window_s, 3) if batches or not done else None,
    }


def _consumers(
    r: redis.Redis, queue: str, now: float, stale_after_s: float
) -> dict[str, dict[str, Any]]:
    out = {}
    for name, raw in r.hgetall(keys.consumers_key(queue)).items():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            rec = {"state": "unreadable"}
        age = round(now - float(rec.get("time", 0)), 3) if rec.get("time") else None
        alive = rec.get("state") not in ("stopped", "unreadable") and (
            age is not None and age <= stale_after_s
        )
        out[_s(name)] = {**rec, "heartbeat_age_s": age, "alive": alive}
    return out


def _memory(r: redis.Redis, queue: str, consumers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    live = [c for c in consumers.values() if c["alive"] and c.get("redis_memory")]
    rate = None
    if live:
        freshest = min(live, key=lambda c: c["heartbeat_age_s"])
        rate = freshest["redis_memory"].get("growth_bytes_per_s")
    return memory_fields(read_memory(r, key=keys.jobs_stream(queue)), rate)


def _replication(
    r: redis.Redis, queue: str, now: float, consumers: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    try:
        replicas: int | None = shard_replicas(r, queue)
    except redis.ResponseError:  # INFO refused (a managed service): the heartbeats still tell
        replicas = None
    live = [c for c in consumers.values() if c["alive"]]
    return replica_ack_figures(live, now=now, replicas=replicas)


def snapshot(
    r: redis.Redis,
    queue: str,
    group: str = "consumers",
    *,
    window_s: float = 60.0,
    stale_after_s: float = 60.0,
) -> dict[str, Any]:
    """Every figure of `teacherq status` for one queue, as one JSON-able dict (see the module
    doc). A consumer whose heartbeat is older than `stale_after_s` is reported not alive."""
    sec, usec = r.time()
    now = sec + usec / 1e6
    now_ms = int(now * 1000)
    stream = keys.jobs_stream(queue)
    g = _group_info(r, stream, group)
    lag = g.get("lag") if g else 0
    pending = int(g["pending"]) if g else 0
    consumers = _consumers(r, queue, now, stale_after_s)
    return {
        "queue": queue,
        "group": group,
        "time": round(now, 3),
        "jobs_in_stream": r.xlen(stream),
        "lag": lag,
        "pending": pending,
        "queued": lag,
        "in_flight": pending,
        # Redis cannot count the lag across deleted entries; then neither can we.
        "pending_jobs": None if lag is None else lag + pending,
        "pending_tokens": int(r.get(keys.pending_tokens_key(queue)) or 0),
        "dead_letters": r.xlen(keys.dead_stream(queue)),
        "results_announced": r.xlen(keys.done_stream(queue)),
        "in_flight_by_consumer": _in_flight(r, stream, group) if g else {},
        "consumers": consumers,
        "throughput": _throughput(r, queue, now_ms, window_s),
        "memory": _memory(r, queue, consumers),
        "replication": _replication(r, queue, now, consumers),
        # Since each consumer started: tokens shared-prefix packing did not have to compute.
        "prefix_tokens_saved": sum(
            int(c.get("prefix_tokens_saved") or 0) for c in consumers.values()
        ),
        # The queue's weight record: the latest update (state, and why and where it failed)
        # and the weights a starting consumer loads (shared/weights.py).
        "weights": weights.current(r, queue).to_json(),
    }


def _num(v: Any, fmt: str = "{:,}") -> str:
    return "?" if v is None else fmt.format(v)


def _age(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f} s" if v < 120 else f"{v / 60:.1f} min"


def _memory_text(m: dict[str, Any]) -> str:
    used = f"{m['used_bytes'] / 2**20:,.1f} MiB"
    if not m["limit_bytes"]:
        return f"{used} (no maxmemory: Redis can grow until the host runs out)"
    text = f"{used} of {m['limit_bytes'] / 2**20:,.1f} MiB ({100 * m['fraction']:.1f} %)"
    eta = m["seconds_to_full"]
    if eta == 0:
        return text + ": FULL, results cannot be stored"
    if eta is not None:
        return text + f", full in ~{_age(eta)} at the current rate"
    return text


def _memory_style(m: dict[str, Any]) -> str:
    f = m["fraction"]
    return "" if f is None or f < 0.85 else ("red" if f >= 0.95 else "yellow")


def _replication_text(rep: dict[str, Any]) -> tuple[str, str] | None:
    """(text, style) of the replication row; None when writes wait for no replica and none
    were made without."""
    n, have = rep["min_replicas_acked"], rep["replicas"]
    if not n and not rep["unreplicated_writes"]:
        return None
    text = f"{_num(have)} replicas in sync, writes need {n}"
    if rep["waiting_since"] is not None:
        held = rep["held_results"]
        return (
            text + f": WAITING for replica acks for {_age(rep['waiting_s'])}, "
            f"{held:,} results held (add a replica, or replica_ack_policy=degrade)",
            "red",
        )
    if rep["degraded_since"] is not None:
        return text + f": writing WITHOUT replica acks ({rep['unreplicated_writes']:,} so far)", (
            "yellow"
        )
    if rep["unreplicated_writes"]:
        text += f" ({rep['unreplicated_writes']:,} written without acks earlier)"
    return text, "yellow" if have is not None and have <= n else ""


def render(snap: dict[str, Any]) -> Group:
    """The snapshot as rich tables: queue figures, work in flight, consumers."""
    t = snap["throughput"]
    q = Table(title=f"queue {snap['queue']}", show_header=False, title_justify="left")
    q.add_row("queued (not delivered)", _num(snap["queued"]))
    q.add_row("in flight (not acked)", _num(snap["in_flight"]))
    q.add_row("pending jobs", _num(snap["pending_jobs"]))
    q.add_row("pending tokens", _num(snap["pending_tokens"]))
    q.add_row(
        "dead letters", _num(snap["dead_letters"]), style="red" if snap["dead_letters"] else ""
    )
    q.add_row(
        f"done in last {t['window_s']:g} s", f"{t['jobs_ok']:,} ok, {t['jobs_failed']:,} failed"
    )
    q.add_row("jobs/s", _num(t["jobs_per_s"], "{:,.2f}"))
    q.add_row("tokens/s", _num(t["tokens_per_s"], "{:,.0f}"))
    q.add_row("prefix tokens saved", _num(snap.get("prefix_tokens_saved", 0)))
    w = snap.get("weights") or {}
    if w.get("generation"):
        target = w.get("path") or "(configured models)"
        line = f"generation {w['generation']} {target}: {w.get('state')}"
        if w.get("state") == "failed":
            line += f" on {w.get('failed_by')}: {w.get('error')}"
        q.add_row("weight update", line, style="red" if w.get("state") == "failed" else "")
        q.add_row("consumers start on", w.get("active_path") or "their configured model")
    m = snap.get("memory")
    if m:
        q.add_row("Redis memory", _memory_text(m), style=_memory_style(m))
    rep = _replication_text(snap["replication"]) if snap.get("replication") else None
    if rep:
        q.add_row("replication", rep[0], style=rep[1])

    f = Table(title="in flight", title_justify="left")
    for col in ("consumer", "entries", "last read", "oldest entry idle", "max deliveries"):
        f.add_column(col)
    for name, c in snap["in_flight_by_consumer"].items():
        f.add_row(
            name,
            str(c["entries"]),
            _age(c["idle_s"]),
            _age(c["oldest_idle_s"]),
            _num(c["max_deliveries"]) if c["entries"] else "-",
        )

    cs = Table(title="consumers", title_justify="left")
    for col in ("consumer", "state", "model", "layout", "heartbeat", "jobs done", "tokens"):
        cs.add_column(col)
    for name, c in snap["consumers"].items():
        state = c.get("state", "?") if c["alive"] else f"{c.get('state', '?')} (stale)"
        cs.add_row(
            name,
            state,
            str(c.get("model_version", "-")),
            str(c.get("layout", "-")),
            _age(c["heartbeat_age_s"]) + " ago",
            _num(c.get("jobs_done")),
            _num(c.get("tokens")),
            style="" if c["alive"] else "dim",
        )
    return Group(q, f, cs)
