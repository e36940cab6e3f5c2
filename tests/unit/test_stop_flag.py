"""consumer/serve/stop.py: a SIGTERM that lands while the main thread is writing a log line
must not deadlock the consumer (the handler runs on that thread, between two bytecodes; a
handler that logged would wait for the output lock its own thread holds).

Found by `make test-stress`: a consumer told to stop while its writers logged retries hung
with every thread in structlog's write lock and `consumer.draining` never written.
"""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO
from tests.timing import scaled

_CHILD = """
import os, signal, threading, time
from shared.log import configure_logging
from consumer.serve.stop import StopFlag
import structlog

configure_logging(level="info", fmt="json")
log = structlog.get_logger("t")
for round_ in range(ROUNDS):
    flag = StopFlag()
    flag.install()
    delay = (round_ % 20) / 20000  # the signal lands at varied points of the logging loop
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGTERM)).start()
    while not flag.requested:
        log.info("busy", round=round_, pad="x" * 200)
    assert flag.announced.wait(30), "consumer.draining not logged"
signal.signal(signal.SIGTERM, signal.SIG_DFL)
print("rounds done", flush=True)
"""


def test_sigterm_while_logging_never_deadlocks() -> None:
    """200 rounds of SIGTERM delivered while the main thread logs without pause: every
    round's flag is seen, `consumer.draining` is logged once per round, nothing hangs."""
    rounds = 200
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.replace("ROUNDS", str(rounds))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "rounds done"
    assert done.stderr.count('"consumer.draining"') == rounds
