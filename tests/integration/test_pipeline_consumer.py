"""Pipeline parallelism (#24) with real consumer processes: a replica of two pipeline stages
(`torchrun --nproc-per-node=2`, pp=2, gloo) serves a Hugging Face checkpoint through the queue
as transformers scores it, applies a weight update, sleeps and wakes, drains on SIGTERM; and a
stage killed with SIGKILL mid-stream loses nothing: its replica's entries go to another
consumer."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from producer import TeacherClient, TeacherRequest
from shared import keys
from shared.settings import Settings
from tests.helpers import assert_exactly_once, fast, group_jobs, wait_consumer_state
from tests.processes import terminate
from tests.reference import hf_token_logprobs
from tests.timing import scaled

pytestmark = pytest.mark.integration
VOCAB = 300


@pytest.fixture(scope="module")
def teachers(hf_checkpoint):
    common = {"vocab_size": VOCAB, "num_layers": 3}
    return (
        hf_checkpoint("qwen2", "pp-teacher-a", seed=41, tie_embeddings=True, **common),
        hf_checkpoint("llama", "pp-teacher-b", seed=42, **common),
    )


def pipelined(settings: Settings, path: Path, pp: int = 2) -> Settings:
    return settings.model_copy(
        update={
            "model": settings.model.model_copy(update={"path": str(path)}),
            "parallel": settings.parallel.model_copy(update={"pp": pp}),
        }
    )


def jobs(n: int, seed: int) -> list[TeacherRequest]:
    return group_jobs(n, seed, VOCAB, top_k=3, prefix="pp")


def test_two_stages_serve_update_sleep_and_drain(settings, start_consumer, teachers) -> None:
    a, b = teachers
    s = pipelined(fast(settings, batch_max_jobs=6, sleep_after_idle_s=1.0), a)
    proc = start_consumer(s, nproc=2)
    client = TeacherClient(s)
    [rec] = client.consumers().values()
    assert rec["layout"] == "tp1·pp2·dp1", rec["layout"]
    wave1 = jobs(10, seed=1)
    for req, res in zip(wave1, client.wait(client.submit(wave1), timeout=scaled(120)), strict=True):
        assert res.ok, res.error
        assert res.model_version.startswith("pp-teacher-a@")
        np.testing.assert_allclose(res.logprobs, hf_token_logprobs(a, req.input_ids), atol=2e-3)
        assert res.sampled_token_ids.shape == (req.num_tokens - 1, 2)
    # Idle: both stages offload; a job wakes them.
    wait_consumer_state(client, "sleeping")
    # A weight update reaches every stage (each loads its own layers of the new teacher).
    client.update_weights(str(b), wait=True, timeout=scaled(120))
    wave2 = jobs(6, seed=2)
    for req, res in zip(wave2, client.wait(client.submit(wave2), timeout=scaled(120)), strict=True):
        assert res.ok and res.model_generation == 1, res.error
        np.testing.assert_allclose(res.logprobs, hf_token_logprobs(b, req.input_ids), atol=2e-3)
    assert_exactly_once(client, [r.job_id for r in wave1 + wave2])
    # SIGTERM drains: the leader finishes what it holds and stops both stages (torchrun's
    # launcher itself exits 1 whenever it is signalled, so the log tells the drain).
    terminate(proc, timeout=scaled(60))
    log = proc.log_path.read_text()
    assert log.count('"consumer.draining"') == 2 and '"consumer.stopped"' in log
    assert '"consumer.sleeping"' in log and '"consumer.awake"' in log
    assert_exactly_once(client, [r.job_id for r in wave1 + wave2])


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def test_a_stage_killed_mid_stream_loses_nothing(settings, start_consumer, teachers) -> None:
    a, _ = teachers
    s = pipelined(fast(settings, batch_max_jobs=2), a)
    client = TeacherClient(s)
    reqs = jobs(60, seed=3)
    ids = client.submit(reqs)
    launcher = start_consumer(s, nproc=2)
    deadline = time.monotonic() + scaled(60)
    while client.r.xlen(keys.done_stream(s.queue.name)) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    [last_stage] = [p for p in _children(launcher.pid) if _rank_of(p) == 1]
    os.kill(last_stage, signal.SIGKILL)  # the stage that runs the head, mid-stream
    launcher.wait(timeout=scaled(60))  # torchrun takes the replica's other rank down with it
    assert client.r.xlen(keys.done_stream(s.queue.name)) < len(ids), "killed before the end"
    # Another consumer (a single rank, pp=1) takes over what the dead replica held.
    start_consumer(pipelined(s, a, pp=1))
    results = client.wait(ids, timeout=scaled(180))
    for req, res in zip(reqs, results, strict=True):
        assert res.ok, res.error
        np.testing.assert_allclose(res.logprobs, hf_token_logprobs(a, req.input_ids), atol=2e-3)
    assert_exactly_once(client, ids)
