"""AsyncTeacherClient under a real event loop, on a real valkey-server with real consumers: the
loop keeps running while jobs wait, thousands of waiters share one completion reader, and
results (inline and from object storage) match the sync client and the full-vocab reference."""

from __future__ import annotations

import asyncio
import gc
import os
import time

import numpy as np
import pytest
import redis

from producer import AsyncTeacherClient, TeacherClient, TeacherRequest
from shared import tracing
from shared.settings import Settings
from tests.helpers import mixed_requests
from tests.reference import tiny_full_log_softmax
from tests.timing import scaled

pytestmark = pytest.mark.integration


async def _ticker(ticks: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        ticks.append(time.monotonic())
        await asyncio.sleep(0.01)


def _xread_clients(r: redis.Redis) -> int:
    """Connections of this process blocked in an XREAD right now (flag b: blocked)."""
    mine = f"teacherq-{os.getpid()}"
    return sum(
        1
        for c in r.client_list()
        if c.get("name") == mine and "b" in c.get("flags", "") and c.get("cmd") == "xread"
    )


def test_waiting_without_consumers_keeps_the_loop_running(settings: Settings, r) -> None:
    """With no consumer, `wait` and 2000 concurrent `as_completed` waiters time out as asked
    while a ticker task on the same loop keeps ticking every ~10 ms (nothing blocks the loop),
    and the waiters share one blocking XREAD and a bounded connection pool."""

    async def main() -> tuple[list[float], list[tuple[float, float]], int, int]:
        ticks: list[float] = []
        windows: list[tuple[float, float]] = []  # spans of pure waiting, checked for stalls
        stop = asyncio.Event()
        ticker = asyncio.create_task(_ticker(ticks, stop))
        async with AsyncTeacherClient(settings, max_connections=16) as client:
            ids = await client.submit(
                [TeacherRequest(input_ids=[i, i + 1, i + 2]) for i in range(2000)]
            )
            # The client records 2000 `submit` spans; its sink thread writes them now, so the
            # windows below time the waiting alone, not that thread's share of the CPU.
            sink = tracing.current_sink()
            assert sink is not None, "the asyncio client records its submit spans"
            await asyncio.to_thread(sink.flush)  # type: ignore[attr-defined]
            # A full garbage collection walks every object this test process holds (torch,
            # megatron and hundreds of earlier tests' leftovers) and can pause the loop for
            # half a second; that is the test process's heap, not the client blocking, so
            # the heap so far is moved out of the collector's reach while the loop is timed.
            gc.collect()
            gc.freeze()
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="2000 of 2000 jobs not done"):
                await client.wait(ids, timeout=1.0)
            windows.append((t0, time.monotonic()))

            async def one(job_id: str) -> None:
                async for _ in client.as_completed([job_id], timeout=3.0):
                    pass

            waiters = [asyncio.create_task(one(j)) for j in ids]
            await asyncio.sleep(1.0)  # every waiter has subscribed and checked its result
            t1 = time.monotonic()
            readers = await asyncio.to_thread(_xread_clients, r)
            mine = f"teacherq-{os.getpid()}"
            clients = await asyncio.to_thread(r.client_list)
            connections = sum(1 for c in clients if c.get("name") == mine)
            await asyncio.sleep(0.5)
            windows.append((t1, time.monotonic()))
            outcomes = await asyncio.gather(*waiters, return_exceptions=True)
            assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes[:3]
        stop.set()
        await ticker
        return ticks, windows, readers, connections

    try:
        ticks, windows, readers, connections = asyncio.run(main())
    finally:
        gc.unfreeze()
    # The ticker asks for a tick every 10 ms; an idle machine gives it at least one per 20 ms,
    # a busy one (TEACHERQ_TEST_TIMEOUT_SCALE) proportionally fewer. A blocking call on the
    # loop would show as one gap near a whole second, far above the stall bound even stretched.
    first = windows[0][1] - windows[0][0]
    assert 0.9 <= first < 1.0 + scaled(0.5), f"wait(timeout=1.0) returned after {first:.2f} s"
    for start, end in windows:
        inside = np.array([t for t in ticks if start <= t <= end])
        expected = (end - start) / scaled(0.02)
        assert len(inside) > expected, f"{len(inside)} ticks in {end - start:.2f} s"
        gaps = np.diff(np.concatenate([[start], inside, [end]]))
        stall = min(scaled(0.25), 0.8)
        assert gaps.max() < stall, f"the loop stalled for {gaps.max():.2f} s while waiting"
    assert readers == 1, f"{readers} blocking XREADs for 2000 waiters; expected one shared"
    # The pool is bounded at 16; the span sink's thread holds one more (blocking) connection.
    assert connections <= 16 + 1, f"{connections} connections open; the pool is bounded at 16"


def test_async_results_match_sync_client_and_reference(
    settings: Settings, start_consumer, tmp_path
) -> None:
    """End to end with a real consumer: `as_completed` yields every job once, the results equal
    the sync client's for the same ids and the full-vocab reference; bulk results come from
    object storage through the async read; ids are the sync client's (idempotent across the
    two); `cancel` before a consumer runs gives the cancelled failure; 300 concurrent tasks
    that each submit and wait on one client all get their own correct result."""
    s = settings.model_copy(
        update={"queue": settings.queue.model_copy(update={"inline_max_bytes": 256})}
    )
    reqs = mixed_requests(np.random.default_rng(7), 10)

    async def cancelled() -> tuple[str, list]:
        async with AsyncTeacherClient(s) as client:
            [job] = await client.submit([TeacherRequest(input_ids=[9, 8, 7])])
            await client.cancel(job)
            return job, await client.wait([job], timeout=scaled(10))

    cancel_job, [cancel_res] = asyncio.run(cancelled())
    assert cancel_res.error == "cancelled by the user"
    start_consumer(s)

    async def main() -> tuple[list[str], list]:
        async with AsyncTeacherClient(s) as client:
            ids = await client.submit(reqs)
            seen = [res async for res in client.as_completed(ids, timeout=scaled(120))]
            again = await client.wait(ids, timeout=scaled(5))  # all stored: returns at once
            assert [r.job_id for r in again] == ids
            return ids, seen

    ids, seen = asyncio.run(main())
    assert sorted(r.job_id for r in seen) == sorted(ids)
    sync = TeacherClient(s)
    assert sync.submit(reqs) == ids  # same content ids: nothing new enqueued
    by_id = {r.job_id: r for r in seen}
    for req, job_id, ref_res in zip(reqs, ids, sync.wait(ids, timeout=scaled(5)), strict=True):
        res = by_id[job_id]
        assert res.ok, res.error
        assert res.arrays().keys() == ref_res.arrays().keys()
        for name, arr in res.arrays().items():
            np.testing.assert_array_equal(arr, getattr(ref_res, name))
        ref = tiny_full_log_softmax(req.input_ids, req.temperature)
        want = ref[np.arange(req.num_tokens - 1), req.input_ids[1:]]
        np.testing.assert_allclose(res.logprobs, want, atol=2e-4)
    assert any((tmp_path / "objects").rglob("*.tqa*")), "some results should be in the store"
    [still] = sync.wait([cancel_job], timeout=scaled(5))
    assert still.error == "cancelled by the user"

    # Many concurrent tasks, each submitting its own job and waiting for it, on one client.
    rng = np.random.default_rng(11)
    many = [rng.integers(0, 1000, size=int(rng.integers(3, 12))) for _ in range(300)]

    async def one(client: AsyncTeacherClient, ids: np.ndarray) -> object:
        [job] = await client.submit([TeacherRequest(input_ids=ids)])
        [res] = await client.wait([job], timeout=scaled(180))
        return res

    async def crowd() -> list:
        async with AsyncTeacherClient(s) as client:
            return await asyncio.gather(*(one(client, ids) for ids in many))

    for ids, res in zip(many, asyncio.run(crowd()), strict=True):
        assert res.ok, res.error
        ref = tiny_full_log_softmax(ids)
        np.testing.assert_allclose(res.logprobs, ref[np.arange(len(ids) - 1), ids[1:]], atol=2e-4)


def test_async_client_fails_like_the_sync_one(settings: Settings) -> None:
    """No consumer needed: an unknown id raises UnknownJob from results, cancel and a wait
    without timeout (None with strict=False); a cancelled job raises JobFailed with
    raise_on_error; a full queue with backpressure=raise refuses with QueueFull naming the
    setting; delete_result_on_read removes what was read."""
    from producer import JobFailed, QueueFull, UnknownJob

    s = settings.model_copy(
        update={
            "queue": settings.queue.model_copy(
                update={
                    "max_pending_tokens": 8,
                    "backpressure": "raise",
                    "delete_result_on_read": True,
                }
            )
        }
    )

    async def main() -> None:
        async with AsyncTeacherClient(s, trace_process=None) as client:
            with pytest.raises(UnknownJob, match="nope"):
                await client.results(["nope"])
            assert await client.results(["nope"], strict=False) == [None]
            with pytest.raises(UnknownJob):
                await client.cancel("nope")
            with pytest.raises(UnknownJob):
                await client.wait(["nope"])
            [job] = await client.submit([TeacherRequest(input_ids=[1, 2, 3, 4, 5, 6])])
            with pytest.raises(QueueFull, match="queue.max_pending_tokens=8"):
                await client.submit([TeacherRequest(input_ids=[7, 8, 9])])
            await client.cancel(job)
            with pytest.raises(JobFailed, match="cancelled by the user"):
                await client.wait([job], timeout=scaled(5), raise_on_error=True)
            # The read above deleted the record (delete_result_on_read): gone from Redis.
            assert await client.results([job], strict=False) == [None]

    asyncio.run(main())
