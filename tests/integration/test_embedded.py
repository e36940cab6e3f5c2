"""The embedded default: one valkey-server under ./.teacherq/ shared by every local process,
and the demo path on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from shared.redis_server import ensure_embedded, stop_embedded
from tests.conftest import REPO

pytestmark = pytest.mark.integration

_ATTACH = (
    "import json, sys; from pathlib import Path; from shared.redis_server import ensure_embedded;"
    "print(json.dumps(ensure_embedded(Path(sys.argv[1]))))"
)


def test_second_process_attaches_instead_of_starting(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ATTACH, str(home)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    try:
        outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
        urls = {url for url, _ in outs}
        assert len(urls) == 1, outs
        assert sum(started for _, started in outs) == 1  # exactly one process started it
        client = redis.Redis.from_url(urls.pop())
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert (home / "valkey.pid").exists()
        assert ensure_embedded(home)[1] is False  # this process attaches too
    finally:
        assert stop_embedded(home)
    assert not stop_embedded(home)  # already stopped


def test_client_without_url_uses_embedded_server(tmp_path: Path) -> None:
    from producer import TeacherClient
    from shared.settings import Settings

    home = tmp_path / "home"
    settings = Settings(redis={"home": str(home)}, queue={"name": "emb"})
    try:
        client = TeacherClient(settings)
        [job] = client.submit([{"input_ids": [1, 2, 3]}])
        assert client.r.xlen("teacherq:{emb}:jobs") == 1
        assert job.startswith("j-")
    finally:
        stop_embedded(home)


def test_demo_runs_end_to_end_twice(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEACHERQ_")} | {
        "PYTHONPATH": str(REPO),
        "TEACHERQ_LOG__FORMAT": "json",
    }
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-m", "producer.cli", "demo", "--jobs", "12"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        assert "12 (0 failed)" in out.stdout
        assert "tokens/s" in out.stdout
    # The demo stopped the embedded server it started.
    assert not (tmp_path / ".teacherq" / "server.json").exists()
