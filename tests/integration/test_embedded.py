"""The embedded default: one valkey-server per project or per user, shared by every local
process whatever its current directory, and the demo path on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from shared.redis_client import connect
from shared.redis_server import ensure_embedded, running_url, stop_embedded
from shared.settings import RedisSettings
from tests.helpers import REPO
from tests.processes import run_cli
from tests.timing import scaled

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
        outs = [json.loads(p.communicate(timeout=scaled(60))[0]) for p in procs]
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
    """Outside any project the demo uses the per-user home ($XDG_STATE_HOME/teacherq) and
    stops the server it started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEACHERQ_")} | {
        "PYTHONPATH": str(REPO),
        "TEACHERQ_LOG__FORMAT": "json",
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-m", "producer.cli", "demo", "--jobs", "12"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        assert "12 (0 failed)" in out.stdout
        assert "tokens/s" in out.stdout
    # The demo stopped the embedded server it started, in the per-user home.
    assert (tmp_path / "state" / "teacherq" / "server.json").exists()
    assert running_url(tmp_path / "state" / "teacherq") is None
    assert not (tmp_path / ".teacherq").exists()


def _cli(cwd: Path, state: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(None, *args, env={"XDG_STATE_HOME": str(state)}, cwd=cwd)


def test_one_server_per_project_whatever_the_directory(tmp_path: Path) -> None:
    """`redis url` starts nothing (exit 69); a server started from one subdirectory of a
    project is the one every other subdirectory finds (status included); outside any project
    the per-user home is used."""
    project, state = tmp_path / "proj", tmp_path / "state"
    (project / "a" / "deep").mkdir(parents=True)
    (project / "b").mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    home = project / ".teacherq"
    try:
        query = _cli(project / "b", state, "redis", "url")
        assert query.returncode == 69 and "redis start" in query.stderr
        assert not home.exists() and not state.exists()  # a query started nothing
        started = _cli(project / "a" / "deep", state, "redis", "start")
        assert started.returncode == 0, started.stderr
        url = started.stdout.strip()
        assert (home / "server.json").exists()
        again = _cli(project / "b", state, "redis", "url")
        assert again.returncode == 0 and again.stdout.strip() == url
        status = _cli(project / "b", state, "status", "--json")
        assert status.returncode == 0, status.stderr
        assert list(project.rglob("server.json")) == [home / "server.json"]
        outside = tmp_path / "elsewhere"
        outside.mkdir()
        user = _cli(outside, state, "redis", "url")
        assert user.returncode == 69 and str(state / "teacherq") in user.stderr
    finally:
        stop_embedded(home)


def test_client_finds_a_restarted_server_on_another_port(tmp_path: Path) -> None:
    """A client (as a consumer or rq worker holds) keeps working after `redis stop` and a
    restart: on the old port when free, and on a new one when that is taken."""
    import socket

    home = tmp_path / "home"
    client = connect(RedisSettings(home=home))
    try:
        client.set("k", "v")
        first = running_url(home)
        assert stop_embedded(home)
        assert ensure_embedded(home) == (first, True)  # same port again
        assert client.get("k") == b"v"
        assert stop_embedded(home)
        assert first is not None
        port = int(first.rsplit(":", 1)[1].split("/")[0])
        with socket.socket() as blocker:
            blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            blocker.bind(("127.0.0.1", port))
            blocker.listen()
            moved, started = ensure_embedded(home)
            assert started and moved != first
            assert client.get("k") == b"v"  # AOF kept it; the client re-read server.json
    finally:
        stop_embedded(home)
