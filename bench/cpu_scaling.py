"""Throughput of one queue served by 1, 2 and 4 consumer processes on CPU, side by side.

Each configuration gets its own queue on one throwaway valkey-server started here (as the test
suite does) and N fresh `python -m consumer` processes with the built-in tiny model. Once every
consumer reports ready, `--trials` timed batches run on those processes: submit `--jobs` jobs
of exactly `--tokens` tokens, wait until all are done. Configurations run in alternating order
over `--rounds` rounds. The table gives, per configuration, the best and the median trial, and
jobs/s as a ratio to one consumer.

    .venv/bin/python bench/cpu_scaling.py                        # 1, 2, 4 consumers
    .venv/bin/python bench/cpu_scaling.py --threads 1            # one torch thread each
    .venv/bin/python bench/cpu_scaling.py --consumers 1,2,4,8 --jobs 800 --rounds 3

Consumers only score (no top-k, samples or entropy), so results stay inline in Redis and the
numbers are the queue plus the forward, not object storage. Besides jobs/s (wall clock), the
table gives jobs per CPU-second used by the consumers (from /proc, Linux only). On a machine
shared with other work, each trial first waits (up to `--quiet-wait` seconds) for the 1-minute
load average to fall below `--quiet-load`; the load at the start of each trial is printed, and
the best trial is the one least disturbed.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_common import child_pythonpath  # noqa: E402 - repo on path
from producer.client import TeacherClient  # noqa: E402 - repo on path
from shared.log import configure_logging  # noqa: E402 - repo on path
from shared.messages import TeacherRequest  # noqa: E402 - repo on path
from shared.redis_server import free_port, server_args, wait_ready  # noqa: E402 - repo on path
from shared.settings import Settings, to_env  # noqa: E402 - repo on path

VOCAB = 1000  # the tiny preset's


@dataclass
class Trial:
    """One timed batch."""

    consumers: int
    round: int
    seconds: float
    cpu_seconds: float
    jobs: int
    load: float  # 1-minute load average when the trial started

    @property
    def jobs_per_s(self) -> float:
        """Jobs completed per second, submit to last result."""
        return self.jobs / self.seconds

    @property
    def jobs_per_cpu_s(self) -> float:
        """Jobs per CPU-second the consumers used meanwhile."""
        return self.jobs / self.cpu_seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--consumers", default="1,2,4", help="comma-separated process counts")
    p.add_argument("--jobs", type=int, default=400, help="jobs per trial")
    p.add_argument("--tokens", type=int, default=256, help="tokens per job (all equal)")
    p.add_argument(
        "--batch-max-jobs", type=int, default=8, help="TEACHERQ_CONSUMER__BATCH_MAX_JOBS"
    )
    p.add_argument("--rounds", type=int, default=2, help="repeats of every configuration")
    p.add_argument("--trials", type=int, default=3, help="timed batches per consumer start")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads per consumer (default: torch's)"
    )
    p.add_argument("--quiet-load", type=float, default=1.0, help="load average to wait for")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="longest wait for it, seconds")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one trial")
    args = p.parse_args(argv)
    args.consumer_counts = [int(x) for x in args.consumers.split(",")]
    if 1 not in args.consumer_counts:
        p.error("--consumers must include 1: ratios are relative to one consumer")
    return args


def _settings(redis_url: str, workdir: Path, args: argparse.Namespace) -> Settings:
    return Settings(
        redis={"url": redis_url, "home": str(workdir / "home")},
        queue={"name": f"bench-{uuid.uuid4().hex[:10]}"},
        storage={"url": f"file://{workdir / 'objects'}"},
        consumer={"device": "cpu", "batch_max_jobs": args.batch_max_jobs, "block_ms": 200},
        log={"format": "json", "level": "warning"},
    )


def _start_consumers(settings: Settings, n: int, workdir: Path, threads: int | None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEACHERQ_")}
    env.update(to_env(settings), PYTHONPATH=child_pythonpath())
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op pool size at start-up
    procs = []
    for i in range(n):
        log = open(workdir / f"{settings.queue.name}-{i}.log", "w")  # noqa: SIM115 - child's
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "consumer"],
                env=env,
                cwd=workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def _wait_ready(client: TeacherClient, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = [c.get("state") for c in client.consumers().values()]
        if sum(s in ("ready", "busy") for s in states) >= len(procs):
            return
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"consumers did not become ready: {states}")
        time.sleep(0.1)  # start-up only


def _wait_quiet(threshold: float, max_wait: float) -> float:
    """Wait until the 1-minute load average is below threshold (or max_wait passed)."""
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] >= threshold and time.monotonic() < deadline:
        time.sleep(2.0)  # the load average itself only moves every few seconds
    return os.getloadavg()[0]


def _cpu_seconds(procs: list[subprocess.Popen]) -> float:
    """User + system CPU time of the processes so far (Linux /proc; threads included)."""
    ticks = 0
    for p in procs:
        fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure(
    n: int, rnd: int, redis_url: str, workdir: Path, args: argparse.Namespace
) -> tuple[list[Trial], list[int]]:
    """Start n consumers on a fresh queue and time `args.trials` batches on them.

    Returns the trials and how many jobs each consumer did over all of them.
    """
    settings = _settings(redis_url, workdir, args)
    client = TeacherClient(settings)
    procs = _start_consumers(settings, n, workdir, args.threads)
    trials = []
    try:
        _wait_ready(client, procs, timeout=300)
        for t in range(args.trials):
            rng = np.random.default_rng([n, rnd, t])  # fresh ids: no job is a resubmission
            reqs = [
                TeacherRequest(input_ids=rng.integers(0, VOCAB, size=args.tokens))
                for _ in range(args.jobs)
            ]
            load = _wait_quiet(args.quiet_load, args.quiet_wait)
            cpu0, t0 = _cpu_seconds(procs), time.perf_counter()
            results = client.wait(client.submit(reqs), timeout=args.timeout)
            seconds = time.perf_counter() - t0
            cpu_seconds = _cpu_seconds(procs) - cpu0
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} jobs failed, e.g. {failed[0]}")
            trials.append(Trial(n, rnd, seconds, cpu_seconds, args.jobs, load))
    finally:
        _stop(procs)
    per_consumer = sorted((c["jobs_done"] for c in client.consumers().values()), reverse=True)
    client.close()
    return trials, per_consumer


def _report(
    args: argparse.Namespace,
    trials: dict[int, list[Trial]],
    spread: dict[tuple[int, int], list[int]],
) -> None:
    best = {n: max(ts, key=lambda t: t.jobs_per_s) for n, ts in trials.items()}
    median = {n: statistics.median(t.jobs_per_s for t in ts) for n, ts in trials.items()}
    print(
        f"{'consumers':>9} {'best jobs/s':>11} {'vs 1':>6} {'median':>7} {'vs 1':>6} "
        f"{'jobs/CPU-s':>10}  {'load':>5}  jobs per consumer (that round)"
    )
    for n in args.consumer_counts:
        b = best[n]
        print(
            f"{n:>9} {b.jobs_per_s:>11.1f} {b.jobs_per_s / best[1].jobs_per_s:>5.2f}x "
            f"{median[n]:>7.1f} {median[n] / median[1]:>5.2f}x {b.jobs_per_cpu_s:>10.1f}  "
            f"{b.load:>5.2f}  {spread[n, b.round]}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run every configuration and print the table."""
    args = parse_args(argv)
    # The client logs a span per submitted job at debug level; keep that out of the timing.
    configure_logging(level="warning", fmt="json")
    import torch

    trials: dict[int, list[Trial]] = {n: [] for n in args.consumer_counts}
    spread: dict[tuple[int, int], list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="tq-bench-") as tmp:
        workdir = Path(tmp)
        data = workdir / "valkey"
        data.mkdir()
        port = free_port()
        server = subprocess.Popen(server_args(data_dir=data, port=port, daemonize=False))
        redis_url = f"redis://127.0.0.1:{port}/0"
        try:
            wait_ready(redis_url)
            for rnd in range(args.rounds):
                # Alternate the order so that drift (thermal, page cache) hits all alike.
                order = args.consumer_counts if rnd % 2 == 0 else args.consumer_counts[::-1]
                for n in order:
                    done, spread[n, rnd] = measure(n, rnd, redis_url, workdir, args)
                    trials[n] += done
                    for t in done:
                        print(
                            f"round {rnd + 1}: {n} consumer(s): {t.jobs_per_s:7.1f} jobs/s "
                            f"({t.seconds:.2f} s), {t.jobs_per_cpu_s:6.1f} jobs/CPU-s, "
                            f"load {t.load:.2f}",
                            flush=True,
                        )
                    print(f"round {rnd + 1}: jobs per consumer {spread[n, rnd]}", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=10)

    threads = args.threads if args.threads is not None else torch.get_num_threads()
    print()
    print(
        f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {threads} torch thread(s) per consumer"
    )
    print(
        f"{args.jobs} jobs x {args.tokens} tokens per trial, batch_max_jobs {args.batch_max_jobs}, "
        f"{args.rounds} round(s) x {args.trials} trial(s) per configuration"
    )
    _report(args, trials, spread)
    return 0


if __name__ == "__main__":
    sys.exit(main())
