"""A real S3 endpoint for tests: moto's server mode in a subprocess on a loopback port.

Import the fixtures into a test module (there is no shared conftest)::

    from tests.s3_server import S3Server, s3_bucket_fixture, s3_server_fixture  # noqa: F401

The fixture functions carry a ``_fixture`` suffix and register under the short names below, so
that test parameters named ``s3_server`` do not shadow the imports (ruff F811).

* ``s3_server`` (session): one moto process shared by every test in the session.
* ``s3_bucket`` (function): a fresh, uniquely named bucket on ``s3_server``.
* ``isolated_s3_server`` (function): a private moto process, for tests that stop and restart
  the server (its state is in memory, so a restart forgets every bucket and object).

Everything speaks plain HTTP to 127.0.0.1 with fixed dummy credentials; nothing leaves the
machine. ``S3Server.env()`` gives the ``AWS_*`` variables that point a client at the server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.redis_server import free_port
from tests.timing import scaled

ACCESS_KEY_ID = "testing"
SECRET_ACCESS_KEY = "testing"
REGION = "us-east-1"
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


class S3Server:
    """One moto S3 server process on a fixed loopback port; can be stopped and started again."""

    def __init__(self, port: int | None = None, *, log_dir: Path | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = port if port is not None else free_port()
        self.access_key_id = ACCESS_KEY_ID
        self.secret_access_key = SECRET_ACCESS_KEY
        self.region = REGION
        self._log_dir = log_dir or Path(tempfile.mkdtemp(prefix="moto-s3-"))
        self._log_path = self._log_dir / f"moto-{self.port}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The server's base URL, e.g. ``http://127.0.0.1:54321``."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        """``AWS_*`` environment variables that direct S3 clients (obstore, boto3) here."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",
        }

    def store_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``shared.storage.ObjectStore.from_url`` targeting this server."""
        return {
            "endpoint": self.endpoint,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "allow_http": True,
        }

    def client(self) -> Any:
        """A boto3 S3 client for this server (for setup and for checking what really landed)."""
        import boto3  # moto[server] depends on boto3; imported lazily to keep import cheap

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a unique name unless given) and return its name."""
        bucket = name or f"tq-{uuid.uuid4().hex[:20]}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def start(self) -> None:
        """Start moto on ``self.port`` and wait until it answers HTTP."""
        if self.running:
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["PYTHONUNBUFFERED"] = "1"
        # Log to a file, not a pipe: nobody drains a pipe and werkzeug logs every request.
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"moto server exited with code {self._proc.returncode} while starting on "
                    f"port {self.port}:\n{self.log_tail()}"
                )
            if self._answers():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(
            f"moto server did not answer on {self.endpoint} within {_START_TIMEOUT_S}s:\n"
            f"{self.log_tail()}"
        )

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=scaled(1.0)) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a grace period) and reap the process."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=_STOP_TIMEOUT_S)

    def restart(self) -> None:
        """Stop and start again on the same port; all buckets and objects are gone afterwards."""
        self.stop()
        self.start()

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server's log, for failure messages."""
        try:
            lines = self._log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


def start_s3_server(log_dir: Path | None = None, *, tries: int = 3) -> S3Server:
    """Start a moto server on a free port, retrying on a fresh port if the first one was taken."""
    last: RuntimeError | None = None
    for _ in range(tries):
        server = S3Server(log_dir=log_dir)
        try:
            server.start()
            return server
        except RuntimeError as exc:  # another process grabbed the port between probe and bind
            last = exc
    raise RuntimeError(f"could not start a moto S3 server after {tries} tries") from last


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto S3 server shared by the whole test session."""
    server = start_s3_server(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="s3_bucket")
def s3_bucket_fixture(s3_server: S3Server) -> str:
    """A new, empty bucket on the shared server."""
    if not s3_server.running:  # a test may have stopped the shared server; bring it back
        s3_server.start()
    return s3_server.create_bucket()


@pytest.fixture(name="isolated_s3_server")
def isolated_s3_server_fixture(tmp_path: Path) -> Iterator[S3Server]:
    """A private moto server for tests that stop, restart or otherwise break it."""
    server = start_s3_server(tmp_path)
    try:
        yield server
    finally:
        server.stop()
