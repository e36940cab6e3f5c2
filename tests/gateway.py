"""Starting `teacherq serve` as a real process for tests, and a tiny JSON client of it."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from shared.redis_server import free_port
from shared.settings import Settings, to_env
from tests.conftest import REPO
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
