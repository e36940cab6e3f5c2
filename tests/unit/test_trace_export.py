"""Trace exports from real spans: the tree, Chrome trace-event JSON, the HTML page's data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.trace_export import (
    JobTrace,
    TraceView,
    build_forest,
    render_text,
    timeline_data,
    to_chrome,
    to_html,
)
from shared import tracing
from shared.trace_store import decode_spans, encode_span, job_subset
from shared.tracing import SpanRecord, record, span
from tests.helpers import REPO
from tests.timing import scaled

JOB_PHASES = ["submit", "queue_wait", "claim", "pack", "forward", "head", "store", "ack"]


@pytest.fixture
def records() -> Iterator[list[SpanRecord]]:
    got: list[SpanRecord] = []
    previous = tracing.configure_sink(got.append)
    try:
        yield got
    finally:
        tracing.configure_sink(previous)


def simulate_job(job_id: str, batch_id: str) -> None:
    """The spans one job leaves behind, made by the real tracing API the way the producer and
    the consumer make them (here in one process)."""
    with span("submit", job_id=job_id, tokens=5) as sub:
        carrier = sub.carrier
        submitted_at = tracing.now()  # what encode_job stamps into the entry
    t_claim0 = tracing.now()
    record("queue_wait", start_time=submitted_at, end_time=t_claim0, carrier=carrier, job_id=job_id)
    time.sleep(0.002)
    t_claim1 = tracing.now()
    record("claim", start_time=t_claim0, end_time=t_claim1, carrier=carrier, job_id=job_id)
    with span("batch", root=True, batch_id=batch_id, job_ids=[job_id], tokens=5) as b:
        p0 = b.elapsed()
        time.sleep(0.001)
        b.child("pack", start_s=p0, end_s=b.elapsed())
        f0 = b.elapsed()
        time.sleep(0.004)
        f1 = b.elapsed()
        time.sleep(0.002)
        h1 = b.elapsed()
        for rank in (0, 1):
            r = b.child(f"rank{rank}", start_s=f0, end_s=h1, rank=rank)
            r.child("forward", start_s=0, end_s=f1 - f0)
            r.child("head", start_s=f1 - f0, end_s=h1 - f0)
    record(
        "pack",
        start_time=b.start_wall + p0,
        end_time=b.start_wall + f0,
        carrier=carrier,
        job_id=job_id,
        batch_id=batch_id,
    )
    for name, lo, hi in (("forward", f0, f1), ("head", f1, h1)):
        record(
            name,
            start_time=b.start_wall + lo,
            end_time=b.start_wall + hi,
            carrier=carrier,
            job_id=job_id,
            batch_id=batch_id,
        )
    with span("store", carrier=carrier, job_id=job_id, batch_id=batch_id):
        time.sleep(0.001)
    with span("ack", carrier=carrier, job_id=job_id, batch_id=batch_id):
        pass


def view_of(records: list[SpanRecord], job_id: str, batch_id: str) -> TraceView:
    # Through the wire form, as the reader sees them.
    stored = decode_spans([encode_span(r) for r in records])
    job_trace = next(r["trace_id"] for r in stored if r["name"] == "submit")
    batch_trace = next(r["trace_id"] for r in stored if r["name"] == "batch")
    job_spans = job_subset([r for r in stored if r["trace_id"] == job_trace], job_id)
    return TraceView(
        title=f"job {job_id}",
        jobs=[JobTrace(job_id, job_spans, [batch_id])],
        batches={batch_id: [r for r in stored if r["trace_id"] == batch_trace]},
    )


def test_tree_of_a_job_and_its_batch(records) -> None:
    simulate_job("job-1", "batch-1")
    view = view_of(records, "job-1", "batch-1")
    [root] = build_forest(view.jobs[0].spans)
    assert root.span["name"] == "submit" and not root.orphan
    assert [c.span["name"] for c in root.children] == JOB_PHASES[1:]
    [batch] = build_forest(view.batches["batch-1"])
    assert [c.span["name"] for c in batch.children] == ["pack", "rank0", "rank1"]
    assert [g.span["name"] for g in batch.children[1].children] == ["forward", "head"]

    text = render_text(view)
    lines = text.splitlines()
    assert lines[0].startswith("job job-1  trace ") and "end to end" in lines[0]
    assert lines[1].startswith("  submit  ")
    order = [ln.strip().split()[0] for ln in lines[1:9]]
    assert order == JOB_PHASES
    assert all(ln.startswith("    ") for ln in lines[2:9])  # under submit
    assert any(ln.startswith("rode in batch batch-1") for ln in lines)
    assert any(ln.startswith("      forward ") and "rank1" in ln for ln in lines)


def test_orphans_become_marked_roots() -> None:
    recs = [
        {"trace_id": "t", "span_id": "a", "parent_span_id": "missing", "name": "store",
         "start_time": 10.0, "duration_ms": 1.0, "attrs": {"job_id": "j"}},
        {"trace_id": "t", "span_id": "b", "parent_span_id": "a", "name": "upload",
         "start_time": 10.0001, "duration_ms": 0.5, "attrs": {}},
    ]  # fmt: skip
    [root] = build_forest(recs)
    assert root.orphan and root.children[0].span["name"] == "upload"
    text = render_text(TraceView("job j", [JobTrace("j", recs)], {}))
    assert "store" in text and "(parent not recorded)" in text


def _check_chrome(doc: dict) -> list[dict]:
    events = doc["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert xs, "no complete events"
    named_pids = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    named_threads = {
        (e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"
    }
    for e in xs:
        assert isinstance(e["ts"], float | int) and e["ts"] >= 0
        assert isinstance(e["dur"], float | int) and e["dur"] >= 0
        assert e["pid"] in named_pids and (e["pid"], e["tid"]) in named_threads
        assert e["name"] and "span_id" in e["args"]
    starts = [e for e in events if e["ph"] == "s"]
    ends = [e for e in events if e["ph"] == "f"]
    assert sorted(e["id"] for e in starts) == sorted(e["id"] for e in ends)  # flows pair up
    assert all(e["ph"] in "XMsf" for e in events)
    # Children lie within their parents, except spans whose parent ran in another process.
    by_id = {e["args"]["span_id"]: e for e in xs}
    remote = {e["args"]["span_id"] for e in xs if e["args"].get("remote_parent")}
    checked = 0
    for e in xs:
        parent = by_id.get(e["args"]["parent_span_id"])
        if parent is None or e["args"]["span_id"] in remote:
            continue
        assert e["ts"] >= parent["ts"] - 1e-6, (e["name"], parent["name"])
        assert e["ts"] + e["dur"] <= parent["ts"] + parent["dur"] + 1.0, (e["name"], parent)
        checked += 1
    return xs if checked else []


def test_chrome_trace_is_well_formed_and_nested(records) -> None:
    simulate_job("job-1", "batch-1")
    view = view_of(records, "job-1", "batch-1")
    doc = json.loads(json.dumps(to_chrome(view)))  # JSON-serializable as is
    xs = _check_chrome(doc)
    assert len(xs) == len(view.all_spans()) == 8 + 8  # job phases + batch, pack, 2x(rank, f, h)
    nested = {e["name"] for e in xs if e["args"]["parent_span_id"] and e["name"] != "submit"}
    assert {"rank0", "rank1", "forward", "head", "pack"} <= nested
    # Rank spans get their own process rows; the job's phases share the job's thread row.
    pids = {e["args"].get("rank"): e["pid"] for e in xs if e["name"].startswith("rank")}
    assert pids[0] != pids[1]
    job_tids = {e["tid"] for e in xs if e["args"].get("job_id") == "job-1"}
    assert len(job_tids) == 1
    flows = [e for e in doc["traceEvents"] if e["ph"] == "s"]
    assert len(flows) == 7  # submit -> each consumer phase


def test_chrome_containment_check_catches_a_child_outside_its_parent(records) -> None:
    simulate_job("job-1", "batch-1")
    view = view_of(records, "job-1", "batch-1")
    doc = to_chrome(view)
    fwd = next(
        e
        for e in doc["traceEvents"]
        if e["ph"] == "X"
        and e["name"] == "head"
        and e["args"].get("rank") is None
        and "job_id" not in e["args"]
    )
    fwd["dur"] += 1e6  # one second past its rank span
    with pytest.raises(AssertionError):
        _check_chrome(doc)


def test_timeline_data_and_page_are_self_contained(records) -> None:
    simulate_job("job-1", "batch-1")
    view = view_of(records, "job-1", "batch-1")
    view.jobs[0].spans[0]["attrs"]["note"] = "</script><script>alert(1)</script>"
    data = timeline_data(view)
    assert [r["label"] for r in data["rows"]] == ["job job-1", "batch batch-1"]
    job_row, batch_row = data["rows"]
    assert [s["name"] for s in job_row["spans"]] == JOB_PHASES
    assert {s["lane"] for s in job_row["spans"]} == {0, 1}  # submit, then the consumer's
    for row in data["rows"]:
        spans = row["spans"]
        for a in spans:
            for b in spans:  # no two overlapping bars in one lane
                if a is not b and a["lane"] == b["lane"]:
                    assert (
                        a["start_ms"] + a["dur_ms"] <= b["start_ms"] + 1e-3
                        or b["start_ms"] + b["dur_ms"] <= a["start_ms"] + 1e-3
                    ), (a, b)
    parents = {s["span_id"]: s["parent_span_id"] for s in view.all_spans()}
    lane_of = {s["id"]: s["lane"] for s in batch_row["spans"]}
    for s in batch_row["spans"]:
        if parents[s["id"]] in lane_of:
            assert s["lane"] > lane_of[parents[s["id"]]]  # children below their parents
    assert sorted(s["lane"] for s in batch_row["spans"] if s["name"].startswith("rank")) == [1, 3]
    assert all(0 <= s["start_ms"] <= data["total_ms"] for r in data["rows"] for s in r["spans"])
    page = to_html(view)
    assert "http://" not in page and "https://" not in page and " src=" not in page
    assert page.count("</script>") == 3  # the attribute's </script> is escaped in the data
    assert "<\\/script><script>alert(1)<\\/script>" in page


def test_placeholders_in_span_text_are_not_expanded(records) -> None:
    """The page is filled in one pass: a title or attribute that spells a placeholder
    (`@JS@`, `@CSS@`) is shown as written, never replaced by the script or stylesheet."""
    simulate_job("job-1", "batch-1")
    view = view_of(records, "job-1", "batch-1")
    view.title = "job @JS@ @CSS@"
    view.jobs[0].spans[0]["attrs"]["note"] = "@DATA@ @TITLE@"
    page = to_html(view)
    assert "<title>teacherq trace: job @JS@ @CSS@</title>" in page
    assert '"note": "@DATA@ @TITLE@"' in page
    assert page.count("const LANE = 18") == 1 and page.count(".bar.error") == 1


_CACHES = shutil.ignore_patterns("__pycache__", "*.pyc")
_RENDER = """
import json, sys
import producer
from producer.trace_export import JobTrace, TraceView, to_html
view = json.load(sys.stdin)
jobs = [JobTrace(j["job_id"], j["spans"], j["batch_ids"]) for j in view["jobs"]]
page = to_html(TraceView(view["title"], jobs, view["batches"]))
sys.stdout.write(json.dumps([producer.__file__, page]))
"""


def test_installed_package_renders_the_same_page(records, tmp_path: Path) -> None:
    """The page's HTML, CSS and JS are package data: a wheel built from the repository carries
    them, and the package installed from it renders exactly the page the source tree renders."""
    simulate_job("job-1", "batch-1")
    view = view_of(records, "job-1", "batch-1")
    src = tmp_path / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("producer", "consumer", "shared"):
        shutil.copytree(REPO / package, src / package, ignore=_CACHES)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("teacherq-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        zf.extractall(tmp_path / "site")  # a pure wheel installs by unpacking
    for name in ("page.html", "page.css", "page.js"):
        assert f"producer/trace_page/{name}" in names
    payload = {
        "title": view.title,
        "jobs": [
            {"job_id": j.job_id, "spans": j.spans, "batch_ids": j.batch_ids} for j in view.jobs
        ],
        "batches": view.batches,
    }
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run(
        [sys.executable, "-c", _RENDER],
        input=json.dumps(payload),
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    installed_from, page = json.loads(out.stdout)
    assert Path(installed_from).is_relative_to(tmp_path / "site")
    assert page == to_html(view)
