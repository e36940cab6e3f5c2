"""Record the commands a real Redis executes (MONITOR), to prove what ran inside a script."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from tests.timing import scaled


@dataclass(frozen=True)
class Command:
    """One executed command: its name, its arguments joined as MONITOR prints them, and
    whether a Lua script ran it (`from_script`)."""

    name: str
    text: str
    from_script: bool


@contextlib.contextmanager
def monitored(url: str) -> Iterator[list[Command]]:
    """Collect every command the server at `url` executes inside the block (all clients,
    all databases), in the server's order. The list is complete when the block exits."""
    seen: list[Command] = []
    end = f"monitor-end-{uuid.uuid4().hex}"
    started = threading.Event()

    def run() -> None:
        with redis.Redis.from_url(url).monitor() as m:
            started.set()
            for cmd in m.listen():
                if end in cmd["command"]:
                    return
                name, _, _ = cmd["command"].partition(" ")
                seen.append(Command(name.upper(), cmd["command"], cmd["client_type"] == "lua"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10), "MONITOR did not start"
    try:
        yield seen
    finally:
        redis.Redis.from_url(url).echo(end)
        thread.join(timeout=scaled(30))
        assert not thread.is_alive(), "MONITOR did not see its end marker"
