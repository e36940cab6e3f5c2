"""The consumer's warm-up (consumer/serve/warmup.py) and compile caches
(consumer/serve/compile_cache.py; sealing: tests/unit/test_compile_cache.py):
the warm-up sends every output combination the queue's limits allow through the real head,
and the cache directories follow the setting, the environment and the home, in that order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from consumer.serve import warmup


def _ns(n: int) -> int:
    """The fused kernels' samples per program for `n` samples (rowstats._Layout)."""
    return min(16, 1 << max(n - 1, 0).bit_length()) if n else 0


def test_every_batch_holds_each_head_group_and_the_batches_cover_every_sample_class() -> None:
    """Each planned batch has one job per head-pass group (top-k, samples, entropy: 8), the
    batches together reach every samples-per-program class up to the limit and the limit
    itself, and half of the jobs of each batch carry labels and a temperature other than 1."""
    batches = warmup.combos(max_top_k=300, max_sample_n=64, vocab_size=1000)
    for batch in batches:
        assert sorted(c.group for c in batch) == sorted(
            (bool(g & 1), bool(g & 2), bool(g & 4)) for g in range(8)
        )
        assert sum(c.labels > 0 and c.temperature != 1.0 for c in batch) == 4
    samples = {c.sample_n for b in batches for c in b}
    assert {_ns(n) for n in samples} == {0, 1, 2, 4, 8, 16}
    assert 64 in samples and 300 in {c.top_k for b in batches for c in b}


def test_limits_leave_out_the_groups_they_forbid() -> None:
    """With sampling (or top-k) off in the queue's limits, no warm-up job asks for it, and the
    other groups are still all there."""
    no_samples = warmup.combos(max_top_k=5, max_sample_n=0, vocab_size=1000)
    groups = {c.group for b in no_samples for c in b}
    assert all(not g[1] for g in groups) and len(groups) == 4
    nothing = warmup.combos(max_top_k=0, max_sample_n=0, vocab_size=1000)
    assert {c.group for b in nothing for c in b} == {(False, False, False), (False, False, True)}


def _tiny(layout, *, max_top_k: int, max_sample_n: int, token_budget: int, graphs: bool):
    """A real tiny teacher's scorer on the CPU, and the full warm-up plan for it."""
    from consumer.forward.model import TINY, build_model
    from consumer.forward.scoring import Scorer

    model = build_model(TINY, layout, params_dtype=torch.float32, device="cpu")
    scorer = Scorer(model=model, spec=TINY, layout=layout, device=torch.device("cpu"))
    plan = warmup.plan(
        max_top_k=max_top_k,
        max_sample_n=max_sample_n,
        vocab_size=TINY.vocab_size,
        max_input_tokens=TINY.max_input_tokens,
        token_budget=token_budget,
        full=True,
        graphs=graphs,
    )
    return scorer, plan


def test_warmup_sends_every_combination_through_the_head(layout, monkeypatch) -> None:
    """On a real tiny teacher, the head is called once per (batch, group), with every sample
    class, top-k on and off, entropy on and off, and label columns and temperatures other than
    1 among its rows: counted at `tp_ops.chunked_head`, which the scorer calls."""
    from consumer import tp_ops

    calls: list[tuple] = []
    real = tp_ops.chunked_head

    def counting(**kwargs):
        call = kwargs["call"]
        width = 0 if call.target_ids_TW is None else call.target_ids_TW.shape[1]
        calls.append(
            (
                call.top_k,
                call.sample_n,
                call.want_entropy,
                width,
                bool((call.inv_temperature_T != 1.0).any()),
            )
        )
        return real(**kwargs)

    monkeypatch.setattr(tp_ops, "chunked_head", counting)
    scorer, plan = _tiny(layout, max_top_k=4, max_sample_n=9, token_budget=256, graphs=False)
    report = warmup.run(scorer, plan)
    assert report["batches"] == len(plan) == 5  # sample classes 1, 2, 3, 5, 9
    assert len(calls) == 8 * len(plan)
    for k_on in (False, True):
        for entropy in (False, True):
            assert any((c[0] > 0) == k_on and c[2] == entropy and c[1] == 0 for c in calls)
            got = {_ns(c[1]) for c in calls if (c[0] > 0) == k_on and c[2] == entropy}
            assert got == {0, 1, 2, 4, 8, 16}, got
    assert any(c[3] > 1 for c in calls) and any(c[4] for c in calls)
    assert any(c[3] == 1 and not c[4] for c in calls)


def test_graph_classes_fill_the_token_budget() -> None:
    """With CUDA graphs, the plan adds one full batch per document-length class (128 tokens
    up to the budget), each exactly the token budget: the buckets full batches use."""
    plan = warmup.plan(
        max_top_k=1,
        max_sample_n=1,
        vocab_size=100,
        max_input_tokens=32768,
        token_budget=8192,
        full=True,
        graphs=True,
    )
    graphs = [b for b in plan if b.why == "graph"]
    assert [b.tokens for b in graphs] == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert all(b.tokens * len(b.combos) == 8192 for b in graphs)


def test_only_the_first_length_class_is_scored_the_others_recorded(layout, monkeypatch) -> None:
    """Of the length classes' full batches, the first goes through the head (at a full
    batch's row count); the others are handed to `Scorer.record_graph`, not scored. On the
    CPU there are no graphs, so none is recorded and the report says so."""
    from consumer import tp_ops
    from consumer.forward.scoring import Scorer

    rows: list[int] = []
    real = tp_ops.chunked_head

    def counting(**kwargs):
        rows.append(int(kwargs["call"].inv_temperature_T.shape[0]))
        return real(**kwargs)

    monkeypatch.setattr(tp_ops, "chunked_head", counting)
    recorded: list[int] = []
    real_record = Scorer.record_graph

    def record(self, batch):
        recorded.append(batch.num_tokens)
        return real_record(self, batch)

    monkeypatch.setattr(Scorer, "record_graph", record)
    scorer, plan = _tiny(layout, max_top_k=1, max_sample_n=1, token_budget=512, graphs=True)
    classes = [b for b in plan if b.why == "graph"]
    assert [b.tokens for b in classes] == [128, 256, 512]
    report = warmup.run(scorer, plan)
    outputs = sum(b.why == "outputs" for b in plan)
    assert len(rows) == 8 * outputs + 1  # every group of the short batches, one full batch
    assert rows[-1] == 512 - 4  # the first class's 4 documents of 128: 127 rows each
    assert recorded == [512, 512]  # the 256- and 512-token classes, not run
    assert report["graphs_not_run"] == 0  # no graphs on the CPU


def test_compile_cache_follows_setting_then_environment_then_home(tmp_path: Path) -> None:
    """Unset, the caches go under `<home>/compile-cache/<environment key>`; a directory the
    environment names already is used as it is (and not sealed); the setting overrides the
    environment. The directories exist."""
    from consumer.serve.compile_cache import apply, key_name

    key = {"triton": "3.6.0", "gpu": "NVIDIA H200"}
    home = tmp_path / "home"
    got = apply(None, home, {}, key=key)
    keyed = home / "compile-cache" / key_name(key)
    assert got.variables == {
        "TRITON_CACHE_DIR": str(keyed / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(keyed / "inductor"),
        "QUACK_CACHE_DIR": str(keyed / "quack"),
    }
    assert Path(got.variables["TRITON_CACHE_DIR"]).is_dir() and got.state == "new"
    env: dict[str, str] = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")}
    external = apply(None, home, env, key=key)
    assert external.variables == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "mine")}
    assert external.path is None and external.seal() == 0
    forced = apply(tmp_path / "set", home, env, key=key)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "set" / key_name(key) / "inductor")
    assert forced.variables["TRITON_CACHE_DIR"] == env["TRITON_CACHE_DIR"]
    assert (tmp_path / "set" / key_name(key) / "triton").is_dir()


@pytest.mark.parametrize("minimal", [True])
def test_minimal_plan_is_one_small_batch(minimal: bool) -> None:
    """`consumer.warmup=minimal` (auto off CUDA) runs one small batch only."""
    plan = warmup.plan(
        max_top_k=5,
        max_sample_n=5,
        vocab_size=100,
        max_input_tokens=100,
        token_budget=64,
        full=not minimal,
        graphs=True,
    )
    assert len(plan) == 1 and plan[0].tokens == 4
