"""Ready in seconds, reloads in seconds (issue 37), with real consumer processes, a real
valkey-server and real checkpoints: a consumer's output holds teacherq's own lines only (the
libraries' notices appear at debug), it reports time-to-ready by phase and the compile caches
it set, and a weight update of the same shape is loaded in place while another shape rebuilds.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from producer import TeacherClient, TeacherRequest
from tests.helpers import fast
from tests.reference import hf_token_logprobs
from tests.timing import scaled, wait_until

pytestmark = pytest.mark.integration

LIBRARY_WORDS = ("megatron", "apex", "transformer engine", "transformer_engine")


def _events(proc, *, strict: bool = True) -> list[dict]:
    """Every line of a consumer's output, parsed; with `strict`, a line that is not JSON fails
    the test (torchrun's own banner is not the consumer's: TP = 2 tests pass False)."""
    lines = [line for line in proc.log_path.read_text().splitlines() if line.strip()]
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if strict:
                pytest.fail(f"a consumer line is not one of teacherq's JSON lines: {line[:300]}")
    return events


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=scaled(60))


def _with(settings, **consumer):
    return settings.model_copy(update={"consumer": settings.consumer.model_copy(update=consumer)})


def test_library_notices_are_debug_lines_only(settings, start_consumer, tmp_path) -> None:
    """At the default level a consumer's output is teacherq's own JSON lines: megatron-core's
    start-up notices ("Unknown MLP type", the Apex / Transformer Engine fallbacks) are absent.
    At debug they are there, as `library.log` events carrying the library's logger name."""
    quiet = start_consumer(settings)
    _stop(quiet)
    events = _events(quiet)
    assert any(e["event"] == "consumer.ready" for e in events)
    for e in events:
        text = json.dumps(e).lower()
        assert not any(w in text for w in LIBRARY_WORDS), f"library line at info: {e}"

    debug = settings.model_copy(update={"log": settings.log.model_copy(update={"level": "debug"})})
    loud = start_consumer(debug)
    _stop(loud)
    notices = [e for e in _events(loud) if e["event"] == "library.log"]
    assert all(e["level"] == "debug" for e in notices)
    loggers = {e["logger"] for e in notices}
    assert any(name.startswith("megatron") for name in loggers), loggers
    messages = " ".join(e["message"] for e in notices)
    assert "Unknown MLP type" in messages and "Apex" in messages


def test_ready_reports_phases_caches_and_every_warmed_output(
    settings, start_consumer, tmp_path
) -> None:
    """`consumer.ready` carries seconds per start-up phase; the compile caches are under the
    setting's directory, in this environment's subdirectory (created, filled from the
    `compile_cache_seed` folder, sealed after the warm-up, and named in `consumer.warmed_up`);
    a full warm-up visits every output combination the queue's limits allow (8 head-pass
    groups, every class of sample count up to the limit, labels and a temperature other
    than 1)."""
    from consumer.serve.compile_cache import environment_key, write_seed_record

    cache, baked = tmp_path / "kernels", tmp_path / "baked"
    (baked / "triton" / "HASH").mkdir(parents=True)
    (baked / "triton" / "HASH" / "k.cubin").write_bytes(b"baked")
    write_seed_record(baked, environment_key())
    s = _with(settings, compile_cache_dir=str(cache), warmup="full", compile_cache_seed=baked)
    s = s.model_copy(
        update={"queue": s.queue.model_copy(update={"max_top_k": 4, "max_sample_n": 6})}
    )
    proc = start_consumer(s)
    _stop(proc)
    events = _events(proc)
    [ready] = [e for e in events if e["event"] == "consumer.ready"]
    phases = ready["phases_s"]
    for name in ("import", "setup", "build", "compile", "warmup", "total"):
        assert phases[name] >= 0, phases
    parts = sum(v for k, v in phases.items() if k != "total")
    assert parts == pytest.approx(phases["total"], abs=0.05)
    [warmed] = [e for e in events if e["event"] == "consumer.warmed_up"]
    keyed = Path(warmed["compile_cache"]["path"])  # this environment's sealed subdirectory
    assert keyed.parent == cache and warmed["compile_cache"]["state"] == "sealed"
    assert warmed["compile_cache"]["opened"] == "seeded"
    assert warmed["compile_caches"] == {
        "TRITON_CACHE_DIR": str(keyed / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(keyed / "inductor"),
        "QUACK_CACHE_DIR": str(keyed / "quack"),
    }
    assert (keyed / "triton").is_dir() and (keyed / "inductor").is_dir()
    assert (keyed / "manifest.json").is_file()
    assert (keyed / "triton" / "HASH" / "k.cubin").read_bytes() == b"baked"
    assert "triton/HASH/k.cubin" in json.loads((keyed / "manifest.json").read_text())["files"]
    [seeded] = [e for e in events if e["event"] == "compile_cache.seeded"]
    assert seeded["files"] == 1
    seen = warmed["combinations"]
    for k in ("k0", "k1", "k4"):
        assert any(c.startswith(k + " ") for c in seen), (k, seen)
    for n in ("n1", "n2", "n3", "n5", "n6"):  # 1, 2, 3-4, 5-8 samples per program, the limit
        assert any(f" {n} " in c for c in seen), (n, seen)
    assert any(" e " in c for c in seen) and any(" - " in c for c in seen)
    assert any("L2 t0.7" in c for c in seen)


@pytest.fixture(scope="module")
def teachers(hf_checkpoint):
    """Two Qwen2 teachers of one shape (different weights) and one of another shape."""
    a = hf_checkpoint("qwen2", "cold-a", seed=11)
    b = hf_checkpoint("qwen2", "cold-b", seed=12)
    wider = hf_checkpoint("qwen2", "cold-wide", seed=13, intermediate_size=96)
    return a, b, wider


def _logprobs(client: TeacherClient, ids: list[int], job_id: str):
    [res] = client.wait(client.submit([TeacherRequest(input_ids=ids, job_id=job_id)]), timeout=60)
    assert res.ok, res.error
    return res


def _updated(proc, count: int) -> list[dict]:
    def found() -> list[dict] | None:
        got = [e for e in _events(proc, strict=False) if e.get("event") == "weights.updated"]
        return got if len(got) >= count else None

    return wait_until(found, "weights.updated logged", timeout=30)


def test_same_shape_update_loads_in_place_other_shapes_rebuild(
    settings, start_consumer, teachers
) -> None:
    """An update to a checkpoint of the served shape overwrites the parameters where they are
    (`weights.updated` says in_place, with the drain-to-serving gap) and the results are the
    new teacher's (transformers' log-probs of it); a checkpoint of another shape is built anew
    (in_place false), and its results are its own too. With `model.prefetch` the first
    checkpoint was prefetched, and the warm-up ran before its weights were loaded."""
    a, b, wider = teachers
    s = fast(settings).model_copy(
        update={"model": settings.model.model_copy(update={"path": str(a), "prefetch": True})}
    )
    proc = start_consumer(s)
    client = TeacherClient(s)
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    before = _logprobs(client, ids, "before")
    np.testing.assert_allclose(before.logprobs, hf_token_logprobs(a, np.array(ids)), atol=1e-4)
    # the checkpoint's shards were read into the page cache from the process's start
    [fetched] = [e for e in _events(proc) if e["event"] == "checkpoint.prefetched"]
    assert fetched["of_bytes"] == sum(f.stat().st_size for f in Path(a).glob("*.safetensors"))
    assert fetched["failed_chunks"] == 0 and 0 <= fetched["bytes"] <= fetched["of_bytes"]
    assert fetched["bytes"] == fetched["of_bytes"] or not fetched["finished_before_load"]
    # warmed up on a shell of zero weights, then loaded in place: the results above are a's
    [warmed] = [e for e in _events(proc) if e["event"] == "consumer.warmed_up"]
    assert warmed["before_load"] is True

    client.update_weights(str(b), timeout=120)
    [first] = _updated(proc, 1)
    assert first["in_place"] is True and first["gap_s"] >= 0, first
    same = _logprobs(client, ids, "same-shape")
    assert same.model_version.startswith("cold-b@")
    np.testing.assert_allclose(same.logprobs, hf_token_logprobs(b, np.array(ids)), atol=1e-4)
    assert not np.allclose(same.logprobs, before.logprobs, atol=1e-3)

    client.update_weights(str(wider), timeout=120)
    second = _updated(proc, 2)[1]
    assert second["in_place"] is False, second
    other = _logprobs(client, ids, "other-shape")
    assert other.model_version.startswith("cold-wide@")
    np.testing.assert_allclose(other.logprobs, hf_token_logprobs(wider, np.array(ids)), atol=1e-4)
    assert proc.poll() is None


def test_tp2_replica_updates_in_place_on_both_ranks(settings, start_consumer, teachers) -> None:
    """At TP = 2 both ranks load a same-shape update in place (the follower through the same
    reload): the sharded results equal transformers' log-probs of the new teacher."""
    a, b, _ = teachers
    s = fast(settings).model_copy(
        update={
            "model": settings.model.model_copy(update={"path": str(a)}),
            "parallel": settings.parallel.model_copy(update={"tp": 2}),
        }
    )
    proc = start_consumer(s, nproc=2)
    client = TeacherClient(s)
    ids = [5, 8, 13, 21, 34, 55, 89]
    _logprobs(client, ids, "tp2-before")
    client.update_weights(str(b), timeout=120)
    [line] = _updated(proc, 1)
    assert line["in_place"] is True, line
    after = _logprobs(client, ids, "tp2-after")
    np.testing.assert_allclose(after.logprobs, hf_token_logprobs(b, np.array(ids)), atol=1e-4)
