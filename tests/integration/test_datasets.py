"""Dataset jobs end to end on a real valkey-server, with real rq workers (`teacherq worker`) and
real consumer processes: ingest -> consume -> Parquet export, a worker killed mid-ingest, bad
rows, and replay of failed rq jobs and dead letters."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from producer import TeacherClient
from producer.datasets import (
    EXPORT_SCHEMA,
    RequestOptions,
    derive_dataset_id,
    load_record,
    normalize_location,
    replay_dataset,
    row_job_id,
    submit_dataset,
)
from shared import keys
from shared.settings import Settings, to_env
from shared.storage import ObjectStore
from tests.helpers import REPO
from tests.processes import run_cli, terminate
from tests.s3_server import S3Server, s3_bucket_fixture, s3_server_fixture  # noqa: F401
from tests.timing import scaled

pytestmark = pytest.mark.integration
VOCAB = 1000  # the tiny preset's
ARRAYS = [f.name for f in EXPORT_SCHEMA if pa.types.is_list(f.type)]
_DBS = itertools.count(1)


@pytest.fixture
def ds_settings(settings: Settings) -> Settings:
    """The test's settings on a Redis database of its own: rq's queues are global, so a job
    left behind by one test must not reach another test's worker."""
    db = next(_DBS)
    assert db < 16, "valkey has 16 databases"
    url = settings.redis.url.rsplit("/", 1)[0] + f"/{db}"
    redis.Redis.from_url(url).flushdb()
    return settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": url})})


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process, from /proc."""
    table: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                table[int(entry.name)] = (int(fields[1]), fields[0])
            except (OSError, IndexError, ValueError):
                continue
    return table


def _descendants(pid: int, table: dict[int, tuple[int, str]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _wait_until(pids: list[int], states: str, timeout: float = 10.0) -> None:
    """Wait until every pid is in one of `states` (or gone)."""
    deadline = time.monotonic() + timeout
    while any((st := _proc_table().get(pid)) is not None and st[1] not in states for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} did not reach state {states}"
        time.sleep(0.005)


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL a worker and everything it started: its rq work-horse (in a process group of
    its own) and its scheduler. Killing only the parent would leave the horse running the
    ingest to the end, which is no crash at all.

    Every process is frozen first, and its children are listed only once it is seen stopped:
    a parent caught inside fork() would otherwise create a horse after the listing, and that
    orphan would go on ingesting. Returns once every process is dead."""
    pids = [proc.pid]
    while True:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        _wait_until(pids, "TtZX")
        found = {proc.pid, *_descendants(proc.pid, _proc_table())}
        if found <= set(pids):
            break
        pids = sorted(set(pids) | found)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=scaled(10))
    _wait_until(pids, "ZX")  # orphans' zombies are init's to reap
    return pids


WorkerFactory = Callable[[Settings], subprocess.Popen]


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[WorkerFactory]:
    """Start `teacherq worker` processes for given settings; killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(settings: Settings) -> subprocess.Popen:
        env = {**os.environ, **to_env(settings), "PYTHONPATH": str(REPO)}
        log = open(tmp_path / f"worker-{len(procs)}.log", "w")  # noqa: SIM115 - the process keeps it
        proc = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "worker"],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]  # for failure messages
        procs.append(proc)
        return proc

    yield start
    for p in procs:
        if p.poll() is None:
            kill_tree(p)


def wait_state(
    client: TeacherClient,
    dataset_id: str,
    states: tuple[str, ...],
    *,
    timeout: float,
    workers: tuple[subprocess.Popen, ...] = (),
) -> Any:
    """Poll the dataset record until it reaches one of `states` (test helper)."""
    deadline = time.monotonic() + timeout
    while True:
        rec = load_record(client.r, client.queue, dataset_id)
        if rec is not None and rec.state in states:
            return rec
        if time.monotonic() > deadline:
            logs = "\n".join(w.log_path.read_text()[-3000:] for w in workers)  # type: ignore[attr-defined]
            raise TimeoutError(f"dataset still {rec.state if rec else None}: {rec}\n{logs}")
        time.sleep(0.1)


def _rows(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """Short rows, some with labels, per-row options and metadata."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(8, 25))
        row: dict[str, Any] = {"input_ids": rng.integers(0, VOCAB, size=length).tolist()}
        if i % 3 == 0:
            row["label_token_ids"] = rng.integers(0, VOCAB, size=(length - 1, 2)).tolist()
        if i % 5 == 0:
            row["top_k"] = 5
        if i % 7 == 0:
            row["sample_n"] = 2
            row["seed"] = i
        if i % 4 == 0:
            row["metadata"] = {"i": i}
        rows.append(row)
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _parquet_bytes(rows: list[dict[str, Any]], *, row_group_size: int) -> bytes:
    cols = {
        "input_ids": pa.array([r.get("input_ids") for r in rows], type=pa.list_(pa.int64())),
        "label_token_ids": pa.array(
            [r.get("label_token_ids") for r in rows], type=pa.list_(pa.list_(pa.int64()))
        ),
        "top_k": pa.array([r.get("top_k") for r in rows], type=pa.int64()),
        "sample_n": pa.array([r.get("sample_n") for r in rows], type=pa.int64()),
        "seed": pa.array([r.get("seed") for r in rows], type=pa.int64()),
        "temperature": pa.array([r.get("temperature") for r in rows], type=pa.float64()),
        "metadata": pa.array(
            [json.dumps(r["metadata"]) if "metadata" in r else None for r in rows], pa.string()
        ),
        "text": pa.array([f"row {i}" for i in range(len(rows))]),  # an unknown column
    }
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table(cols), buf, row_group_size=row_group_size)
    return buf.getvalue().to_pybytes()


def _read_export(store: ObjectStore) -> tuple[dict[str, Any], pa.Table]:
    manifest = json.loads(store.get("manifest.json"))
    tables = [
        pq.read_table(pa.BufferReader(store.get(s["path"], checksum=s["checksum"])))
        for s in manifest["shards"]
    ]
    return manifest, pa.concat_tables(tables)


def _assert_rows_equal_results(table: pa.Table, client: TeacherClient, dataset_id: str) -> None:
    """Every exported row equals TeacherClient.results for its job, exactly (arrays compared
    in the result's dtype: a float64 result exported as float32 would not pass)."""
    assert table.schema.equals(EXPORT_SCHEMA)
    job_ids = [row_job_id(dataset_id, i) for i in range(table.num_rows)]
    assert table.column("row_index").to_pylist() == list(range(table.num_rows))
    assert table.column("job_id").to_pylist() == job_ids
    # strict=False: rows refused at ingest were never submitted, so their ids are unknown.
    results = client.results(job_ids, strict=False)
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    for i, res in enumerate(results):
        if res is None:  # never submitted: refused at ingest
            assert cols["status"][i] == "rejected" and cols["error"][i], i
            assert all(cols[name][i] is None for name in ARRAYS)
            continue
        assert cols["status"][i] == ("ok" if res.ok else "failed")
        assert cols["error"][i] == res.error
        if not res.ok:
            continue
        assert cols["model_version"][i] == res.model_version
        assert json.loads(cols["metadata"][i]) == res.metadata
        for name in ARRAYS:
            want = getattr(res, name)
            got = cols[name][i]
            if want is None:
                assert got is None, (i, name)
                continue
            got_arr = np.array(got, dtype=want.dtype).reshape(want.shape)
            assert np.array_equal(got_arr, want), (i, name)


def test_2000_rows_ingest_consume_export_equals_results(
    ds_settings, start_consumer, start_worker, tmp_path
) -> None:
    settings = ds_settings
    rows = _rows(2000)
    src = tmp_path / "in.parquet"
    src.write_bytes(_parquet_bytes(rows, row_group_size=300))
    out = tmp_path / "out"
    start_consumer(settings)
    worker = start_worker(settings)
    args = [
        "submit-dataset",
        str(src),
        "--output",
        str(out),
        "--top-k",
        "3",
        "--return-entropy",
        "--temperature",
        "0.9",
        "--seed",
        "11",
        "--shard-rows",
        "700",
        "--keep-field",
        "text",
    ]
    sub = run_cli(settings, *args)
    assert sub.returncode == 0, sub.stderr
    dataset_id = sub.stdout.strip()
    options = RequestOptions(top_k=3, return_entropy=True, temperature=0.9, seed=11)
    want_id = derive_dataset_id(
        normalize_location(str(src)), queue=settings.queue.name, options=options
    )
    assert dataset_id == want_id
    client = TeacherClient(settings)
    rec = wait_state(client, dataset_id, ("done", "failed"), timeout=scaled(180), workers=(worker,))
    assert rec.state == "done", rec.error
    assert rec.total_rows == 2000 and rec.rows_queued == 2000 and rec.rows_rejected == 0

    manifest, table = _read_export(ObjectStore.from_url(str(out)))
    assert [s["rows"] for s in manifest["shards"]] == [700, 700, 600]
    assert manifest["rows"] == {"total": 2000, "ok": 2000, "failed": 0, "rejected": 0}
    assert manifest["failures"] == [] and manifest["ignored_fields"] == ["text"]
    assert manifest["model_versions"] == {"tiny-random-seed1234": 2000}
    assert manifest["timings"]["total_s"] > 0
    _assert_rows_equal_results(table, client, dataset_id)
    # Per-row values override the command's options; absent ones take them.
    topk = table.column("topk_token_ids").to_pylist()
    samples = table.column("sampled_token_ids").to_pylist()
    for i, row in enumerate(rows):
        assert len(topk[i][0]) == (5 if i % 5 == 0 else 3)
        assert (samples[i] is not None) == (i % 7 == 0)
        assert (table.column("label_logprobs")[i].as_py() is not None) == (i % 3 == 0)
        assert len(table.column("entropy")[i].as_py()) == len(row["input_ids"]) - 1

    listed = run_cli(settings, "datasets", "--json")
    assert listed.returncode == 0, listed.stderr
    [snap] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert snap["dataset_id"] == dataset_id and snap["state"] == "done"
    assert (snap["rows_queued"], snap["rows_done"], snap["rows_failed"]) == (2000, 2000, 0)

    # Submitting again is a no-op: same id, nothing enqueued twice.
    again = run_cli(settings, *args)
    assert again.returncode == 0 and again.stdout.strip() == dataset_id
    assert "already done" in again.stderr
    info = client.r.xinfo_stream(keys.jobs_stream(settings.queue.name))
    assert info["entries-added"] == 2000


def test_killed_worker_mid_ingest_resumes_without_duplicates_or_gaps(
    ds_settings, start_consumer, start_worker, tmp_path
) -> None:
    settings = ds_settings
    n = 2000
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, _rows(n, seed=1))
    start_consumer(settings)
    client = TeacherClient(settings)
    # A small backpressure bound paces the ingest by the consumer (about 6 rows in flight), and
    # short slices make it a chain of rq jobs: the kill lands in the middle of one.
    done = submit_dataset(
        client,
        input=str(src),
        output=str(tmp_path / "out"),
        batch_rows=8,
        max_pending_tokens=100,
        slice_s=2.0,
    )
    worker = start_worker(settings)
    deadline = time.monotonic() + scaled(60)
    while (rec := load_record(client.r, client.queue, done.dataset_id)).rows_queued < n // 5:
        assert time.monotonic() < deadline, worker.log_path.read_text()[-3000:]
        time.sleep(0.02)
    kill_tree(worker)
    time.sleep(1.0)
    at_kill = load_record(client.r, client.queue, done.dataset_id)
    assert at_kill.state == "ingesting"
    assert n // 5 <= at_kill.next_row < n, "the kill must land mid-ingest"
    time.sleep(1.0)  # nothing moves while no worker runs
    assert load_record(client.r, client.queue, done.dataset_id).next_row == at_kill.next_row
    # Submitting again while its rq job is still registered as started enqueues nothing (rq
    # retries that job) but takes new run settings: the rest goes in at full speed.
    again = submit_dataset(
        client, input=str(src), output=str(tmp_path / "out"), batch_rows=256, slice_s=2.0
    )
    assert (again.dataset_id, again.action) == (done.dataset_id, "running")

    t0 = time.monotonic()
    second = start_worker(settings)
    # rq finds the dead worker's job once its heartbeat expires and retries it. With rq's
    # defaults (heartbeat TTL + 60 s, maintenance every 10 min) this would take minutes.
    while load_record(client.r, client.queue, done.dataset_id).next_row == at_kill.next_row:
        assert time.monotonic() - t0 < scaled(60), second.log_path.read_text()[-3000:]
        time.sleep(0.1)
    rec = wait_state(
        client, done.dataset_id, ("done", "failed"), timeout=scaled(180), workers=(worker, second)
    )
    assert rec.state == "done", rec.error

    jobs = keys.jobs_stream(settings.queue.name)
    info = client.r.xinfo_stream(jobs)
    # Every XADD ever, trimmed or not (this consumer had no failures, so it re-queued nothing).
    assert info["entries-added"] == n, "a row was enqueued twice"
    if client.r.xlen(jobs) == n:  # untrimmed: check ids too
        ids = [f[b"job_id"].decode() for _, f in client.r.xrange(jobs)]
        assert sorted(ids) == sorted(row_job_id(done.dataset_id, i) for i in range(n))
    results = client.results([row_job_id(done.dataset_id, i) for i in range(n)])
    assert all(r is not None and r.ok for r in results), "a row has no result"
    manifest, table = _read_export(ObjectStore.from_url(str(tmp_path / "out")))
    assert manifest["rows"] == {"total": n, "ok": n, "failed": 0, "rejected": 0}
    _assert_rows_equal_results(table, client, done.dataset_id)
    assert client.streams.pending_tokens() == 0


def test_bad_rows_fail_alone_and_are_reported(
    ds_settings, start_consumer, start_worker, s3_server: S3Server, s3_bucket: str
) -> None:
    """Input and output on S3 (moto). Rows the request schema refuses are rejected at ingest;
    rows only the teacher can refuse (token ids outside its vocabulary, ingested before any
    consumer advertised it) are dead-lettered; the rest are exported."""
    storage = {
        "endpoint": s3_server.endpoint,
        "region": s3_server.region,
        "access_key_id": s3_server.access_key_id,
        "secret_access_key": s3_server.secret_access_key,
    }
    settings = ds_settings.model_copy(
        update={"storage": ds_settings.storage.model_copy(update=storage)}
    )
    rows = _rows(300, seed=2)
    bad = {
        5: ({"input_ids": []}, "input_ids is empty"),
        17: ({"input_ids": [1, 2, 3], "temperature": 0.0}, "temperature must be a finite number"),
        42: (
            {"input_ids": [1, 2, 3], "label_token_ids": [[1], [2], [3]]},
            "label_token_ids has 3 rows",
        ),
        77: ({"input_ids": [1, 2, 3], "top_k": -1}, "top_k must be >= 0"),
        99: ({"input_ids": [1, 2, 3], "seed": -4}, "seed must be in [0, 2**63)"),
    }
    poison = {120: [1, 2, VOCAB + 5], 250: [VOCAB * 3, 1]}
    for i, (row, _) in bad.items():
        rows[i] = row
    for i, ids in poison.items():
        rows[i] = {"input_ids": ids}
    bucket = ObjectStore.from_url(f"s3://{s3_bucket}", **storage)
    bucket.put("in/rows.parquet", _parquet_bytes(rows, row_group_size=64))
    client = TeacherClient(settings)
    worker = start_worker(settings)
    done = submit_dataset(
        client,
        input=f"s3://{s3_bucket}/in/rows.parquet",
        output=f"s3://{s3_bucket}/out/run1",
        keep_fields=("text",),
    )
    rec = wait_state(client, done.dataset_id, ("ingested",), timeout=scaled(60), workers=(worker,))
    assert rec.rows_rejected == len(bad) and rec.rows_queued == 300 - len(bad)
    start_consumer(settings)
    rec = wait_state(
        client, done.dataset_id, ("done", "failed"), timeout=scaled(120), workers=(worker,)
    )
    assert rec.state == "done", rec.error

    manifest, table = _read_export(ObjectStore.from_url(f"s3://{s3_bucket}/out/run1", **storage))
    assert manifest["rows"] == {
        "total": 300,
        "ok": 300 - len(bad) - len(poison),
        "failed": len(poison),
        "rejected": len(bad),
    }
    failures = {f["row_index"]: f for f in manifest["failures"]}
    assert sorted(failures) == sorted([*bad, *poison])
    for i, (_, why) in bad.items():
        assert failures[i]["stage"] == "ingest" and why in failures[i]["reason"], failures[i]
        assert failures[i]["job_id"] == row_job_id(done.dataset_id, i)
    for i in poison:
        assert failures[i]["stage"] == "teacher"
        assert "outside the vocabulary [0, 1000)" in failures[i]["reason"], failures[i]
    status = table.column("status").to_pylist()
    errors = table.column("error").to_pylist()
    for i in range(300):
        want = "rejected" if i in bad else "failed" if i in poison else "ok"
        assert status[i] == want, i
        assert (errors[i] is None) == (want == "ok")
    _assert_rows_equal_results(table, client, done.dataset_id)
    # Only the poison rows reached the dead-letter stream.
    dead = client.r.xrange(keys.dead_stream(settings.queue.name))
    assert sorted(f[b"job_id"].decode() for _, f in dead) == sorted(
        row_job_id(done.dataset_id, i) for i in poison
    )


@pytest.fixture(scope="module")
def big_vocab_checkpoint(hf_checkpoint) -> Path:
    return hf_checkpoint("qwen2", "qwen2-v2048", seed=3, vocab_size=2048)


def test_replay_requeues_failed_rq_jobs_and_dead_letters(
    ds_settings, start_consumer, start_worker, tmp_path, big_vocab_checkpoint
) -> None:
    settings = ds_settings
    rows = _rows(40, seed=3)
    poison = {7: [1, 1500, 3], 31: [1999, 4, 5, 6]}  # outside the tiny teacher's vocabulary
    for i, ids in poison.items():
        rows[i] = {"input_ids": ids}
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, rows)
    client = TeacherClient(settings)
    # Immediate retries keep the test short; the input vanishes before the worker starts.
    done = submit_dataset(
        client, input=str(src), output=str(tmp_path / "out"), retry_intervals=(0, 0, 0)
    )
    src.rename(tmp_path / "away.jsonl")
    worker = start_worker(settings)
    rec = wait_state(client, done.dataset_id, ("failed",), timeout=scaled(60), workers=(worker,))
    assert "FileNotFoundError" in rec.error
    from rq import Queue
    from rq.serializers import JSONSerializer

    from producer.datasets import INGEST_QUEUE

    failed = Queue(INGEST_QUEUE, connection=client.r, serializer=JSONSerializer)
    # rq runs the failure callback (which marked the dataset) just before filing the job.
    deadline = time.monotonic() + scaled(10)
    while not failed.failed_job_registry.get_job_ids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert failed.failed_job_registry.get_job_ids() == [rec.rq_job]

    (tmp_path / "away.jsonl").rename(src)  # the input is back
    summary = replay_dataset(client, done.dataset_id)
    assert summary["rq_jobs_requeued"] == [rec.rq_job] and summary["state"] == "ingesting"
    rec = wait_state(client, done.dataset_id, ("ingested",), timeout=scaled(60), workers=(worker,))
    assert failed.failed_job_registry.get_job_ids() == []

    tiny = start_consumer(settings)
    rec = wait_state(client, done.dataset_id, ("done",), timeout=scaled(120), workers=(worker,))
    manifest = json.loads(ObjectStore.from_url(str(tmp_path / "out")).get("manifest.json"))
    assert manifest["rows"]["failed"] == 2
    assert {f["row_index"] for f in manifest["failures"]} == set(poison)

    # A teacher with a larger vocabulary takes over; replaying the dead letters completes them.
    terminate(tiny)
    big = settings.model_copy(
        update={"model": settings.model.model_copy(update={"path": str(big_vocab_checkpoint)})}
    )
    start_consumer(big)
    summary = replay_dataset(client, done.dataset_id)
    assert summary["dead_letters"] == {"replayed": 2} and summary["state"] == "ingested"
    rec = wait_state(client, done.dataset_id, ("done",), timeout=scaled(120), workers=(worker,))
    manifest, table = _read_export(ObjectStore.from_url(str(tmp_path / "out")))
    assert manifest["rows"] == {"total": 40, "ok": 40, "failed": 0, "rejected": 0}
    versions = manifest["model_versions"]
    assert versions.pop("tiny-random-seed1234") == 38 and list(versions.values()) == [2]
    _assert_rows_equal_results(table, client, done.dataset_id)
    assert client.r.xlen(keys.dead_stream(settings.queue.name)) == 0
    # Replaying again finds nothing to do.
    again = replay_dataset(client, done.dataset_id)
    assert again["rq_jobs_requeued"] == [] and again["dead_letters"] == {}
    assert again["state"] == "done"


def test_dataset_replay_counts_replays_and_is_atomic(
    ds_settings, start_consumer, start_worker, tmp_path, redis_url
) -> None:
    """A dataset's dead letters are replayed through the queue's one replay path: every write
    of a job's replay (re-add, drop the failed record, remove the dead letter, clear the row's
    bits, count the replay) runs inside one script on the server, and a job replayed
    `queue.max_replays` times is skipped, its dead letter kept and the dataset left done."""
    from tests.redis_monitor import monitored

    settings = ds_settings.model_copy(
        update={"queue": ds_settings.queue.model_copy(update={"max_replays": 1})}
    )
    rows = _rows(6, seed=4)
    rows[2] = {"input_ids": [1, VOCAB + 7, 3]}  # outside the tiny teacher's vocabulary
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, rows)
    client = TeacherClient(settings)
    worker = start_worker(settings)
    done = submit_dataset(client, input=str(src), output=str(tmp_path / "out"))
    wait_state(client, done.dataset_id, ("ingested",), timeout=scaled(60), workers=(worker,))
    q, job_id = settings.queue.name, row_job_id(done.dataset_id, 2)
    for attempt in (1, 2):
        consumer = start_consumer(settings)
        wait_state(client, done.dataset_id, ("done",), timeout=scaled(120), workers=(worker,))
        terminate(consumer)
        [(_, dead)] = client.r.xrange(keys.dead_stream(q))
        assert dead[b"job_id"].decode() == job_id
        with monitored(redis_url) as commands:
            summary = replay_dataset(client, done.dataset_id)
        if attempt == 1:
            assert summary["dead_letters"] == {"replayed": 1} and summary["state"] == "ingested"
            assert client.r.xlen(keys.dead_stream(q)) == 0
            touching = [
                c
                for c in commands
                if c.name in ("XADD", "XDEL", "DEL", "SETBIT", "HINCRBY", "INCRBY", "SET")
                and (job_id in c.text or keys.dead_stream(q) in c.text)
            ]
            assert {c.name for c in touching} >= {"XADD", "XDEL", "DEL", "HINCRBY"}, touching
            assert all(c.from_script for c in touching), [c for c in touching if not c.from_script]
        else:
            assert summary["dead_letters"] == {"skipped_max_replays": 1}
            assert summary["state"] == "done" and client.r.xlen(keys.dead_stream(q)) == 1
        assert int(client.r.hget(keys.replays_key(q), job_id)) == 1


# A stop that lands in rq's start-up window: the worker is registered, its handlers are not in.
_STOPPED_WHILE_STARTING = """
import os, signal, sys
import redis
from rq import Queue
from rq.serializers import JSONSerializer
from producer.datasets.rq_plumbing import DatasetWorker

class SignalledWhileStarting(DatasetWorker):
    def register_birth(self, *args, **kwargs):
        super().register_birth(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

conn = redis.Redis.from_url(sys.argv[1])
queue = Queue(sys.argv[2], connection=conn, serializer=JSONSerializer)
worker = SignalledWhileStarting(
    [queue], connection=conn, serializer=JSONSerializer, name=sys.argv[3]
)
worker.work(logging_level="WARNING")
"""


def test_a_worker_stopped_while_starting_leaves_deregistered(redis_url: str) -> None:
    from rq import Worker

    name = f"early-stop-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.run(
        [sys.executable, "-c", _STOPPED_WHILE_STARTING, redis_url, f"{name}-queue", name],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=scaled(60),
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    conn = redis.Redis.from_url(redis_url)
    assert name not in [w.name for w in Worker.all(connection=conn)], "left registered"


# The same stop with rq's scheduler: it is forked inside the start-up window, so it inherits
# the worker's early-stop handler, and the worker stops it on its way out. The scheduler here
# waits until that SIGTERM has reached it before it starts (it says when it is ready, and the
# worker sends the signal only then): the race a loaded machine loses now and then, every time.
_SCHEDULER_STOPPED_WHILE_STARTING = """
import os, pathlib, signal, sys, time
import redis
import rq.scheduler
from rq import Queue
from rq.serializers import JSONSerializer
from producer.datasets.rq_plumbing import DatasetWorker

ready = pathlib.Path(sys.argv[4])
run_scheduler = rq.scheduler.run


def run_after_the_stop(scheduler):
    inherited = signal.getsignal(signal.SIGTERM)
    got = []

    def seen(signum, frame):
        got.append(signum)
        inherited(signum, frame)

    signal.signal(signal.SIGTERM, seen)
    ready.touch()
    deadline = time.monotonic() + float(sys.argv[5])
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    run_scheduler(scheduler)


rq.scheduler.run = run_after_the_stop


class SignalledWhileStarting(DatasetWorker):
    def register_birth(self, *args, **kwargs):
        super().register_birth(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    def stop_scheduler(self):
        deadline = time.monotonic() + float(sys.argv[5])
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        super().stop_scheduler()


conn = redis.Redis.from_url(sys.argv[1])
queue = Queue(sys.argv[2], connection=conn, serializer=JSONSerializer)
worker = SignalledWhileStarting(
    [queue], connection=conn, serializer=JSONSerializer, name=sys.argv[3]
)
worker.work(logging_level="WARNING", with_scheduler=True)
"""


def test_a_worker_stopped_while_starting_stops_its_scheduler_too(
    redis_url: str, tmp_path: Path
) -> None:
    """A stop in the start-up window with rq's scheduler (as `teacherq worker` runs it): the
    scheduler, forked with the worker's early-stop handler, gets the worker's SIGTERM before it
    installs its own handlers; it stops, and the worker exits 0, deregistered. (The signal was
    recorded on the worker's copy in the scheduler process: the scheduler ran on and the worker
    waited for it forever, as `teacherq worker` did on SIGTERM under load.)"""
    from rq import Worker

    name = f"early-stop-sched-{os.getpid()}-{time.monotonic_ns()}"
    wait_s = str(scaled(20))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCHEDULER_STOPPED_WHILE_STARTING, redis_url, f"{name}-queue"]
        + [name, str(tmp_path / "scheduler-ready"), wait_s],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the worker and its scheduler, killed together if stuck
    )
    try:
        out, _ = proc.communicate(timeout=scaled(60))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the worker did not exit: it waits for a scheduler that ignored its stop")
    assert proc.returncode == 0, out.decode()[-2000:]
    conn = redis.Redis.from_url(redis_url)
    assert name not in [w.name for w in Worker.all(connection=conn)], "left registered"


# A worker leaving (a burst run on an empty queue) whose pubsub thread reads the UNSUBSCRIBE
# reply before it is told to stop: UNSUBSCRIBE here returns only once that reply was read, the
# order a loaded machine gives now and then, here every time.
_PUBSUB_READ_FIRST = """
import sys, time
import redis
from redis.client import PubSub
from rq import Queue
from rq.serializers import JSONSerializer
from producer.datasets.rq_plumbing import DatasetWorker

send_unsubscribe = PubSub.unsubscribe


def unsubscribe_once_the_reply_is_read(self, *args):
    sent = send_unsubscribe(self, *args)
    deadline = time.monotonic() + 10
    while self.subscribed and time.monotonic() < deadline:
        time.sleep(0.01)
    return sent


PubSub.unsubscribe = unsubscribe_once_the_reply_is_read
conn = redis.Redis.from_url(sys.argv[1])
queue = Queue(sys.argv[2], connection=conn, serializer=JSONSerializer)
worker = DatasetWorker([queue], connection=conn, serializer=JSONSerializer, name=sys.argv[3])
worker.work(burst=True, logging_level="WARNING")
"""


def test_a_worker_leaves_at_once_when_its_pubsub_thread_read_the_unsubscribe_first(
    redis_url: str,
) -> None:
    """A leaving worker whose pubsub thread read the UNSUBSCRIBE reply before being told to
    stop exits at once, deregistered. (The thread went back to waiting up to 60 s for a
    subscription while the worker waited for it without a limit: `teacherq worker` took a
    minute to exit after SIGTERM.)"""
    from rq import Worker

    name = f"pubsub-first-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _PUBSUB_READ_FIRST, redis_url, f"{name}-queue", name],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        # The hang lasts rq's 60 s pubsub wait; a worker that leaves at once takes ~2 s.
        out, _ = proc.communicate(timeout=scaled(30))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the worker did not exit: it waits for its pubsub thread")
    assert proc.returncode == 0, out.decode()[-2000:]
    conn = redis.Redis.from_url(redis_url)
    assert name not in [w.name for w in Worker.all(connection=conn)], "left registered"
