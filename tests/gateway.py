"""`teacherq serve` and a consumer as real processes for tests, and a tiny JSON client."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer import TeacherClient, TeacherRequest
from shared.messages import TeacherResult
from shared.redis_server import free_port
from shared.settings import Settings, to_env
from tests.helpers import REPO, wait_for_consumers
from tests.processes import launch_consumer, stop_all
from tests.timing import scaled, wait_until


class Http:
    """A tiny JSON client of the gateway (one connection per call)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.headers: Any = None

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """(status, parsed JSON body or None when the body is empty)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=scaled(180))
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        headers = {
            **({"Content-Type": "application/json"} if data is not None else {}),
            **(headers or {}),
        }
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read()
        self.headers = resp.headers  # of the last response
        conn.close()
        return resp.status, json.loads(text) if text else None


def launch_gateway(
    settings: Settings, log_path: Path, *args: str, cwd: Path
) -> tuple[subprocess.Popen, Http]:
    """Start `python -m producer.cli serve` on a free port and wait until /healthz answers."""
    port = free_port()
    env = {**os.environ, **to_env(settings), "PYTHONPATH": str(REPO)}
    log = open(log_path, "w")  # noqa: SIM115 - kept open for the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "serve", "--port", str(port), *args],
        env=env,
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = Http(port)

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited {proc.returncode}:\n{log_path.read_text()}")
        try:
            return client.call("GET", "/healthz")[0] == 200
        except OSError:
            return False

    wait_until(up, "gateway answering /healthz", timeout=60)
    return proc, client


@dataclass
class Served:
    """A queue served by a real consumer and a real gateway, with the queue's own client."""

    settings: Settings
    http: Http
    client: TeacherClient

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return f"http://127.0.0.1:{self.http.port}"

    def reference(self, **fields: Any) -> TeacherResult:
        """The queue's own result for a request (submitted with TeacherClient)."""
        [res] = self.references([TeacherRequest(**fields)])
        return res

    def references(self, reqs: list[TeacherRequest]) -> list[TeacherResult]:
        """The queue's own results for requests, submitted together."""
        out = self.client.wait(self.client.submit(reqs), timeout=scaled(120))
        assert all(r.ok for r in out), [r.error for r in out if not r.ok]
        return out


@contextlib.contextmanager
def serve_queue(
    redis_url: str,
    tmp: Path,
    *,
    consumer: dict[str, Any] | None = None,
    queue: dict[str, Any] | None = None,
) -> Iterator[Served]:
    """A fresh queue on `redis_url` with one consumer process (the tiny preset; `consumer`,
    `queue`: more settings) and one gateway process, both stopped on exit."""
    s = Settings(
        redis={"url": redis_url, "home": str(tmp / "home")},
        queue={"name": f"t{uuid.uuid4().hex[:10]}", **(queue or {})},
        storage={"url": f"file://{tmp / 'objects'}"},
        consumer={"block_ms": 200, **(consumer or {})},
        log={"format": "json"},
    )
    proc = launch_consumer(s, tmp, tmp / "consumer.log")
    procs = [proc]
    try:
        wait_for_consumers(s, count=1, proc=proc)
        gateway, http = launch_gateway(s, tmp / "gateway.log", cwd=tmp)
        procs.append(gateway)
        yield Served(s, http, TeacherClient(s, trace_process=None))
    finally:
        stop_all(procs)
