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
