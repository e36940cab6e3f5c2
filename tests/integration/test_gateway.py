"""`teacherq serve` as a real process answering real HTTP requests (http.client) in the API of
slime's Megatron teacher server, over a real valkey-server and real consumer processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from producer import TeacherClient
from shared import keys
from shared.settings import Settings, to_env
from shared.trace_store import TraceStore
from shared.weights import request_update
from tests.gateway import Http, launch_gateway
from tests.helpers import REPO, fast
from tests.reference import hf_token_logprobs, tiny_full_log_softmax
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.integration

TRAINER_TRACE, TRAINER_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


GatewayFactory = Callable[..., Http]


def _job_spans(s: Settings, job_id: str, names: set[str]) -> dict[str, dict[str, Any]]:
    """A job's spans by name, once those named are recorded (within 10 s)."""
    store = TraceStore(TeacherClient(s).r, s.queue.name)
    deadline = time.monotonic() + scaled(10)
    while True:
        spans = {x["name"]: x for x in store.job_spans(job_id)}
        if names <= set(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[GatewayFactory]:
    """Start `python -m producer.cli serve` for given settings; SIGTERM at teardown."""
    procs: list[subprocess.Popen] = []

    def start(settings: Settings, *args: str) -> Http:
        proc, client = launch_gateway(
            settings, tmp_path / f"gateway-{len(procs)}.log", *args, cwd=tmp_path
        )
        procs.append(proc)
        client.proc = proc  # type: ignore[attr-defined]  # for tests that signal it
        return client

    yield start
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            assert p.wait(timeout=scaled(20)) == 0, "the gateway should exit cleanly on SIGTERM"
        except subprocess.TimeoutExpired:
            p.kill()
            raise


def _results_named(settings: Settings, prefix: str) -> list[str]:
    client = TeacherClient(settings)
    pattern = keys.result_key(settings.queue.name, prefix + "*")
    return [k.decode().rsplit(":", 1)[-1] for k in client.r.scan_iter(match=pattern)]


def test_generate_errors_loads_and_disconnect(settings, start_consumer, start_gateway) -> None:
    """The slime API end to end: 400 for a missing or invalid field, 413 with both lengths,
    404 for another route; a client that disconnects cancels its job; /generate answers
    slime's fields (L-1 rows) at the gateway's default temperature or a request's own, with
    `sample_n` as a numeric string and teacherq's own fields; /get_loads, /healthz, /info."""
    s = settings.model_copy(
        update={"gateway": settings.gateway.model_copy(update={"max_length": 64})}
    )
    gw = start_gateway(s, "--temperature", "0.7")
    for body, want in (
        ({"sample_n": 1}, "missing input_ids"),
        ({"input_ids": 5}, "input_ids must be a list"),
        ({"input_ids": [1, 2, 3], "sample_n": "two"}, "sample_n must be an integer"),
        ({"input_ids": [1, 2, 3], "sample_n": True}, "sample_n must be an integer"),
        ({"input_ids": [1, 2, 3], "sample_n": -1}, "sample_n must be >= 0"),
        ({"input_ids": [1, 2, 3], "label_token_ids": [[1], [2], [3]]}, "len(input_ids) - 1"),
        ({"input_ids": [1, 2, 3], "label_token_ids": [[1, 2], [3]]}, "ragged"),
        ({"input_ids": [1]}, "at least 2"),
        ({"input_ids": [1, 2, 3], "top_k": 10_000}, "top_k is 10000"),
    ):
        status, out = gw.call("POST", "/generate", body)
        assert status == 400 and want in out["error"], (body, status, out)
    status, out = gw.call("POST", "/generate", raw=b"{not json")
    assert status == 400 and "not valid JSON" in out["error"]
    status, out = gw.call("POST", "/generate", {"input_ids": list(range(65))})
    assert status == 413 and out["input_length"] == 65 and out["max_length"] == 64
    assert gw.call("GET", "/nope")[0] == 404

    # A client that goes away (no consumer yet, so the job waits) cancels its job.
    sock = socket.create_connection(("127.0.0.1", gw.port))
    body = json.dumps({"input_ids": [7, 7, 7]}).encode()
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    client = TeacherClient(s)
    wait_until(lambda: client.status()["queued"] >= 1, "the request submitted", timeout=30)
    assert not _results_named(s, "gw-")
    sock.close()
    deadline = time.monotonic() + scaled(10)
    while not _results_named(s, "gw-") and time.monotonic() < deadline:
        time.sleep(0.1)
    [gone] = _results_named(s, "gw-")
    [res] = TeacherClient(s).results([gone])
    assert res is not None and res.error == "cancelled by the user"

    status, loads = gw.call("GET", "/get_loads")
    assert status == 200 and loads["consumers"] == 0 and loads["queue_size"] == 1
    start_consumer(s)
    ids = np.array([3, 14, 15, 92, 65, 35, 89, 79])
    labels = np.stack([ids[1:], (ids[1:] + 1) % 1000], axis=1)
    status, out = gw.call(
        "POST",
        "/generate",
        {
            "input_ids": ids.tolist(),
            "label_token_ids": labels.tolist(),
            "sample_n": "3",
            "sampling_params": {"max_new_tokens": 0},
        },  # slime callers' extra fields are ignored
    )
    assert status == 200, out
    ref = tiny_full_log_softmax(ids, 0.7)
    rows = np.arange(len(ids) - 1)
    np.testing.assert_allclose(out["log_probs"], ref[rows, ids[1:]], atol=2e-4)
    np.testing.assert_allclose(
        out["label_token_log_probs"], np.take_along_axis(ref, labels, axis=1), atol=2e-4
    )
    sampled = np.array(out["sampled_token_ids"])
    assert sampled.shape == (len(ids) - 1, 3)
    np.testing.assert_allclose(
        out["sampled_log_probs"], np.take_along_axis(ref, sampled, axis=1), atol=2e-4
    )
    assert out["request_id"].startswith("gw-") and "topk_token_ids" not in out
    # Without a traceparent of its own, the caller still learns the job's trace: the response
    # names the request's span, which parents the job's spans.
    _, trace_id, request_span, _ = gw.headers["traceparent"].split("-")
    spans = _job_spans(s, out["request_id"], {"generate", "submit"})
    assert spans["generate"]["trace_id"] == spans["submit"]["trace_id"] == trace_id
    assert spans["generate"]["span_id"] == request_span
    assert spans["submit"]["parent_span_id"] == request_span

    status, own = gw.call(
        "POST",
        "/generate",
        {
            "input_ids": ids.tolist(),
            "temperature": 1.3,
            "top_k": 4,
            "return_entropy": True,
            "seed": 5,
            "job_id": "mine",
        },
        headers={"traceparent": f"00-{TRAINER_TRACE}-{TRAINER_SPAN}-01"},
    )
    assert status == 200 and own["request_id"] == "mine"
    # The caller's W3C traceparent header parents the request's span, which parents the job's
    # spans (recorded by the gateway and the consumer in Redis, for `teacherq trace`); the
    # response's traceparent names the request's span.
    spans = _job_spans(s, "mine", {"generate", "submit", "forward"})
    assert spans["generate"]["trace_id"] == spans["submit"]["trace_id"] == TRAINER_TRACE
    assert spans["generate"]["parent_span_id"] == TRAINER_SPAN
    assert spans["submit"]["parent_span_id"] == spans["generate"]["span_id"]
    assert spans["submit"]["process"] == "teacherq gateway"
    assert spans["forward"]["parent_span_id"] == spans["submit"]["span_id"]
    assert gw.headers["traceparent"] == f"00-{TRAINER_TRACE}-{spans['generate']['span_id']}-01"
    ref = tiny_full_log_softmax(ids, 1.3)
    np.testing.assert_allclose(own["log_probs"], ref[rows, ids[1:]], atol=2e-4)
    np.testing.assert_allclose(
        own["topk_logprobs"], np.sort(ref, axis=1)[:, ::-1][:, :4], atol=2e-4
    )
    assert len(own["entropy"]) == len(ids) - 1 and "sampled_token_ids" not in own

    status, loads = gw.call("GET", "/get_loads")
    assert status == 200 and loads["consumers"] == 1 and loads["queue_size"] == 0
    assert loads["inflight_size"] == 0 and loads["total_finished_reqs"] >= 3
    status, health = gw.call("GET", "/healthz")
    assert status == 200 and health["ok"] and health["consumers_ready"]
    status, info = gw.call("GET", "/info")
    assert status == 200 and info["args"]["rollout_temperature"] == 0.7
    assert info["model"]["vocab_size"] == 1000 and info["model"]["generation"] == 0


@pytest.fixture
def teachers(hf_checkpoint):
    """Two different random qwen2 teachers (the session's, shared with test_groups)."""
    return hf_checkpoint("qwen2", "teacher-a", seed=1), hf_checkpoint("qwen2", "teacher-b", seed=2)


def test_update_weights_from_disk(settings, start_consumer, start_gateway, teachers) -> None:
    """slime's update semantics on the queue's weight path: the path the consumers serve is
    skipped (their heartbeats say so: the gateway's own TEACHERQ_MODEL__PATH is unset here),
    another path while one is in progress gets 409, the same path coalesces, and after the
    update /generate is computed by the new weights (the same tokens too) and /info's
    args.load names them."""
    a, b = teachers
    s = fast(settings).model_copy(
        update={"model": settings.model.model_copy(update={"path": str(a)})}
    )
    start_consumer(s)
    gw = start_gateway(fast(settings))  # knows nothing of A: what is served comes from Redis
    status, info = gw.call("GET", "/info")
    assert info["args"]["load"] == str(a), info
    ids = [5, 6, 7, 8, 9]
    status, before = gw.call("POST", "/generate", {"input_ids": ids})
    assert status == 200 and before["model_generation"] == 0
    np.testing.assert_allclose(before["log_probs"], hf_token_logprobs(a, np.array(ids)), atol=1e-4)

    assert gw.call("POST", "/update_weights_from_disk", {})[0] == 400
    # Checked where the gateway runs before anything is committed (as `update-weights`).
    status, out = gw.call("POST", "/update_weights_from_disk", {"model_path": "/no/such/ckpt"})
    assert status == 400 and "/no/such/ckpt" in out["error"], out
    status, out = gw.call("POST", "/update_weights_from_disk", {"model_path": str(a)})
    assert status == 200 and out == {"ok": True, "model_path": str(a), "skipped": True}

    # Another trainer starts an update to B: a request for A is refused, one for B joins it.
    started = request_update(TeacherClient(s).r, s.queue.name, str(b))
    status, out = gw.call("POST", "/update_weights_from_disk", {"model_path": str(a)})
    assert status == 409 and "teacher-b" in out["error"]
    status, out = gw.call("POST", "/update_weights_from_disk", {"path": str(b)})
    assert status == 200 and out["ok"], out
    # An in-place load takes tens of milliseconds: on a busy machine the update to B can be
    # done before this call arrives. B is then served and the call skipped, never run again
    # (generation 1 below).
    if not out.get("skipped"):
        assert out["coalesced"] is True, out
        assert out["update_result"]["generation"] == started.generation == 1

    status, after = gw.call("POST", "/generate", {"input_ids": ids})
    assert status == 200 and after["model_generation"] == 1
    np.testing.assert_allclose(after["log_probs"], hf_token_logprobs(b, np.array(ids)), atol=1e-4)
    status, out = gw.call("POST", "/update_weights_from_disk", {"load": str(b)})
    assert status == 200 and out["skipped"] is True
    status, info = gw.call("GET", "/info")
    assert info["args"]["load"] == str(b) and info["model"]["generation"] == 1


def test_serve_on_a_taken_port_is_one_line_and_exit_2(settings) -> None:
    """A port another process holds: `teacherq serve` says so in one line naming the settings
    to change, and exits 2 (bad input) without starting anything."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    env = {**os.environ, **to_env(settings), "PYTHONPATH": str(REPO)}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "producer.cli", "serve", "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
    finally:
        taken.close()
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], run.stderr
    assert "TEACHERQ_GATEWAY__PORT" in lines[0]


def test_limits_deadline_and_drain_on_sigterm(settings, start_consumer, start_gateway) -> None:
    """A body over gateway.max_body_bytes gets 413 naming the setting; a request past its
    own timeout_s gets 504 naming it; a client that leaves during a TRL request of two
    sequences cancels both jobs; on SIGTERM the gateway stops accepting connections but a
    request in flight (its job waiting for a consumer) is still answered, value for value as
    the queue computes it, and the process then exits 0."""
    s = settings.model_copy(
        update={
            "gateway": settings.gateway.model_copy(
                update={"max_body_bytes": 2048, "shutdown_grace_s": scaled(240)}
            )
        }
    )
    gw = start_gateway(s)
    status, out = gw.call("POST", "/generate", {"input_ids": [1] * 2000})
    assert status == 413 and "gateway.max_body_bytes=2048" in out["error"], out
    status, out = gw.call("POST", "/generate", {"input_ids": [1, 2, 3], "timeout_s": 0.5})
    assert status == 504 and "timeout_s=0.5" in out["error"], out

    def submitted() -> int:
        return gw.call("GET", "/get_loads")[1]["gateway_jobs"]

    sock = socket.create_connection(("127.0.0.1", gw.port))
    body = json.dumps(
        {"sequences": [[4, 5, 6], [7, 8, 9]], "prompt_lengths": [1, 1], "top_logprobs": 1}
    ).encode()
    sock.sendall(
        b"POST /get_sequence_logprobs/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: submitted() >= 3, "the TRL request's two jobs submitted")
    sock.close()
    gone = wait_until(
        lambda: len(names := _results_named(s, "gw-")) == 2 and names, "both jobs cancelled"
    )
    assert all(r and r.error == "cancelled by the user" for r in TeacherClient(s).results(gone))

    ids = [5, 6, 7, 8]
    answer: dict[str, Any] = {}
    waiting = threading.Thread(
        target=lambda: answer.update(
            zip(("status", "body"), gw.call("POST", "/generate", {"input_ids": ids}), strict=True)
        ),
    )
    waiting.start()
    wait_until(lambda: submitted() >= 4, "the in-flight request's job in the queue")
    gw.proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", gw.port), timeout=scaled(1)).close()
        except OSError:
            return True
        return False

    wait_until(refused, "the gateway to stop accepting connections")
    assert waiting.is_alive(), "the in-flight request must wait for its job, not be dropped"
    start_consumer(s)
    waiting.join(timeout=scaled(120))
    assert answer.get("status") == 200, answer
    np.testing.assert_allclose(
        answer["body"]["log_probs"],
        tiny_full_log_softmax(np.array(ids))[np.arange(3), ids[1:]],
        atol=2e-4,
    )
    assert gw.proc.wait(timeout=scaled(60)) == 0
