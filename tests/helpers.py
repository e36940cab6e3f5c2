"""Helpers that test modules share: import them from here, never from conftest.py (which holds
only fixtures) or from another test module. Processes and servers are `tests/processes.py`'s,
numeric references `tests/reference.py`'s, the tracing consumer stand-in
`tests/trace_stand_in.py`'s.

Here: the repository root; waiting for consumers; fast-failing consumer settings, queues on a
cluster's shards, job sets and the exactly-once check of the fault tests; request mixes; CLI
error lines; head calls from flat keyword arguments; a client that makes the server forget its
scripts; how many of a file's pages the page cache holds, measured clear of the kernel's reclaim.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import redis

from producer import TeacherClient, TeacherRequest
from shared import keys
from shared.settings import Settings
from tests.timing import scaled

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
K = 3  # max deliveries of `fast` settings
TINY_VOCAB = 1000  # the tiny preset's vocabulary


# -- consumers ------------------------------------------------------------------------------


def wait_for_consumers(
    settings: Settings, *, count: int, proc=None, timeout: float = scaled(120)
) -> None:
    """Block until `count` consumers of the queue report ready (poll: start-up only)."""
    from producer.client import TeacherClient

    client = TeacherClient(settings)
    deadline = time.monotonic() + timeout
    while True:
        ready = [c for c in client.consumers().values() if c.get("state") in ("ready", "busy")]
        if len(ready) >= count:
            return
        if proc is not None and proc.poll() is not None:
            log = proc.log_path.read_text()[-3000:]
            raise RuntimeError(f"consumer exited with {proc.returncode}:\n{log}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(ready)} of {count} consumers ready")
        time.sleep(0.1)


def wait_consumer_state(client, state: str, timeout: float = scaled(30)) -> None:
    """Block until the queue's one consumer reports `state` in its heartbeat (poll)."""

    def current() -> str:
        [rec] = client.consumers().values()
        return rec["state"]

    deadline = time.monotonic() + timeout
    while current() != state:
        assert time.monotonic() < deadline, f"state stayed {current()}, wanted {state}"
        time.sleep(0.1)


# -- fault tests: settings, jobs, the exactly-once check --------------------------------------


def fast(settings: Settings, **consumer: object) -> Settings:
    """Settings with short timeouts so redelivery happens within seconds. The liveness and
    hang limits stretch with TEACHERQ_TEST_TIMEOUT_SCALE like every deadline, so a busy
    machine neither takes a slow live consumer for dead nor a slow batch for hung; a test's
    own keyword arguments are kept as given."""
    base = {
        "block_ms": 100,
        "visibility_timeout_s": scaled(2.0),
        "heartbeat_interval_s": 0.3,
        "dead_after_beats": math.ceil(scaled(3)),
        "job_timeout_s": scaled(3.0),
        "max_deliveries": K,
        "batch_max_jobs": 4,
        "token_budget": 64,
    }
    base.update(consumer)
    return settings.model_copy(update={"consumer": settings.consumer.model_copy(update=base)})


def queues_on_distinct_shards(n: int, prefix: str) -> list[str]:
    """n queue names whose hash tags fall in n different thirds of the slot space (one per
    primary as tests/processes.py's ValkeyCluster assigns them)."""
    from redis.crc import key_slot

    names: dict[int, str] = {}
    i = 0
    while len(names) < n:
        name = f"{prefix}{i}"
        third = key_slot(keys.jobs_stream(name).encode()) * 3 // 16384
        names.setdefault(third, name)
        i += 1
    return [names[t] for t in sorted(names)][:n]


def cluster_settings(url: str, queue: str, tmp_path: Path, **redis_extra: object) -> Settings:
    """Settings of a queue on a Valkey Cluster, writes acknowledged by one replica (unless
    `redis_extra` says otherwise), results under `tmp_path`, fast-failing consumers."""
    s = Settings(
        redis={
            "url": url,
            "mode": "cluster",
            "min_replicas_acked": 1,
            # a replica back after its primary was killed takes longer on a busy machine
            "replica_ack_timeout_s": scaled(10.0),
            **redis_extra,
        },
        queue={"name": queue},
        storage={"url": f"file://{tmp_path / 'objects'}"},
        consumer={"block_ms": 200},
        log={"format": "json"},
    )
    return fast(s, visibility_timeout_s=5.0, job_timeout_s=30.0)


def job_set(n: int = 12, seed: int = 0) -> list[TeacherRequest]:
    """`n` requests of 5-39 tokens with a mix of options, ids `job-<seed>-<i>`."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        length = int(rng.integers(5, 40))
        reqs.append(
            TeacherRequest(
                input_ids=rng.integers(0, 500, size=length),
                top_k=3 if i % 2 else 0,
                sample_n=2 if i % 3 == 0 else 0,
                return_entropy=i % 4 == 0,
                seed=i,
                job_id=f"job-{seed}-{i:03d}",
            )
        )
    return reqs


def assert_exactly_once(client: TeacherClient, ids: list[str], *, dead: set[str] = frozenset()):
    """Every job has one completion, nothing is pending, dead letters are exactly `dead`."""
    r, q = client.r, client.queue
    done = [f[b"job_id"].decode() for _, f in r.xrange(keys.done_stream(q))]
    assert sorted(done) == sorted(ids), "each job completes exactly once"
    assert r.xpending(keys.jobs_stream(q), client.settings.queue.group)["pending"] == 0
    dead_ids = {f[b"job_id"].decode() for _, f in r.xrange(keys.dead_stream(q))}
    assert dead_ids == set(dead)


# -- request mixes ----------------------------------------------------------------------------


def group_jobs(
    n: int, seed: int = 0, vocab: int = 1000, *, top_k: int = 4, prefix: str = "g"
) -> list[TeacherRequest]:
    """`n` requests of 4-29 random tokens, top-k and 2 samples each, ids `<prefix><seed>-<i>`."""
    rng = np.random.default_rng(seed)
    return [
        TeacherRequest(
            input_ids=rng.integers(0, vocab, size=int(rng.integers(4, 30))),
            top_k=top_k,
            sample_n=2,
            seed=i,
            job_id=f"{prefix}{seed}-{i:03d}",
        )
        for i in range(n)
    ]


def mixed_requests(rng: np.random.Generator, n: int) -> list[TeacherRequest]:
    """`n` requests over the tiny vocabulary, with every option and labels in turn."""
    reqs = []
    for i in range(n):
        length = int(rng.integers(5, 60))
        ids = rng.integers(0, TINY_VOCAB, size=length)
        reqs.append(
            TeacherRequest(
                input_ids=ids,
                label_token_ids=rng.integers(0, TINY_VOCAB, size=(length - 1, 3))
                if i % 2
                else None,
                top_k=5 if i % 3 == 0 else 0,
                sample_n=2 if i % 4 == 0 else 0,
                return_entropy=i % 2 == 0,
                temperature=[1.0, 0.7, 1.5][i % 3],
                seed=i,
                metadata={"i": i},
            )
        )
    return reqs


# -- CLI --------------------------------------------------------------------------------------


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The non-blank lines a CLI run wrote to stderr."""
    return [line for line in proc.stderr.splitlines() if line.strip()]


# -- head calls -------------------------------------------------------------------------------


def head(*, logits_TV: Any, **call: Any) -> Any:
    """`tp_ops.head_from_logits` with the `HeadCall` fields given as keyword arguments."""
    from consumer import tp_ops

    return tp_ops.head_from_logits(logits_TV=logits_TV, call=tp_ops.HeadCall(**call))


def chunked(*, hidden_TH: Any, weight_VH: Any, deferred: bool = False, **call: Any) -> Any:
    """`tp_ops.chunked_head` with the `HeadCall` fields given as keyword arguments."""
    from consumer import tp_ops

    return tp_ops.chunked_head(
        hidden_TH=hidden_TH, weight_VH=weight_VH, call=tp_ops.HeadCall(**call), deferred=deferred
    )


class ForgetsScripts(redis.Redis):
    """A client of the real server that makes the server forget its scripts (SCRIPT FLUSH)
    just before each of its next `forget` EVALSHA calls: what a caller meets when a failover
    or a restart falls between redis-py's SCRIPT LOAD and its EVALSHA (a sentinel client can
    reach the old and the new primary for a moment)."""

    forget = 0

    def evalsha(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        if self.forget > 0:
            self.forget -= 1
            self.script_flush()
        return super().evalsha(*args, **kwargs)


def cached_pages(path: Path, start: int, end: int) -> int:
    """How many pages of [start, end) the page cache holds, as mincore(2) reports them over a
    private map of the file: it reads nothing (a probe by read would start reading what it
    misses) and, unlike a one-byte RWF_NOWAIT read, is not turned away by a cached page the
    kernel holds locked or marks for read-ahead. (For a file the caller neither owns nor may
    write, the kernel answers "all cached": the tests ask about their own files.)"""
    page = mmap.PAGESIZE
    first, last = start - start % page, min(end, path.stat().st_size)
    if last <= first:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        view = ctypes.c_char.from_buffer(mapped)
        try:
            pages = -(-(last - first) // page)
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(ctypes.addressof(view) + first, last - first, vector) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
        finally:
            del view
    return sum(bit & 1 for bit in vector)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mincore.restype = ctypes.c_int


def evict_every_page(files: list[Path]) -> None:
    """Drop `files` from the page cache until mincore finds none of their pages there (under
    load the kernel may keep a page the first eviction asked it to drop: ask again)."""
    from consumer.checkpoints.page_cache import evict
    from tests.timing import wait_until

    wait_until(
        lambda: not (evict(files) or any(cached_pages(f, 0, f.stat().st_size) for f in files)),
        "the eviction to evict",
    )


def page_cache_reclaims() -> int:
    """Page-cache pages the kernel has taken back so far, machine-wide (/proc/vmstat's
    pgsteal_file): under memory pressure it takes pages a test has just read in, too."""
    with open("/proc/vmstat") as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name == "pgsteal_file":
                return int(value)
    return 0


def unreclaimed(measure: Callable[[], T], tries: int = 3) -> T:
    """`measure()`, run again (up to `tries` times) while the kernel reclaimed page-cache pages
    as it ran, so that a page-cache assertion on its result checks our code, not a busy
    machine's reclaim; the last result where no run was calm (the assertion then decides)."""
    for _ in range(tries):
        before = page_cache_reclaims()
        result = measure()
        if page_cache_reclaims() == before:
            break
    return result
