"""Spans: nesting, errors, async, threads, children at offsets, recorded spans, the sink."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import structlog

from shared import tracing
from shared.tracing import (
    PhaseClock,
    SpanRecord,
    attach_phases,
    current_carrier,
    propagate,
    record,
    span,
    traced,
)


@pytest.fixture
def records() -> Iterator[list[SpanRecord]]:
    """Finished span records, in the order the sink got them."""
    got: list[SpanRecord] = []
    previous = tracing.configure_sink(got.append, process="unit")
    try:
        yield got
    finally:
        tracing.configure_sink(previous)


@pytest.fixture
def events() -> Iterator[list[dict[str, Any]]]:
    """Log events as structlog would render them (context merged in)."""
    got: list[dict[str, Any]] = []

    def keep(_logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
        got.append({**event, "level": method})
        raise structlog.DropEvent

    old = structlog.get_config()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, keep],
        wrapper_class=structlog.make_filtering_bound_logger(0),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    try:
        yield got
    finally:
        structlog.configure(**old)
        structlog.contextvars.clear_contextvars()


def by_name(recs: list[SpanRecord]) -> dict[str, SpanRecord]:
    out = {r["name"]: r for r in recs}
    assert len(out) == len(recs), "span names in these tests are unique"
    return out


def test_nested_spans_link_and_log_start_and_end(records, events) -> None:
    with span("outer", job_id="j1") as outer:
        with span("inner", step=2) as inner:
            assert current_carrier() == inner.carrier
            structlog.get_logger().info("work.done")
        assert current_carrier() == outer.carrier
    assert current_carrier() == {}
    recs = by_name(records)
    assert recs["outer"]["parent_span_id"] is None
    assert recs["inner"]["parent_span_id"] == recs["outer"]["span_id"]
    assert recs["inner"]["trace_id"] == recs["outer"]["trace_id"]
    assert recs["inner"]["attrs"] == {"step": 2}
    assert recs["outer"]["process"] == "unit"
    assert records.index(recs["inner"]) < records.index(recs["outer"])  # finished first
    names = [e["event"] for e in events]
    assert names == ["outer.start", "inner.start", "work.done", "inner.end", "outer.end"]
    work = events[2]
    # A log line inside a span carries its ids and the job bound by the outer span.
    assert work["span_id"] == inner.span_id and work["parent_span_id"] == outer.span_id
    assert work["trace_id"] == outer.trace_id and work["job_id"] == "j1"
    end = events[3]
    assert end["duration_ms"] == pytest.approx(recs["inner"]["duration_ms"], abs=1e-3)
    assert end["step"] == 2
    assert "job_id" not in events[-1] or events[-1]["job_id"] == "j1"


def test_durations_and_child_containment(records) -> None:
    with span("outer"):
        time.sleep(0.02)
        with span("inner"):
            time.sleep(0.01)
    recs = by_name(records)
    outer, inner = recs["outer"], recs["inner"]
    assert 25 <= outer["duration_ms"] < 2000
    assert 10 <= inner["duration_ms"] <= outer["duration_ms"]
    assert inner["start_time"] >= outer["start_time"]
    # One clock per process: the inner end lies inside the outer span (1 µs resolution).
    inner_end = inner["start_time"] + inner["duration_ms"] / 1000
    assert inner_end <= outer["start_time"] + outer["duration_ms"] / 1000 + 1e-6


def test_error_is_recorded_and_propagates(records, events) -> None:
    with pytest.raises(KeyError), span("lookup", key="k"):
        raise KeyError("k")
    [rec] = records
    assert rec["error"] == "KeyError: 'k'"
    end = [e for e in events if e["event"] == "lookup.end"][0]
    assert end["level"] == "warning" and end["error"] == "KeyError: 'k'"
    assert current_carrier() == {}  # the context is restored after the error


def test_attrs_set_late_and_reserved_names(records) -> None:
    with span("submit") as s:
        s.set(enqueued=True, error_count=0)
    assert records[0]["attrs"] == {"enqueued": True, "error_count": 0}
    with pytest.raises(ValueError, match="reserved"):
        span("x", duration_ms=1)
    with pytest.raises(ValueError, match="reserved"), span("y") as s2:
        s2.set(error="no")


def test_carrier_continues_a_remote_trace_and_root_starts_a_new_one(records) -> None:
    remote = {"trace_id": "aaaaaaaaaaaaaaaa", "span_id": "bbbbbbbbbbbbbbbb"}
    with span("store", carrier=remote, job_id="j"), span("upload"):
        pass
    with span("loop"), span("batch", root=True):
        pass
    recs = by_name(records)
    assert recs["store"]["trace_id"] == remote["trace_id"]
    assert recs["store"]["parent_span_id"] == remote["span_id"]
    assert recs["store"]["remote_parent"] is True
    assert "remote_parent" not in recs["upload"]
    assert recs["upload"]["parent_span_id"] == recs["store"]["span_id"]
    assert recs["batch"]["parent_span_id"] is None
    assert recs["batch"]["trace_id"] != recs["loop"]["trace_id"]


def test_children_at_offsets_and_grandchildren(records) -> None:
    with span("batch", batch_id="b1") as b:
        time.sleep(0.005)
        rank = b.child("rank1", start_s=0.001, end_s=0.004, rank=1)
        rank.child("forward", start_s=0.0005, end_s=0.002)
    recs = by_name(records)
    batch, r1, fwd = recs["batch"], recs["rank1"], recs["forward"]
    assert r1["parent_span_id"] == batch["span_id"] and fwd["parent_span_id"] == r1["span_id"]
    assert r1["start_time"] == pytest.approx(batch["start_time"] + 0.001, abs=1e-6)
    assert r1["duration_ms"] == pytest.approx(3.0, abs=1e-3)
    assert fwd["start_time"] == pytest.approx(r1["start_time"] + 0.0005, abs=1e-6)
    assert fwd["duration_ms"] == pytest.approx(1.5, abs=1e-3)
    assert r1["attrs"] == {"rank": 1}
    with pytest.raises(ValueError, match="ends before it starts"), span("p") as p:
        p.child("backwards", start_s=0.002, end_s=0.001)


def test_record_at_wall_times_under_a_carrier_or_the_current_span(records) -> None:
    carrier = {"trace_id": "cccccccccccccccc", "span_id": "dddddddddddddddd"}
    t = tracing.now()
    ref = record("queue_wait", start_time=t - 2.0, end_time=t - 0.5, carrier=carrier, job_id="j")
    with span("claim") as claim:
        record("decode", start_time=claim.start_wall, end_time=tracing.now())
    recs = by_name(records)
    qw = recs["queue_wait"]
    assert qw["trace_id"] == carrier["trace_id"] and qw["parent_span_id"] == carrier["span_id"]
    assert qw["remote_parent"] is True and qw["duration_ms"] == pytest.approx(1500.0, abs=1e-3)
    assert ref.carrier == {
        "trace_id": carrier["trace_id"],
        "span_id": qw["span_id"],
        "traceparent": f"00-{carrier['trace_id']:0>32}-{qw['span_id']}-01",
    }
    assert recs["decode"]["parent_span_id"] == recs["claim"]["span_id"]


def test_async_tasks_nest_under_their_own_parents(records) -> None:
    @span("fetch")
    async def fetch(i: int) -> dict[str, str]:
        async with span(f"step{i}"):
            await asyncio.sleep(0.01 * (3 - i))  # interleave the tasks
            return current_carrier()

    async def main() -> list[dict[str, str]]:
        async with span("gather"):
            return await asyncio.gather(*(fetch(i) for i in range(3)))

    carriers = asyncio.run(main())
    gather = [r for r in records if r["name"] == "gather"][0]
    fetches = [r for r in records if r["name"] == "fetch"]
    assert len(fetches) == 3
    assert all(f["parent_span_id"] == gather["span_id"] for f in fetches)
    for i, carrier in enumerate(carriers):
        step = [r for r in records if r["name"] == f"step{i}"][0]
        assert carrier["span_id"] == step["span_id"]
        assert step["parent_span_id"] in {f["span_id"] for f in fetches}
    parents = {r["parent_span_id"] for r in records if r["name"].startswith("step")}
    assert len(parents) == 3  # each step under its own fetch, not a sibling task's


def test_threads_nest_with_propagate_and_not_without(records) -> None:
    seen: dict[str, dict[str, str]] = {}

    def work(tag: str) -> None:
        with span(f"work_{tag}"):
            seen[tag] = current_carrier()

    with span("parent") as parent:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(propagate(work), ["a", "b"]))
        t = threading.Thread(target=work, args=("plain",))
        t.start()
        t.join()
    recs = by_name(records)
    for tag in ("a", "b"):
        assert recs[f"work_{tag}"]["parent_span_id"] == parent.span_id
        assert recs[f"work_{tag}"]["trace_id"] == parent.trace_id
    # A plain thread starts from an empty context: a new trace, which is why propagate exists.
    assert recs["work_plain"]["trace_id"] != parent.trace_id
    assert current_carrier() == {}


def test_decorators_sync_recursive_and_named(records) -> None:
    @traced()
    def countdown(n: int) -> int:
        return 0 if n == 0 else 1 + countdown(n - 1)

    assert countdown(2) == 2
    spans = [r for r in records if r["name"].endswith("countdown")]
    assert len(spans) == 3
    innermost, middle, outer = spans  # finished innermost first
    assert innermost["parent_span_id"] == middle["span_id"]
    assert middle["parent_span_id"] == outer["span_id"]

    with pytest.raises(TypeError, match="generator"):

        @span("gen")
        def gen() -> Iterator[int]:
            yield 1


def test_a_span_closed_in_another_context_restores_the_values(records) -> None:
    with span("outer") as outer:
        scope = span("moved")
        ctx = contextvars.copy_context()
        ctx.run(scope.__enter__)
        scope.__exit__(None, None, None)  # tokens from ctx do not work here: fallback path
        assert current_carrier() == outer.carrier
    assert current_carrier() == {}
    assert [r["name"] for r in records] == ["moved", "outer"]


def test_a_failing_sink_never_breaks_the_traced_code(events) -> None:
    def broken(_rec: SpanRecord) -> None:
        raise ConnectionError("redis down")

    previous = tracing.configure_sink(broken)
    before = tracing.sink_failures()
    try:
        with span("still_runs") as s:
            value = 41 + 1
        s.child("phase", start_s=0, end_s=0)
    finally:
        tracing.configure_sink(previous)
    assert value == 42
    assert tracing.sink_failures() == before + 2
    # Each failure is one warning line naming the error; its traceback only at debug level.
    failed = [e for e in events if e["event"] == "trace.sink_failed"]
    warnings = [e for e in failed if e["level"] == "warning"]
    assert [e["error"] for e in warnings] == ["ConnectionError: redis down"] * 2
    assert not any("exc_info" in e for e in warnings)
    assert [e.get("exc_info") for e in failed if e["level"] == "debug"] == [True, True]


def test_record_clamps_an_end_before_its_start(records) -> None:
    t = tracing.now()
    record("queue_wait", start_time=t, end_time=t - 0.25, job_id="j")  # two hosts' clocks
    [rec] = records
    assert rec["duration_ms"] == 0 and rec["attrs"]["clock_skew_ms"] == pytest.approx(250)


def test_phase_clock_offsets_and_attached_rank_spans(records) -> None:
    names = ["h2d", "forward", "head", "d2h"]
    marks: list[str] = []

    def device_mark():  # a device that finishes each phase's work 0.05 s after the host
        marks.append("queued")
        done = time.perf_counter() - t0 + 0.05
        return lambda: (marks.append("read"), done)[1]

    t0 = time.perf_counter()
    clock = PhaseClock(device_mark=device_mark)
    with clock.phase("h2d"):
        time.sleep(0.002)
    with clock.phase("forward"):
        time.sleep(0.005)
    for _ in range(2):  # a chunked head is one phase
        with clock.phase("head"):
            time.sleep(0.002)
    assert marks == ["queued"] * 4  # marks are read only when the offsets are
    flat = clock.offsets(names)
    assert len(flat) == 8 and flat[6:] == [0.0, 0.0]  # d2h never ran
    assert marks.count("read") == 3  # one per phase name, the head's last chunk
    assert flat[0] < flat[2] < flat[4] and flat[1] < flat[3] < flat[5]
    # Each phase ends when its device work does (the host left it 0.05 s earlier).
    assert flat[1] - flat[0] >= 0.05 and flat[5] - flat[4] >= 0.05
    host_only = PhaseClock()
    with host_only.phase("h2d"):
        time.sleep(0.002)
    start, end = host_only.offsets(["h2d"])
    assert end - start >= 0.002  # no device: the host's own times

    with span("batch", batch_id="b") as b:
        time.sleep(0.012)
        at = 0.001
        rank = attach_phases(b, "rank1", names, flat, at_s=at, rank=1)
        assert attach_phases(b, "rank2", names, [0.0] * 8, at_s=at) is None
    recs = {r["name"]: r for r in records}
    assert rank is not None and recs["rank1"]["parent_span_id"] == recs["batch"]["span_id"]
    assert recs["rank1"]["attrs"] == {"rank": 1}
    assert set(recs) == {"batch", "rank1", "h2d", "forward", "head"}
    for phase, i in (("h2d", 0), ("forward", 1), ("head", 2)):
        assert recs[phase]["parent_span_id"] == recs["rank1"]["span_id"]
        want = recs["batch"]["start_time"] + at + flat[2 * i]
        assert recs[phase]["start_time"] == pytest.approx(want, abs=2e-6)
        assert recs[phase]["duration_ms"] == pytest.approx(
            (flat[2 * i + 1] - flat[2 * i]) * 1000, abs=2e-3
        )


def test_the_sink_records_the_process_rank_for_threads_without_it() -> None:
    got: list[SpanRecord] = []
    structlog.contextvars.bind_contextvars(rank=3)
    try:
        previous = tracing.configure_sink(got.append, process="consumer c")  # rank taken now

        def store() -> None:
            with span("store"):  # a writer thread: no rank in its log context
                pass

        t = threading.Thread(target=store)
        t.start()
        t.join()
        with span("loop"):
            pass
    finally:
        tracing.configure_sink(previous)
        structlog.contextvars.unbind_contextvars("rank")
    assert [(r["name"], r["rank"], r["process"]) for r in got] == [
        ("store", 3, "consumer c"),
        ("loop", 3, "consumer c"),
    ]


def test_trace_ids_are_w3c_and_a_traceparent_parents_a_span(records) -> None:
    """New traces get 128-bit ids; a carrier holding only a W3C `traceparent` (what an
    OpenTelemetry propagator injects) parents a span in that trace, and the span's own
    carrier gives its traceparent back; an invalid traceparent starts a new trace."""
    trainer_trace, trainer_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    header = f"00-{trainer_trace}-{trainer_span}-01"
    with span("submit", carrier={"traceparent": header}) as s:
        pass
    with span("plain") as plain:
        pass
    for bad in (
        f"00-{'0' * 32}-{trainer_span}-01",  # all-zero trace id
        f"00-{trainer_trace}-{'0' * 16}-01",  # all-zero span id
        f"ff-{trainer_trace}-{trainer_span}-01",  # version ff is invalid
        f"00-{trainer_trace[:-1]}-{trainer_span}-01",  # short trace id
        f"00-{trainer_trace}-{trainer_span}-01-extra",  # version 00 has four fields
        "garbage",
    ):
        assert tracing.parse_carrier({"traceparent": bad}) is None, bad
    # A later version is read as 00 (its extra fields ignored).
    later = f"01-{trainer_trace}-{trainer_span}-01-more"
    assert tracing.parse_carrier({"traceparent": later}) == (trainer_trace, trainer_span)
    rec = by_name(records)["submit"]
    assert rec["trace_id"] == trainer_trace and rec["parent_span_id"] == trainer_span
    assert rec["remote_parent"] is True
    assert s.carrier["traceparent"] == f"00-{trainer_trace}-{s.span_id}-01"
    assert len(plain.trace_id) == 32 and int(plain.trace_id, 16) != 0
    assert len(plain.span_id) == 16


def test_a_trainers_opentelemetry_span_parents_a_submit(records) -> None:
    """With no carrier and no teacherq span open, the caller's current OpenTelemetry span
    (a trainer instrumented with the OpenTelemetry SDK) is the parent."""
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("trainer")
    with tracer.start_as_current_span("rollout") as rollout:
        with span("submit"):
            pass
        start_span_ = tracing.start_span("submit_unbound")
        tracing.end_span(start_span_)
    ctx = rollout.get_span_context()
    recs = by_name(records)
    for name in ("submit", "submit_unbound"):
        assert recs[name]["trace_id"] == format(ctx.trace_id, "032x")
        assert recs[name]["parent_span_id"] == format(ctx.span_id, "016x")


def test_trace_writes_that_fail_say_so_in_one_line(events) -> None:
    """Redis unreachable: the sink drops the records it could not write and logs one warning
    naming the error; the traceback only at debug level (a library stays quiet)."""
    import socket

    import redis

    from shared.trace_store import RedisSpanSink

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sink = RedisSpanSink(redis.Redis(port=port), "q", flush_interval_s=3600)
    try:
        sink({"trace_id": "t1", "span_id": "s1", "name": "x", "start_time": 0.0, "end_time": 1.0})
        assert sink.flush() == 0 and sink.dropped == 1
    finally:
        sink.close()
    failed = [e for e in events if e["event"] == "trace.flush_failed"]
    [warning] = [e for e in failed if e["level"] == "warning"]
    assert str(port) in warning["error"] and warning["records"] == 1
    assert "exc_info" not in warning
    assert [e.get("exc_info") for e in failed if e["level"] == "debug"] == [True]
