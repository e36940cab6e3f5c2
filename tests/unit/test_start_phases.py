"""Where a consumer's start goes: the phases `consumer.ready` logs are exported as gauges
(`teacherq_consumer_start_seconds{phase=...}`), the start clock splits the time into
import, setup, load, compile and warm-up, and megatron's import no longer pulls in torch's
compiler (consumer/serve/lazy_compile.py) while its fusions still compile when first run."""

from __future__ import annotations

import pytest
import torch

from consumer.serve.lazy_compile import deferred_torch_compile
from consumer.serve.metrics import ConsumerMetrics
from consumer.serve.service import StartClock


def test_start_phases_are_exported_as_gauges() -> None:
    """Each phase is one series labelled with the queue, the consumer and the phase."""
    metrics = ConsumerMetrics(queue="q", consumer="c1")
    metrics.start_phases({"import": 4.25, "compile": 0.5, "warmup": 2.0, "total": 6.75})
    text = metrics.scrape().decode()
    assert "# TYPE teacherq_consumer_start_seconds gauge" in text
    for phase, value in (("import", 4.25), ("compile", 0.5), ("warmup", 2.0), ("total", 6.75)):
        line = f'teacherq_consumer_start_seconds{{consumer="c1",phase="{phase}",queue="q"}} {value}'
        assert line in text, text


def test_start_clock_phases_add_up_to_the_total(monkeypatch: pytest.MonkeyPatch) -> None:
    """Laps close phases one after another; a split names parts of a phase and what they
    leave stays under the phase's name; the parts sum to the total."""
    now = iter([10.0, 14.0, 14.5, 17.0, 18.0, 21.0])
    monkeypatch.setattr("consumer.serve.service.time.monotonic", lambda: next(now))
    clock = StartClock(None)  # 10.0
    clock.lap("import")  # 14.0
    clock.lap("setup")  # 14.5
    clock.lap("load", split={"read": 1.0, "copy": 0.5})  # 17.0
    clock.lap("compile")  # 18.0
    clock.lap("warmup")  # 21.0
    assert clock.phases == {
        "import": 4.0,
        "setup": 0.5,
        "read": 1.0,
        "copy": 0.5,
        "load": 1.0,
        "compile": 1.0,
        "warmup": 3.0,
        "total": 11.0,
    }
    assert sum(v for k, v in clock.phases.items() if k != "total") == clock.phases["total"]


def test_deferred_compile_compiles_on_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the context, decorating a function with torch.compile (as megatron's jit_fuser
    does at import) calls nothing; the first call compiles once, later calls reuse it; the
    decorator form with options works; torch.compile is restored afterwards."""
    calls: list[dict] = []

    def fake_compile(fn=None, **kwargs):
        calls.append(kwargs)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)
    with deferred_torch_compile():

        @torch.compile
        def double(x):
            """Twice x."""
            return 2 * x

        @torch.compile(dynamic=True)
        def triple(x):
            return 3 * x

        assert calls == []
        module = torch.nn.Identity()
        torch.compile(module)  # not a plain function: compiled at once, as asked
        assert len(calls) == 1
    assert torch.compile is fake_compile
    assert double.__doc__ == "Twice x."
    assert double(2) == ("compiled", 4) and double(3) == ("compiled", 6)
    assert triple(2) == ("compiled", 6)
    assert calls == [{}, {}, {"dynamic": True}]
