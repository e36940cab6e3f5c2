"""quack-kernels' import on a thread while the weights load (`quack_gemm.preload`, #51).

quack itself needs an sm90 device to serve; here a small package of the same name stands in
for it, on a path of its own, so that what is checked is the preload's own part: the import
runs on one daemon thread per device, the caller does not wait for it (`settle`, before the
warm-up, does), a failing import is logged and raised to no one, and a device quack cannot
serve starts nothing."""

from __future__ import annotations

import sys
import threading

import pytest
import structlog
import torch

from consumer.forward import quack_gemm
from tests.timing import scaled, wait_until

INTERFACE = """
import threading
gate = threading.Event()
gate.wait(30)  # the test opens it: the import is still running when preload returns
THREAD = threading.current_thread().name
"""


@pytest.fixture
def fake_quack(tmp_path, monkeypatch):
    """A `quack.gemm_interface` of our own on sys.path, served as if the device were sm90."""
    pkg = tmp_path / "quack"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(quack_gemm, "may_serve", lambda device=None: True)
    for name in ("quack", "quack.gemm_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    quack_gemm.preload.cache_clear()
    yield pkg
    quack_gemm.settle(scaled(30))
    quack_gemm.preload.cache_clear()
    for name in ("quack", "quack.gemm_interface"):
        sys.modules.pop(name, None)


def test_the_import_runs_on_one_thread_while_the_caller_goes_on(fake_quack):
    (fake_quack / "gemm_interface.py").write_text(INTERFACE)
    thread = quack_gemm.preload(torch.device("cuda", 0))
    assert thread is not None and thread.daemon and thread.is_alive()  # returned at once
    assert quack_gemm.preload(torch.device("cuda", 0)) is thread  # once per device
    # the module is being imported on the thread: open its gate, then it finishes
    gate = wait_until(_gate, "the import on the thread reached its gate")
    gate.set()
    quack_gemm.settle(scaled(30))  # what the consumer waits on before its warm-up
    assert not thread.is_alive()
    assert sys.modules["quack.gemm_interface"].THREAD == "tq-quack-import"


def test_a_failing_import_is_logged_not_raised(fake_quack):
    (fake_quack / "gemm_interface.py").write_text("raise ImportError('no libcuda here')\n")
    with structlog.testing.capture_logs() as logs:
        thread = quack_gemm.preload(torch.device("cuda", 0))
        assert thread is not None
        thread.join(scaled(30))
    failed = [e for e in logs if e["event"] == "quack_gemm.preload_failed"]
    assert failed and "no libcuda here" in failed[0]["error"]
    assert failed[0]["log_level"] == "debug"


def test_nothing_starts_where_quack_cannot_serve(fake_quack, monkeypatch):
    (fake_quack / "gemm_interface.py").write_text(INTERFACE)
    before = threading.active_count()
    assert quack_gemm.preload(torch.device("cpu")) is None
    monkeypatch.setattr(quack_gemm, "may_serve", lambda device=None: False)
    assert quack_gemm.preload(torch.device("cuda", 0)) is None
    assert threading.active_count() == before
    assert "quack.gemm_interface" not in sys.modules


def _gate():
    """The stand-in module's gate once its import (still running) has made it."""
    module = sys.modules.get("quack.gemm_interface")
    return getattr(module, "gate", None)


@pytest.fixture
def sm90_with_quack(monkeypatch):
    """What `may_serve` asks, answered as on an H100 with quack-kernels installed; quack
    allowed again afterwards (the process-wide default)."""
    monkeypatch.setattr(quack_gemm, "installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    yield
    quack_gemm.allow(True)


def test_expert_gemms_triton_turns_quack_off_for_the_process(sm90_with_quack):
    """`consumer.expert_gemms = triton` (`allow(False)`): quack may not serve, nor is it
    imported; auto (`allow(True)`) gives it back."""
    assert quack_gemm.may_serve()
    quack_gemm.allow(False)
    assert not quack_gemm.may_serve()
    assert quack_gemm.preload(torch.device("cuda", 0)) is None
    assert not quack_gemm.available(torch.device("cuda", 0), torch.bfloat16, 7168)
    quack_gemm.allow(True)
    assert quack_gemm.may_serve()


@pytest.mark.parametrize("quack", [True, False])
def test_precompile_workers_plan_quack_as_the_setting_says(sm90_with_quack, monkeypatch, quack):
    """A precompile worker plans quack's GEMMs only where the consumer's setting lets quack
    serve (the job carries it), so the workers never compile for a path that is off."""
    from consumer.serve import precompile

    seen = []
    monkeypatch.setattr(precompile, "warmup_plan", lambda *a, **kw: seen.append(kw) or [])
    job = precompile.Job(
        model_path=None, tp=1, tp_rank=0, dtype="bfloat16", max_top_k=4, max_sample_n=2,
        token_budget=256, full=True, workers=1, quack=quack,
    )  # fmt: skip
    assert precompile._worker(job, 0) == 0
    assert [kw["quack"] for kw in seen] == [quack]
    other = precompile.Job(**{**job.__dict__, "quack": not quack})
    assert other.digest() != job.digest()  # a sealed cache's plan is the setting's too
