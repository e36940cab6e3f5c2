"""`teacherq demo`: the whole pipeline on the embedded defaults, start to finish.

Starts (or attaches to) the embedded Redis, starts one consumer process, submits a few dozen
random jobs of varied lengths and options, waits for every result, reports, and stops what it
started. Safe to run repeatedly: job ids are fresh each run.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from producer.client import TeacherClient
from shared.messages import TeacherRequest
from shared.redis_server import ensure_embedded, stop_embedded
from shared.settings import Settings
from shared.trace_store import install_sink


@dataclass
class DemoReport:
    """What the demo did, for printing."""

    jobs: int
    tokens: int
    seconds: float
    failed: int
    redis_url: str
    storage_url: str
    sample_job: str
    model_version: str
    consumer_log: str

    @property
    def tokens_per_s(self) -> float:
        """Throughput over the whole wait."""
        return self.tokens / self.seconds if self.seconds else 0.0


def random_requests(n: int, *, vocab: int, seed: int, run: str) -> list[TeacherRequest]:
    """n requests of varied lengths; some ask for labels, top-k, samples and entropy."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(8, 200))
        ids = rng.integers(0, vocab, size=length)
        opts: dict = {}
        if i % 3 == 0:
            opts["label_token_ids"] = rng.integers(0, vocab, size=(length - 1, 4))
        if i % 4 == 0:
            opts.update(top_k=8, return_entropy=True)
        if i % 5 == 0:
            opts.update(sample_n=4, seed=i, temperature=0.8)
        out.append(TeacherRequest(input_ids=ids, job_id=f"demo-{run}-{i:03d}", **opts))
    return out


def _wait_for_consumer(client: TeacherClient, proc: subprocess.Popen, *, timeout: float) -> None:
    # Start-up is a one-off wait on a model load, not queue work: a short poll is fine here.
    deadline = time.monotonic() + timeout
    while not client.consumers_ready():
        if proc.poll() is not None:
            raise RuntimeError(f"the consumer exited with code {proc.returncode} during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError("no consumer became ready")
        time.sleep(0.2)


def run_demo(settings: Settings, *, jobs: int = 40, timeout: float = 300.0) -> DemoReport:
    """Run the demo end to end and return its report; raises if anything fails."""
    started_redis = False
    env = dict(os.environ)
    if settings.redis.url is None:
        url, started_redis = ensure_embedded(Path(settings.redis.home))
        env["TEACHERQ_REDIS__URL"] = url
    else:
        url = settings.redis.url
    log_path = Path(settings.redis.home) / "demo-consumer.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:  # the consumer's JSON logs, kept off the terminal
        consumer = subprocess.Popen(
            [sys.executable, "-m", "consumer"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        redis_cfg = settings.redis.model_copy(update={"url": url})
        client = TeacherClient(settings.model_copy(update={"redis": redis_cfg}), trace_process=None)
        # Record the demo's submit spans too, so `teacherq trace JOB_ID` shows whole trees.
        q = settings.queue
        sink = install_sink(
            client.r,
            q.name,
            process="teacherq demo",
            ttl_s=q.trace_ttl_s,
            sample_rate=q.trace_sample_rate,
        )
        _wait_for_consumer(client, consumer, timeout=timeout)
        run = secrets.token_hex(3)
        vocab = client.limits().vocab_size or 1000
        requests = random_requests(jobs, vocab=vocab, seed=int(time.time()), run=run)
        t0 = time.perf_counter()
        ids = client.submit(requests)
        results = client.wait(ids, timeout=timeout)
        seconds = time.perf_counter() - t0
        sink.close()
        failed = [r for r in results if not r.ok]
        return DemoReport(
            jobs=len(results),
            tokens=sum(r.num_tokens for r in requests),
            seconds=seconds,
            failed=len(failed),
            redis_url=url,
            storage_url=settings.storage.url,
            sample_job=ids[0],
            model_version=results[0].model_version,
            consumer_log=str(log_path),
        )
    finally:
        consumer.send_signal(signal.SIGTERM)
        try:
            consumer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            consumer.kill()
        if started_redis:
            stop_embedded(Path(settings.redis.home))
