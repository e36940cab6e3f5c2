"""Shared fixtures: a throwaway valkey-server per session, per-test queues and settings, and
consumer processes started for real (`python -m consumer`)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from shared.settings import Settings
from tests import isolation
from tests.helpers import wait_for_consumers
from tests.processes import Valkey, launch_consumer, stop_all
from tests.timing import scaled

OUTSIDE_READS = isolation.install()
DEFAULT_TEST_TIMEOUT_S = 600  # pytest-timeout's limit for a test that sets none, before scaling


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test's pytest-timeout limit (its own marker, or the default) is stretched by
    TEACHERQ_TEST_TIMEOUT_SCALE, like every other deadline (tests/timing.py)."""
    for item in items:
        marker = item.get_closest_marker("timeout")
        limit = marker.args[0] if marker is not None and marker.args else DEFAULT_TEST_TIMEOUT_S
        item.add_marker(pytest.mark.timeout(scaled(limit)))


@pytest.fixture(autouse=True)
def _reads_stay_inside_the_checkout() -> Iterator[None]:
    """Fail a test that opened a path beside the repository (`../shared`, a sibling checkout)
    or in the user's own teacherq state: a fresh clone has neither (tests/isolation.py)."""
    OUTSIDE_READS.take()
    yield
    opened = OUTSIDE_READS.take()
    if opened:
        pytest.fail(
            f"the test opened {len(opened)} path(s) outside the checkout and the temp dir: "
            + ", ".join(sorted(set(opened))[:5])
        )


@pytest.fixture(scope="session")
def layout():
    """A world-of-one parallel layout in the test process, megatron-core patched for CPU."""
    from consumer import cpu_compat
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    return init_parallel(tp=1, pp=1)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real valkey-server on a free loopback port in a temp dir, for the whole session."""
    server = Valkey(tmp_path_factory.mktemp("valkey"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _span_sink_restored() -> Iterator[None]:
    """A client built in a test installs a process-wide span sink (TeacherClient records its
    `submit` spans by default); put back the sink from before the test and close the test's,
    so no sink outlives the Redis it writes to."""
    from shared import tracing

    before = tracing.current_sink()
    yield
    if tracing.current_sink() is not before:
        installed = tracing.configure_sink(before)
        close = getattr(installed, "close", None)
        if close is not None:
            close()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Write a small random Hugging Face checkpoint (transformers' own save) once per session:
    `hf_checkpoint("qwen2", "teacher-a", seed=1, **config)` returns the same directory (named
    `name`: the served model version starts with it) for the same arguments, so modules that
    need the same teacher share it."""
    from transformers.utils import logging as hf_logging

    from consumer.checkpoints.synthetic import write_random_hf_checkpoint

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("hf-checkpoints")
    written: dict[tuple, Path] = {}

    def get(family: str, name: str, *, seed: int, **config: object) -> Path:
        key = (family, name, seed, repr(sorted(config.items())))  # values may be dicts
        if key not in written:
            assert not (root / name).exists(), f"{name} already names another checkpoint"
            written[key] = write_random_hf_checkpoint(root / name, family, seed=seed, **config)
        return written[key]

    return get


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    """A client of the session server."""
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def settings(redis_url: str, tmp_path: Path) -> Settings:
    """Settings for one test: its own queue name and object store directory."""
    return Settings(
        redis={"url": redis_url, "home": str(tmp_path / "home")},
        queue={"name": f"t{uuid.uuid4().hex[:10]}"},
        storage={"url": f"file://{tmp_path / 'objects'}"},
        consumer={"block_ms": 200},
        log={"format": "json"},
    )


ConsumerFactory = Callable[..., subprocess.Popen]


@pytest.fixture
def start_consumer(tmp_path: Path) -> Iterator[ConsumerFactory]:
    """Start real consumer processes for given settings; stops them at teardown."""
    procs: list[subprocess.Popen] = []

    def start(
        settings: Settings,
        *,
        extra_env: dict[str, str] | None = None,
        wait: bool = True,
        nproc: int = 1,
    ) -> subprocess.Popen:
        log = tmp_path / f"consumer-{len(procs)}.log"
        proc = launch_consumer(settings, tmp_path, log, extra_env=extra_env, nproc=nproc)
        procs.append(proc)
        if wait:
            wait_for_consumers(settings, count=1, proc=proc)
        return proc

    yield start
    stop_all(procs)


@pytest.fixture
def producer_sink(settings: Settings, r: redis.Redis) -> Iterator[Any]:
    """This test process records its spans (the producer's `submit`) to Redis (a
    `RedisSpanSink`)."""
    from shared import tracing
    from shared.trace_store import RedisSpanSink

    sink = RedisSpanSink(r, settings.queue.name)
    previous = tracing.configure_sink(sink, process="producer test")
    try:
        yield sink
    finally:
        tracing.configure_sink(previous)
        sink.close()
