"""Claim the next batch on a background thread while the device computes the current one."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from consumer.serve.stop import StopFlag
from shared.streams import Entry


class Prefetcher:
    """Claims the next batch on a background thread while the current one computes.

    With depth 0 the loop claims inline. On stop, the thread stops claiming, and everything
    it already claimed is still handed out (and so finished) before `get` returns None.
    After claiming redelivered entries (`serial()` true) it waits until the loop has processed
    them before claiming more: a redelivered entry may be the poison that kills the process,
    and entries claimed ahead of it would be charged a delivery for nothing. Batches are
    counted, handed out and processed, so the loop finishing an earlier batch does not pass
    for the redelivered one (a single flag did: the loop's word for the batch before let the
    thread claim past a redelivered entry it had not even taken yet).
    """

    _DONE = object()

    def __init__(
        self,
        fetch: Callable[[], list[Entry]],
        *,
        depth: int,
        stop: StopFlag,
        serial: Callable[[], bool] = lambda: False,
    ) -> None:
        self.fetch = fetch
        self.stop = stop
        self.depth = depth
        self.serial = serial
        self._progress = threading.Condition()
        self._handed = 0  # batches handed out (counted before they are queued)
        self._finished = 0  # batches the loop reported processed
        self._closed = threading.Event()  # the loop is done: claim and hand out no more
        self._q: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="tq-prefetch", daemon=True)
            self._thread.start()

    def _ending(self) -> bool:
        return self.stop.requested or self._closed.is_set()

    def _run(self) -> None:
        try:
            while not self._ending():
                entries = self.fetch()
                if entries:
                    wait = self.serial()
                    with self._progress:
                        self._handed += 1
                        mine = self._handed
                    self._hand_out(entries)
                    if wait:
                        self._wait_processed(mine)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop thread, re-raised there
            self._error = exc
        finally:
            self._hand_out(self._DONE)

    def _wait_processed(self, batch: int) -> None:
        """Block until the loop has processed the `batch`-th batch handed out, or is ending."""
        with self._progress:
            while self._finished < batch and not self._ending():
                self._progress.wait(0.5)

    def _hand_out(self, item: object) -> None:
        """Queue `item` for the loop; given up once closed (the loop takes no more)."""
        while not self._closed.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    @property
    def ahead(self) -> bool:
        """Whether entries are claimed on a background thread (else `get` claims inline)."""
        return self._thread is not None

    def get(self, *, timeout_s: float) -> list[Entry] | None:
        """The next claimed entries, [] if none arrived in time, None once stopped and empty."""
        if self._thread is None:
            return None if self.stop.requested else self.fetch()
        try:
            item = self._q.get(timeout=timeout_s)
        except queue.Empty:
            return []
        if item is self._DONE:
            if self._error is not None:
                raise self._error
            return None
        return item

    def processed(self) -> None:
        """The loop finished the entries it got last (once per non-empty `get`)."""
        with self._progress:
            self._finished += 1
            self._progress.notify_all()

    def close(self) -> None:
        """Stop claiming and wait for the thread (at most one claim's BLOCK time). After a
        stop the loop has taken everything; a loop that ended on an error took no more, and
        what the thread had claimed stays pending in Redis, to be redelivered. (The thread
        used to claim on until the stop flag, which an error never sets: 30 s of join.)"""
        if self._thread is not None:
            self._closed.set()
            self._thread.join(timeout=30)
