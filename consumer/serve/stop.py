"""The consumer's stop flag: the first SIGTERM/SIGINT drains, the second exits at once.

The handler only records the signal and wakes a thread: it runs on the main thread between
any two bytecodes, possibly while that thread is inside a log call holding the output's lock,
so logging there could deadlock the process. `consumer.draining` is logged by the
announcer thread `install` starts (the event it waits on is touched by no other code of the
main thread, so setting it from the handler cannot wait on the main thread itself).
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("teacherq.consumer")


@dataclass
class StopFlag:
    """Set by the first SIGTERM/SIGINT (finish the work in hand, then exit); a second signal
    exits at once."""

    requested: bool = False
    signals: int = 0
    signum: int | None = None  # the first stop signal received
    # Set by the announcer once `consumer.draining` is logged.
    announced: threading.Event = field(default_factory=threading.Event, repr=False)
    _received: threading.Event = field(default_factory=threading.Event, repr=False)

    def install(self) -> None:
        """Route SIGTERM and SIGINT here, and start the announcer."""
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        threading.Thread(target=self._announce, name="tq-stop", daemon=True).start()

    def _announce(self) -> None:
        self._received.wait()
        log.info("consumer.draining", signal=self.signum)
        self.announced.set()

    def _handle(self, signum: int, _frame: object) -> None:
        # No logging here (see the module doc).
        self.signals += 1
        if self.signals > 1:
            os.write(2, f"consumer.stop_now: second signal {signum}, exiting\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        self.requested = True
        self._received.set()
