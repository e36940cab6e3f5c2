"""Queue-level Prometheus metrics over real HTTP: `teacherq exporter` as a process, and the
same figures from a real consumer's /metrics (DP replica 0 with consumer.metrics_port).

What is proven: each figure equals what the queue holds (backlog, in flight, tokens, dead
letters, live consumers by heartbeat, age of the oldest unacknowledged job); one `queue`
label and no pid label on any series; no `_created` series.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producer import TeacherClient, TeacherRequest
from shared import keys
from shared.redis_server import free_port
from shared.settings import Settings, to_env
from tests.helpers import REPO
from tests.processes import stop_all
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.integration


def scrape(port: int, *, timeout: float = scaled(30.0)) -> tuple[str, dict[tuple[str, str], float]]:
    """The /metrics text and {(sample name, queue label): value}, retried until it serves."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/metrics", timeout=scaled(5)
            ) as resp:
                text = resp.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, sample.labels.get("queue", ""))] = sample.value
    return text, values


def test_exporter_serves_each_queue_figure(settings: Settings, r, tmp_path) -> None:
    """Three jobs submitted (one then read by a consumer, so in flight), a dead letter, one
    fresh and one stale heartbeat: the exporter reports exactly that, for this queue and for
    a second, empty one."""
    q, other = settings.queue.name, f"e{uuid.uuid4().hex[:8]}"
    client = TeacherClient(settings)
    reqs = [TeacherRequest(input_ids=list(range(n)), job_id=f"x{n}") for n in (5, 7, 9)]
    client.submit(reqs)
    r.xreadgroup(settings.queue.group, "reader", {keys.jobs_stream(q): ">"}, count=1)
    r.xadd(keys.dead_stream(q), {"job_id": "poison", "reason": "test"})
    now = time.time()
    r.hset(keys.consumers_key(q), "reader", json.dumps({"state": "busy", "time": now}))
    r.hset(keys.consumers_key(q), "gone", json.dumps({"state": "busy", "time": now - 3600}))
    port = free_port()
    env = {**os.environ, **to_env(settings), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "producer.cli", "exporter", "--port", str(port)]
    cmd += ["--queue", q, "--queue", other]
    log = open(tmp_path / "exporter.log", "w")  # noqa: SIM115 - kept open for the process
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        oldest = ("teacherq_queue_oldest_pending_seconds", q)
        text, v = wait_until(
            lambda: (got := scrape(port))[1].get(oldest, 0) >= 1.0 and got,
            "a scrape with the oldest job 1 s old",
            timeout=30,
        )
    finally:
        stop_all([proc])
    assert proc.returncode == 0, (tmp_path / "exporter.log").read_text()
    assert v[("teacherq_queue_lag", q)] == 2
    assert v[("teacherq_queue_in_flight", q)] == 1
    assert v[("teacherq_queue_pending_tokens", q)] == 5 + 7 + 9
    assert v[("teacherq_queue_dead_letters", q)] == 1
    assert v[("teacherq_queue_live_consumers", q)] == 1
    assert 1.0 <= v[("teacherq_queue_oldest_pending_seconds", q)] < 60
    assert v[("teacherq_queue_up", q)] == 1
    for name in ("lag", "in_flight", "pending_tokens", "dead_letters", "live_consumers"):
        assert v[(f"teacherq_queue_{name}", other)] == 0
    assert v[("teacherq_queue_oldest_pending_seconds", other)] == 0
    assert "_created" not in text
    assert "pid" not in text.lower()
    assert {labels for (_, labels) in v} == {q, other}  # one label, `queue`, on every series


def test_consumer_serves_queue_figures(settings: Settings, start_consumer) -> None:
    """A real consumer with consumer.metrics_port set serves the queue's figures beside its
    own: itself as the one live consumer, nothing in flight once the jobs are done."""
    port = free_port()
    s = settings.model_copy(
        update={"consumer": settings.consumer.model_copy(update={"metrics_port": port})}
    )
    start_consumer(s)
    client = TeacherClient(s)
    client.wait(
        client.submit([TeacherRequest(input_ids=[1, 2, 3, 4], job_id="m1")]), timeout=scaled(60)
    )
    text, v = scrape(port)
    q = s.queue.name
    assert v[("teacherq_queue_live_consumers", q)] == 1
    assert v[("teacherq_queue_in_flight", q)] == 0
    assert v[("teacherq_queue_lag", q)] == 0
    assert v[("teacherq_queue_pending_tokens", q)] == 0
    assert "teacherq_queue_oldest_pending_seconds" in text
    assert "teacherq_jobs_done_total" in text  # the consumer's own series beside them
    assert "_created" not in text


def test_a_taken_metrics_port_stops_the_start_naming_the_setting(
    settings: Settings, start_consumer
) -> None:
    """A consumer whose metrics port is taken exits with 78 (a configuration error) and one
    line naming the setting, before it ever reports ready (before, it died after its
    heartbeat had said ready, and jobs waited for it)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = settings.model_copy(
            update={"consumer": settings.consumer.model_copy(update={"metrics_port": port})}
        )
        proc = start_consumer(s, wait=False)
        assert proc.wait(timeout=scaled(120)) == 78
    out = proc.log_path.read_text()
    assert f"TEACHERQ_CONSUMER__METRICS_PORT: cannot serve metrics on port {port}" in out
    assert "Traceback" not in out
    assert "consumer.ready" not in out


def test_grafana_dashboard_queries_only_served_metrics() -> None:
    """configs/grafana-teacherq.json parses, and every metric its panels query is one the
    exporter or a consumer serves (a renamed metric would leave a panel empty)."""
    import re

    from shared.queue_metrics import METRICS

    dash = json.loads((REPO / "configs" / "grafana-teacherq.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(teacherq_[a-z_]+)\b", e)}
    served = {f"teacherq_queue_{name}" for name in METRICS}
    served |= {"teacherq_tokens_total", "teacherq_jobs_done_total"}
    assert used and used <= served, used - served
    assert {f"teacherq_queue_{n}" for n in METRICS} <= used  # every queue figure has a panel
