"""The consumer's stop flag: the first SIGTERM/SIGINT drains, the second exits at once."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import structlog

log = structlog.get_logger("teacherq.consumer")


@dataclass
class StopFlag:
    """Set by the first SIGTERM/SIGINT (finish the work in hand, then exit); a second signal
    exits at once."""

    requested: bool = False
    signals: int = 0

    def install(self) -> None:
        """Route SIGTERM and SIGINT here."""
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.signals += 1
        if self.signals > 1:
            log.warning("consumer.stop_now", signal=signum)
            os._exit(128 + signum)
        log.info("consumer.draining", signal=signum)
        self.requested = True
