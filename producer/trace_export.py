"""Recorded traces as a tree, as Chrome/Perfetto trace-event JSON, or as an HTML timeline.

A job's trace starts at the producer's `submit` span; the consumer's spans for the job
(queue_wait, claim, pack, forward, head, store, ack) continue it from the carrier in the
request. Work shared by the jobs of a batch lives in the batch's own trace (the `batch` span,
its phases and the per-rank work under it); the job's `forward`/`head` spans carry the
`batch_id` that leads there. A `TraceView` gathers both: the jobs to show, and the batches
they rode in.
"""

from __future__ import annotations

import functools
import html
import importlib.resources
import json
import re
from dataclasses import dataclass, field
from typing import Any

from rich.text import Text
from rich.tree import Tree

from shared.trace_store import TraceStore
from shared.tracing import SpanRecord


@dataclass
class JobTrace:
    """One job's spans (its own trace) and the batches it rode in, in order."""

    job_id: str
    spans: list[SpanRecord]
    batch_ids: list[str] = field(default_factory=list)

    @property
    def trace_id(self) -> str | None:
        """The job's trace id (None when nothing was recorded)."""
        return self.spans[0]["trace_id"] if self.spans else None


@dataclass
class TraceView:
    """What one export shows: jobs (a row each) and the batches they rode in."""

    title: str
    jobs: list[JobTrace]
    batches: dict[str, list[SpanRecord]]

    def all_spans(self) -> list[SpanRecord]:
        """Every span of the view once (jobs may share ancestors), in start order."""
        seen: dict[str, SpanRecord] = {}
        for job in self.jobs:
            for s in job.spans:
                seen.setdefault(s["span_id"], s)
        for spans in self.batches.values():
            for s in spans:
                seen.setdefault(s["span_id"], s)
        return sorted(seen.values(), key=lambda s: s["start_time"])

    @property
    def empty(self) -> bool:
        """True when no span at all was found."""
        return not any(j.spans for j in self.jobs) and not any(self.batches.values())


# -- loading --------------------------------------------------------------------------------


def _batch_ids(spans: list[SpanRecord]) -> list[str]:
    out: list[str] = []
    for s in spans:
        b = s["attrs"].get("batch_id")
        if isinstance(b, str) and b not in out:
            out.append(b)
    return out


def _job_trace(store: TraceStore, job_id: str) -> JobTrace:
    spans = store.job_spans(job_id)
    return JobTrace(job_id=job_id, spans=spans, batch_ids=_batch_ids(spans))


def _with_batches(title: str, jobs: list[JobTrace], store: TraceStore) -> TraceView:
    batches: dict[str, list[SpanRecord]] = {}
    for job in jobs:
        for b in job.batch_ids:
            if b not in batches:
                batches[b] = store.batch_spans(b)
    return TraceView(title=title, jobs=jobs, batches=batches)


def load_job(store: TraceStore, job_id: str) -> TraceView:
    """One job and the batches it rode in."""
    return _with_batches(f"job {job_id}", [_job_trace(store, job_id)], store)


def load_batch(store: TraceStore, batch_id: str) -> TraceView:
    """One batch and a row per job that rode in it (from the batch span's `job_ids`, or else
    every job of the window the batch ran in whose spans name it)."""
    spans = store.batch_spans(batch_id)
    job_ids: list[str] = []
    for s in spans:
        ids = s["attrs"].get("job_ids")
        if isinstance(ids, list):
            job_ids += [j for j in ids if isinstance(j, str) and j not in job_ids]
    if not job_ids and spans:
        lo = spans[0]["start_time"] - 3600
        hi = max(s["start_time"] for s in spans) + 1
        job_ids = [j for j in store.jobs_between(lo, hi) if batch_id in _job_batches(store, j)]
    jobs = [_job_trace(store, j) for j in job_ids]
    view = TraceView(title=f"batch {batch_id}", jobs=jobs, batches={batch_id: spans})
    for job in jobs:  # a job retried alone after a batch failure rode in more than one
        for b in job.batch_ids:
            if b not in view.batches:
                view.batches[b] = store.batch_spans(b)
    return view


def _job_batches(store: TraceStore, job_id: str) -> list[str]:
    return _batch_ids(store.job_spans(job_id))


def load_window(store: TraceStore, since: float, until: float, *, limit: int = 500) -> TraceView:
    """Every job whose first span started in [since, until] (at most `limit`)."""
    jobs = [_job_trace(store, j) for j in store.jobs_between(since, until, limit=limit)]
    return _with_batches(f"jobs {since:.3f} .. {until:.3f}", jobs, store)


# -- trees ----------------------------------------------------------------------------------


@dataclass
class Node:
    """A span and its children (by start time); `orphan` when its parent was not recorded."""

    span: SpanRecord
    children: list[Node] = field(default_factory=list)
    orphan: bool = False


def build_forest(spans: list[SpanRecord]) -> list[Node]:
    """Link spans by parent_span_id; spans whose parent is missing become roots."""
    nodes = {s["span_id"]: Node(s) for s in spans}
    roots: list[Node] = []
    # Siblings in the order they ran: by start, then the one that ended first (an empty
    # queue_wait before the claim that starts at the same instant).
    for s in sorted(spans, key=lambda s: (s["start_time"], end_time(s))):
        node = nodes[s["span_id"]]
        parent = s.get("parent_span_id")
        if parent and parent in nodes and parent != s["span_id"]:
            nodes[parent].children.append(node)
        else:
            node.orphan = bool(parent)
            roots.append(node)
    return roots


def end_time(s: SpanRecord) -> float:
    """A span's end in unix seconds."""
    return float(s["start_time"]) + float(s["duration_ms"]) / 1000


def effective_ranks(spans: list[SpanRecord]) -> dict[str, Any]:
    """The rank each span ran on: its own `rank` attr, else its parent's when the parent ran in
    the same process (a rank's phases recorded under its rank span), else the process's."""
    out: dict[str, Any] = {}

    def walk(node: Node, inherited: Any) -> None:
        s = node.span
        rank = s["attrs"].get("rank", inherited if inherited is not None else s.get("rank"))
        out[s["span_id"]] = rank
        for c in node.children:
            same = c.span.get("pid") == s.get("pid") and not c.span.get("remote_parent")
            walk(c, rank if same else None)

    for root in build_forest(spans):
        walk(root, None)
    return out


def process_label(s: SpanRecord, rank: Any = None) -> str:
    """Which process (and rank) recorded a span, for display."""
    label = s.get("process") or f"{s.get('host', '?')}:{s.get('pid', '?')}"
    if rank is None:
        rank = s["attrs"].get("rank", s.get("rank"))
    return f"{label} rank{rank}" if rank is not None else label


_HIDDEN_ATTRS = {"job_id"}


def _attrs_text(s: SpanRecord) -> str:
    parts = []
    for k, v in s["attrs"].items():
        if k in _HIDDEN_ATTRS:
            continue
        if isinstance(v, list):
            v = f"[{len(v)} items]"
        text = str(v)
        parts.append(f"{k}={text[:40]}{'…' if len(text) > 40 else ''}")
    return " ".join(parts)


def _fmt_ms(ms: float) -> str:
    return f"{ms / 1000:.3f} s" if ms >= 10_000 else f"{ms:.3f} ms"


def _line(node: Node, t0: float, ranks: dict[str, Any]) -> tuple[str, str]:
    s = node.span
    offset = (s["start_time"] - t0) * 1000
    head = f"{s['name']}  {_fmt_ms(s['duration_ms'])}  @+{offset:.3f} ms"
    tail = f"[{process_label(s, ranks.get(s['span_id']))}] {_attrs_text(s)}".rstrip()
    if node.orphan:
        tail += " (parent not recorded)"
    if s.get("error"):
        tail += f" ERROR {s['error']}"
    return head, tail


def _sections(view: TraceView) -> list[tuple[str, list[Node]]]:
    """(heading, forest) per job and per batch of the view."""
    out: list[tuple[str, list[Node]]] = []
    for job in view.jobs:
        if not job.spans:
            out.append((f"job {job.job_id}: no spans recorded", []))
            continue
        e2e = (max(end_time(s) for s in job.spans) - job.spans[0]["start_time"]) * 1000
        out.append(
            (
                f"job {job.job_id}  trace {job.trace_id}  end to end {_fmt_ms(e2e)}",
                build_forest(job.spans),
            )
        )
    for batch_id, bspans in view.batches.items():
        if not bspans:
            out.append((f"batch {batch_id}: no spans recorded", []))
            continue
        heading = f"rode in batch {batch_id}  trace {bspans[0]['trace_id']}"
        out.append((heading, build_forest(bspans)))
    return out


def view_start(view: TraceView) -> float:
    """The earliest span start of the view (unix seconds; 0 when empty)."""
    spans = view.all_spans()
    return spans[0]["start_time"] if spans else 0.0


def render_text(view: TraceView) -> str:
    """The view as indented plain text: one line per span, two spaces per level."""
    t0 = view_start(view)
    ranks = effective_ranks(view.all_spans())
    lines: list[str] = []

    def walk(node: Node, depth: int) -> None:
        head, tail = _line(node, t0, ranks)
        lines.append(f"{'  ' * depth}{head}  {tail}")
        for c in node.children:
            walk(c, depth + 1)

    for heading, forest in _sections(view):
        lines.append(heading)
        for root in forest:
            walk(root, 1)
    return "\n".join(lines) + "\n"


def render_rich(view: TraceView) -> Tree:
    """The view as a rich Tree (for a terminal)."""
    t0 = view_start(view)
    ranks = effective_ranks(view.all_spans())
    top = Tree(Text(view.title, style="bold"))

    def walk(parent: Tree, node: Node) -> None:
        head, tail = _line(node, t0, ranks)
        label = Text(head, style="bold red" if node.span.get("error") else "bold")
        label.append("  " + tail, style="red" if node.span.get("error") else "dim")
        branch = parent.add(label)
        for c in node.children:
            walk(branch, c)

    for heading, forest in _sections(view):
        section = top.add(Text(heading, style="cyan"))
        for root in forest:
            walk(section, root)
    return top


# -- Chrome / Perfetto trace-event JSON ------------------------------------------------------


def _rows(view: TraceView) -> tuple[list[str], dict[str, int]]:
    """Row labels, and the row index of each span (a job's spans on its row, a batch's on
    its own)."""
    labels: list[str] = []
    row_of: dict[str, int] = {}
    for job in view.jobs:
        labels.append(f"job {job.job_id}")
        for s in job.spans:
            row_of.setdefault(s["span_id"], len(labels) - 1)
    for batch_id, spans in view.batches.items():
        labels.append(f"batch {batch_id}")
        for s in spans:
            row_of.setdefault(s["span_id"], len(labels) - 1)
    return labels, row_of


def _us(t: float, t0: float) -> float:
    # Whole nanoseconds first: rounding is monotonic, so a child inside its parent stays inside.
    return round((t - t0) * 1e9) / 1000


def to_chrome(view: TraceView) -> dict[str, Any]:
    """Trace-event JSON: an "X" (complete) event per span with ts/dur in µs from the view's
    start, a pid per process (and rank), a tid per row (job or batch), the span's identity and
    attributes in args; flow arrows ("s"/"f") from a remote parent to its child."""
    t0 = view_start(view)
    labels, row_of = _rows(view)
    pids: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    threads: set[tuple[int, int]] = set()
    placed: dict[str, tuple[int, int, float]] = {}
    ranks = effective_ranks(view.all_spans())
    for s in view.all_spans():
        proc = process_label(s, ranks.get(s["span_id"]))
        pid = pids.setdefault(proc, len(pids) + 1)
        tid = row_of[s["span_id"]] + 1
        threads.add((pid, tid))
        ts = _us(s["start_time"], t0)
        dur = _us(end_time(s), t0) - ts
        args = {
            **s["attrs"],
            "trace_id": s["trace_id"],
            "span_id": s["span_id"],
            "parent_span_id": s.get("parent_span_id"),
        }
        if s.get("error"):
            args["error"] = s["error"]
        if s.get("remote_parent"):
            args["remote_parent"] = True  # parent in another process: need not enclose it
        events.append(
            {
                "name": s["name"],
                "cat": "teacherq",
                "ph": "X",
                "ts": ts,
                "dur": max(dur, 0.0),
                "pid": pid,
                "tid": tid,
                "args": args,
            }
        )
        placed[s["span_id"]] = (pid, tid, ts)
    flow = 0
    for s in view.all_spans():
        parent = s.get("parent_span_id")
        if not (s.get("remote_parent") and parent in placed):
            continue
        flow += 1
        ppid, ptid, pts = placed[parent]
        cpid, ctid, cts = placed[s["span_id"]]
        common = {"name": "follows", "cat": "teacherq.flow", "id": flow}
        events.append({**common, "ph": "s", "ts": pts, "pid": ppid, "tid": ptid})
        events.append({**common, "ph": "f", "bp": "e", "ts": cts, "pid": cpid, "tid": ctid})
    meta: list[dict[str, Any]] = []
    for proc, pid in pids.items():
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": proc}})
    for pid, tid in sorted(threads):
        meta.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": tid,
                "args": {"name": labels[tid - 1]},
            }
        )
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"title": view.title, "t0_unix_s": t0},
    }


# -- HTML timeline --------------------------------------------------------------------------


_Placed = tuple[int, float, float, str]  # (lane, start, end, span_id)


_TOUCH_S = 1e-6  # records keep µs: spans that meet may seem to overlap by less than that


def _fits(placed: list[_Placed], lane: int, lo: float, hi: float) -> bool:
    return all(
        not (lane == pl and lo < phi - _TOUCH_S and plo < hi - _TOUCH_S)
        for pl, plo, phi, _ in placed
    )


def _pack(node: Node) -> list[_Placed]:
    """Lay a subtree out in lanes relative to its root (lane 0): each child's whole subtree
    goes to the first lanes below the root where it overlaps nothing placed before, so
    parallel children (the ranks of a batch) stack instead of covering each other."""
    s = node.span
    placed: list[_Placed] = [(0, s["start_time"], end_time(s), s["span_id"])]
    for child in node.children:
        sub = _pack(child)
        offset = 1
        while not all(_fits(placed, offset + ln, lo, hi) for ln, lo, hi, _ in sub):
            offset += 1
        placed += [(offset + ln, lo, hi, sid) for ln, lo, hi, sid in sub]
    return placed


def lanes(spans: list[SpanRecord]) -> dict[str, int]:
    """The lane (0 = top) of each span in a timeline row: children below their parents,
    overlapping spans never in one lane."""
    placed: list[_Placed] = []
    for root in build_forest(spans):
        sub = _pack(root)
        offset = 0
        while not all(_fits(placed, offset + ln, lo, hi) for ln, lo, hi, _ in sub):
            offset += 1
        placed += [(offset + ln, lo, hi, sid) for ln, lo, hi, sid in sub]
    return {sid: lane for lane, _, _, sid in placed}


def timeline_data(view: TraceView) -> dict[str, Any]:
    """What the HTML page draws: rows of bars (ms from the view's start, in lanes)."""
    t0 = view_start(view)
    labels, row_of = _rows(view)
    spans = view.all_spans()
    ranks = effective_ranks(spans)
    rows: list[dict[str, Any]] = [
        {"label": label, "kind": label.split(" ", 1)[0], "spans": []} for label in labels
    ]
    per_row: dict[int, list[SpanRecord]] = {}
    for s in spans:
        per_row.setdefault(row_of[s["span_id"]], []).append(s)
    for i, row_spans in per_row.items():
        lane = lanes(row_spans)
        for s in row_spans:
            rows[i]["spans"].append(
                {
                    "id": s["span_id"],
                    "name": s["name"],
                    "start_ms": round((s["start_time"] - t0) * 1000, 3),
                    "dur_ms": s["duration_ms"],
                    "lane": lane[s["span_id"]],
                    "proc": process_label(s, ranks.get(s["span_id"])),
                    "error": s.get("error"),
                    "attrs": {k: v for k, v in s["attrs"].items() if k != "job_ids"},
                }
            )
    end = max((end_time(s) for s in spans), default=t0)
    return {
        "title": view.title,
        "t0_unix_s": t0,
        "total_ms": round((end - t0) * 1000, 3),
        "rows": rows,
    }


_PAGE_PARTS = re.compile(r"@(TITLE|CSS|DATA|JS)@")


@functools.cache
def _page_files() -> tuple[str, str, str]:
    """The page template, its stylesheet and its script (package data: producer/trace_page/)."""
    folder = importlib.resources.files("producer") / "trace_page"

    def read(name: str) -> str:
        return (folder / name).read_text(encoding="utf-8")

    return read("page.html"), read("page.css"), read("page.js")


def to_html(view: TraceView) -> str:
    """A self-contained page (inline CSS and JS, no external assets): a row per job or batch,
    a bar per span placed by time, children in lanes below their parents, details on hover."""
    # `</` would end the script element early; JSON allows `<\\/` for the same text.
    data = json.dumps(timeline_data(view), default=str).replace("</", "<\\/")
    template, css, js = _page_files()
    parts = {"TITLE": html.escape(view.title), "CSS": css, "DATA": data, "JS": js}
    # One pass over the template: text put in is never searched for placeholders again.
    return _PAGE_PARTS.sub(lambda m: parts[m.group(1)], template)
