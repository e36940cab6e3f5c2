"""Weight updates can never brick a queue (issue 20): bad paths are refused before anything is
committed, a checkpoint a consumer cannot load fails the update (recorded, shown, one line,
exit 1) while the consumer keeps serving, the next update goes through at once, consumers
started later serve the queue's weights and say why, and `--reset` returns every consumer to
its configured model. Real valkey-server, real consumer processes, the real CLI."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest

from producer import TeacherClient, TeacherRequest
from shared import exitcodes, keys
from shared.errors import InvalidCheckpoint, WeightUpdateFailed
from shared.weights import Served, start_choice
from tests.helpers import error_lines, fast, wait_for_consumers
from tests.processes import run_cli as cli
from tests.reference import hf_token_logprobs
from tests.timing import scaled

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, hf_checkpoint):
    """A good Qwen2 checkpoint, one whose config.json is cut in half, and one whose
    config.json parses but does not match its tensors (only a consumer can tell)."""
    root = tmp_path_factory.mktemp("ckpts")
    good = hf_checkpoint("qwen2", "teacher-a", seed=1)
    cut = root / "cut"
    shutil.copytree(good, cut)
    text = (cut / "config.json").read_text()
    (cut / "config.json").write_text(text[: len(text) // 2])
    mismatch = root / "mismatch"
    shutil.copytree(good, mismatch)
    config = json.loads((mismatch / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (mismatch / "config.json").write_text(json.dumps(config))
    return good, cut, mismatch


def _served_version(client: TeacherClient, input_ids: list[int], job_id: str) -> str:
    [res] = client.wait(
        client.submit([TeacherRequest(input_ids=input_ids, job_id=job_id)]), timeout=scaled(60)
    )
    assert res.ok, res.error
    return res.model_version


def test_bad_updates_never_brick_the_queue(settings, start_consumer, checkpoints) -> None:
    """The issue's reproduction, end to end, through the CLI."""
    good, cut, mismatch = checkpoints
    s = fast(settings)
    first = start_consumer(s)
    client = TeacherClient(s)
    [name] = client.consumers()
    tiny = _served_version(client, [1, 2, 3, 4], "before")
    assert tiny.startswith("tiny-random")

    # A path that does not exist, and a config.json cut in half: refused by the CLI in one
    # line, exit 2, nothing committed.
    for path, expect in ((str(good) + "-typo", "does not exist"), (str(cut), "config.json")):
        t0 = time.monotonic()
        proc = cli(s, "update-weights", path)
        assert proc.returncode == exitcodes.USAGE, proc.stderr
        assert expect in proc.stderr and len(error_lines(proc)) == 1
        assert time.monotonic() - t0 < scaled(30)
    assert "line" in cli(s, "update-weights", str(cut)).stderr
    assert not client.r.exists(keys.weights_key(s.queue.name))

    # Parses, but does not match its tensors: the consumer refuses it, keeps serving, and the
    # update fails within seconds naming the consumer and the reason.
    t0 = time.monotonic()
    proc = cli(s, "update-weights", str(mismatch))
    assert proc.returncode == exitcodes.FAILED, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < scaled(60)
    assert len(error_lines(proc)) == 1 and name in proc.stderr and "missing" in proc.stderr
    assert first.poll() is None
    assert _served_version(client, [1, 2, 3, 5], "after-failure") == tiny
    status = json.loads(cli(s, "status", "--json").stdout)
    w = status["weights"]
    assert (w["state"], w["failed_by"], w["path"]) == ("failed", name, str(mismatch))
    assert "missing" in w["error"] and w["active_path"] is None
    # Python side: the same failure is WeightUpdateFailed; a missing path InvalidCheckpoint.
    with pytest.raises(WeightUpdateFailed, match=name):
        client.update_weights(str(mismatch), timeout=scaled(60))
    with pytest.raises(InvalidCheckpoint):
        client.update_weights("/no/such/checkpoint")

    # The next update is accepted at once and served.
    proc = cli(s, "update-weights", str(good), "--timeout", "120")
    assert proc.returncode == 0, proc.stderr
    assert _served_version(client, [1, 2, 3, 6], "after-update").startswith("teacher-a@")

    # A consumer started now, without TEACHERQ_MODEL__PATH, serves the queue's weights and
    # logs which and why.
    second = start_consumer(s, wait=False)
    wait_for_consumers(s, count=2, proc=second)
    versions = {c["model_version"] for c in client.consumers().values()}
    assert all(v.startswith("teacher-a@") for v in versions), versions
    selected = [
        json.loads(line)
        for line in second.log_path.read_text().splitlines()
        if '"model.selected"' in line
    ]
    assert selected and selected[0]["source"] == "update-weights"
    assert selected[0]["path"] == str(good)

    # --reset: every consumer back to its configured model (the tiny preset here).
    proc = cli(s, "update-weights", "--reset", "--timeout", "120")
    assert proc.returncode == 0, proc.stderr
    deadline = time.monotonic() + scaled(60)
    while True:
        versions = {c["model_version"] for c in client.consumers().values()}
        if versions == {tiny}:
            break
        assert time.monotonic() < deadline, versions
        time.sleep(0.2)
    w = json.loads(cli(s, "status", "--json").stdout)["weights"]
    assert w["state"] == "done" and w["active_path"] is None


def test_start_choice_follows_the_documented_rule() -> None:
    """What a starting consumer loads: its settings with no update, the active weights after
    a done or failed update (never the failed path), the running update's path while one
    runs, and its settings again after a reset."""
    now = time.time()
    assert start_choice(Served(None, 0, "idle")).source == "settings"
    done = Served("/a", 2, "done", active_path="/a", active_generation=2)
    assert (start_choice(done).path, start_choice(done).source) == ("/a", "update-weights")
    failed = Served("/bad", 3, "failed", active_path="/a", active_generation=2, error="x")
    assert start_choice(failed).path == "/a" and start_choice(failed).generation == 2
    running = Served("/b", 4, "updating", active_path="/a", started_at=now)
    assert start_choice(running).path == "/b" and start_choice(running).trying_update
    stale = Served("/b", 4, "updating", active_path="/a", started_at=now - 4000)
    assert start_choice(stale).path == "/a"
    reset = Served("", 5, "done", active_path=None, active_generation=5)
    assert start_choice(reset).path is None and start_choice(reset).source == "settings"


def test_tp2_replica_updates_and_resets_together(settings, start_consumer, checkpoints) -> None:
    """A TP=2 replica: both ranks load the update (agreeing on the outcome), a checkpoint the
    leader refuses never reaches the follower, and --reset brings both ranks back."""
    good, _, mismatch = checkpoints
    s = fast(settings)
    s = s.model_copy(update={"parallel": s.parallel.model_copy(update={"tp": 2})})
    proc = start_consumer(s, nproc=2)
    client = TeacherClient(s)
    tiny = _served_version(client, [1, 2, 3, 4], "tp-before")
    with pytest.raises(WeightUpdateFailed):
        client.update_weights(str(mismatch), timeout=scaled(60))
    assert _served_version(client, [1, 2, 3, 5], "tp-after-failure") == tiny
    client.update_weights(str(good), timeout=scaled(120))
    ids = [1, 2, 3, 6, 9, 11]
    [res] = client.wait(
        client.submit([TeacherRequest(input_ids=ids, job_id="tp-up")]), timeout=scaled(60)
    )
    assert res.model_version.startswith("teacher-a@")
    # Both ranks hold the new weights: the sharded result equals Hugging Face's on one device.
    np.testing.assert_allclose(res.logprobs, hf_token_logprobs(good, np.array(ids)), atol=1e-4)
    client.reset_weights(timeout=scaled(120))
    assert _served_version(client, [1, 2, 3, 7], "tp-reset") == tiny
    assert proc.poll() is None


def test_consumer_starting_on_a_bad_pending_update_falls_back(
    settings, start_consumer, checkpoints
) -> None:
    """An update requested while no consumer ran, to weights no consumer can load: the first
    consumer to start tries it, records it as failed (reason, who) and serves its configured
    model instead of exiting; consumers started after it do not try it again."""
    from shared.weights import current, request_update

    _, _, mismatch = checkpoints
    s = fast(settings)
    request_update(TeacherClient(s).r, s.queue.name, str(mismatch))
    proc = start_consumer(s)
    client = TeacherClient(s)
    assert _served_version(client, [1, 2, 3, 4], "fallback").startswith("tiny-random")
    w = current(client.r, s.queue.name)
    assert w.state == "failed" and "(starting)" in (w.failed_by or "")
    assert "missing" in (w.error or "")
    log = proc.log_path.read_text()
    assert '"model.fallback"' in log and '"model.selected"' in log
    assert start_choice(w).path is None  # the next consumer starts on its settings


def test_an_update_one_replica_cannot_load_leaves_every_replica_on_the_old_weights(
    settings, start_consumer, tmp_path
) -> None:
    """Two replicas of different layouts: a checkpoint with one KV head loads at TP=1 but not
    at TP=2. The TP=2 replica refuses it, the update fails naming that replica, and the TP=1
    replica ends on the old weights too (it skips the update, or reverts if it had loaded it
    first): the queue never serves two models after a failed update."""
    from consumer.checkpoints.synthetic import write_random_hf_checkpoint

    one_kv = write_random_hf_checkpoint(tmp_path / "one-kv", "qwen2", seed=5, num_kv_heads=1)
    s = fast(settings)
    single = start_consumer(s)
    s2 = s.model_copy(update={"parallel": s.parallel.model_copy(update={"tp": 2})})
    pair = start_consumer(s2, nproc=2, wait=False)
    wait_for_consumers(s, count=2, proc=pair)
    client = TeacherClient(s)
    tiny = _served_version(client, [1, 2, 3, 4], "two-before")
    with pytest.raises(WeightUpdateFailed, match="num_key_value_heads=1") as info:
        client.update_weights(str(one_kv), timeout=scaled(120))
    assert info.value.consumer in client.consumers()
    deadline = time.monotonic() + scaled(60)
    # Every replica on the old weights and none still loading the failed update.
    while any(
        c["model_version"] != tiny or c["state"] == "updating" for c in client.consumers().values()
    ):
        assert time.monotonic() < deadline, client.consumers()
        time.sleep(0.2)
    versions = {_served_version(client, [1, 2, 3, n], f"two-after-{n}") for n in range(5, 11)}
    assert versions == {tiny}
    assert single.poll() is None and pair.poll() is None


def test_a_replica_that_applied_an_update_failed_elsewhere_reverts(
    settings, start_consumer, checkpoints
) -> None:
    """A replica loads an update while another live replica (here a heartbeat the test keeps
    fresh) has not; when that one reports failure, the first goes back to the weights before
    the update, so the queue never serves two models after a failed update."""
    import threading

    from shared.weights import current, fail_update, wait_done

    good, _, _ = checkpoints
    s = fast(settings)
    proc = start_consumer(s)
    client = TeacherClient(s)
    tiny = _served_version(client, [1, 2, 3, 4], "rev-before")
    stop = threading.Event()

    def phantom() -> None:  # a live consumer that never acknowledges
        r = TeacherClient(s).r
        while not stop.is_set():
            rec = {"time": time.time(), "state": "ready"}
            r.hset(keys.consumers_key(s.queue.name), "phantom", json.dumps(rec))
            time.sleep(0.1)

    t = threading.Thread(target=phantom, daemon=True)
    t.start()
    try:
        req = client.update_weights(str(good), wait=False)
        deadline = time.monotonic() + scaled(60)
        while not _served_version(client, [1, 2, 3, 5], f"rev-{time.monotonic()}").startswith(
            "teacher-a@"
        ):
            assert time.monotonic() < deadline
        assert current(client.r, s.queue.name).state == "updating"  # phantom has not acked
        assert fail_update(
            client.r,
            s.queue.name,
            generation=req.generation,
            replica="phantom",
            reason="out of memory",
        )
        with pytest.raises(WeightUpdateFailed, match="phantom.*out of memory"):
            wait_done(client.r, s.queue.name, req.generation, timeout_s=5)
        deadline = time.monotonic() + scaled(60)
        while _served_version(client, [1, 2, 3, 6], f"rev-{time.monotonic()}") != tiny:
            assert time.monotonic() < deadline
    finally:
        stop.set()
        t.join()
    assert '"weights.revert"' in proc.log_path.read_text()
