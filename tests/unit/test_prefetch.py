"""The prefetcher (consumer/serve/prefetch.py): claims ahead on a thread, hands out everything it
claimed on a stop, and lets go at once when the loop ends without one (an error)."""

from __future__ import annotations

import threading
import time

from consumer.serve.prefetch import Prefetcher
from consumer.serve.stop import StopFlag
from tests.timing import scaled, wait_until


class Claims:
    """A stand-in for XREADGROUP: each call blocks up to `block_s` (as BLOCK does) unless
    entries are ready, then returns the next numbered batch."""

    def __init__(self, *, block_s: float = 0.05) -> None:
        self.block_s = block_s
        self.calls = 0
        self._never = threading.Event()

    def __call__(self) -> list:
        self._never.wait(self.block_s)
        self.calls += 1
        return [self.calls]


def test_a_loop_that_ended_on_an_error_is_let_go_at_once() -> None:
    """The loop takes one batch and stops taking (it raised); the stop flag is never set.
    `close` returns within a claim's BLOCK time and the thread is gone. (It claimed on until
    the stop flag and `close` waited its 30 s for it: a consumer whose result store broke
    took 30 s to exit.)"""
    claims = Claims()
    fetcher = Prefetcher(claims, depth=2, stop=StopFlag())
    assert fetcher.get(timeout_s=scaled(10)) == [1]
    wait_until(lambda: fetcher._q.full(), "the thread claims ahead until its queue is full")
    started = time.monotonic()
    fetcher.close()
    assert fetcher._thread is not None and not fetcher._thread.is_alive()
    assert time.monotonic() - started < scaled(5), "close waited for the thread's timeout"


def test_a_stop_hands_out_everything_claimed_then_none() -> None:
    """After a stop, `get` returns every batch the thread had claimed, in order, then None:
    nothing claimed is left unfinished."""
    stop = StopFlag()
    claims = Claims()
    fetcher = Prefetcher(claims, depth=2, stop=stop)
    got = [fetcher.get(timeout_s=scaled(10))]
    stop.requested = True
    while (batch := fetcher.get(timeout_s=scaled(10))) is not None:
        got.append(batch)
    fetcher.close()
    assert [b[0] for b in got] == list(range(1, claims.calls + 1))


def test_a_redelivered_batch_is_processed_before_the_next_claim() -> None:
    """A redelivered batch (`serial()` true once claimed) may be the poison that kills the
    process: nothing more is claimed until the loop has processed that very batch. The loop's
    word for the fresh batch before it does not count — a single flag let the thread claim
    past a redelivered entry the loop had not even taken yet, charging the entries behind it
    a delivery."""
    processed = 0
    seen_at_call: list[int] = []  # how many batches the loop had processed at each claim
    third_claim = threading.Event()

    def claims() -> list:
        seen_at_call.append(processed)
        if len(seen_at_call) >= 3:
            third_claim.set()
        return [len(seen_at_call)]

    fetcher = Prefetcher(claims, depth=2, stop=StopFlag(), serial=lambda: len(seen_at_call) >= 2)
    try:
        assert fetcher.get(timeout_s=scaled(10)) == [1]  # fresh
        # The thread claims the redelivered batch 2 before the loop finishes batch 1.
        wait_until(lambda: fetcher._q.qsize() == 1, "batch 2 claimed and queued")
        processed += 1
        fetcher.processed()
        assert fetcher.get(timeout_s=scaled(10)) == [2]
        # Batch 2 runs a while; a claim made meanwhile would show up here (it must not).
        third_claim.wait(0.5)
        processed += 1
        fetcher.processed()
        assert fetcher.get(timeout_s=scaled(10)) == [3]
    finally:
        fetcher.close()
    assert seen_at_call[:3] == [0, 0, 2], "batch 3 was claimed before batch 2 was processed"
