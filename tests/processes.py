"""Process helpers shared by the tests: a throwaway valkey-server, the "SIGTERM, wait, kill"
stop of a consumer or any other child process, the `teacherq` CLI in a child process, and a
child's output read through a pseudo-terminal."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from shared.redis_server import free_port, server_args, wait_ready
from shared.settings import Settings, to_env

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    settings: Settings | None,
    *args: str,
    stdin: str | None = None,
    env: dict[str, str | None] | None = None,
    cwd: Path = REPO,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """Run `teacherq ARGS` (this checkout's code) with the test's settings and capture
    everything as text. TEACHERQ_* variables of the test process are left out; an `env`
    value of None unsets that variable."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TEACHERQ_")}
    full = {**base, **(to_env(settings) if settings else {}), **(env or {})}
    full = {k: v for k, v in full.items() if v is not None}
    full["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        env=full,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_with_terminal_stderr(
    cmd: list[str], *, env: dict[str, str], cwd: Path = REPO, timeout: float = 60
) -> tuple[int, bytes, bytes]:
    """Run `cmd` with stderr on a pseudo-terminal (as a user's shell) and stdout on a pipe;
    return (exit code, what reached the terminal, stdout)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while select.select([master], [], [], timeout)[0]:  # until the process closes it
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other end closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, seen, out


def terminate(proc: subprocess.Popen, *, timeout: float = 30.0) -> int:
    """Ask `proc` to stop (SIGTERM, as a supervisor does) and return its exit code; raises
    subprocess.TimeoutExpired if it has not exited within `timeout` seconds."""
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout)


def stop_all(procs: Iterable[subprocess.Popen], *, timeout: float = 30.0) -> None:
    """Fixture teardown: SIGTERM every live process, wait for each, SIGKILL what is left."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


class Valkey:
    """A real valkey-server in `data_dir` on a loopback port (free unless given), started at
    construction and ready to serve; `extra` flags go after the defaults (later flags win)."""

    def __init__(self, data_dir: Path, *extra: str, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.extra = extra
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        args = server_args(data_dir=self.data_dir, port=self.port, daemonize=False)
        proc = subprocess.Popen([*args, *self.extra])
        wait_ready(self.url, timeout=30)
        return proc

    def restart(self) -> None:
        """Start the server again on the same port and data (after `kill`)."""
        self.proc = self._start()

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed beyond what the server had written."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server if it still runs (SIGTERM, then SIGKILL)."""
        stop_all([self.proc], timeout=10)
