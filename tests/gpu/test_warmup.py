"""The consumer's warm-up on CUDA (consumer/serve/warmup.py): after it, no batch of any output
at any size compiles a Triton kernel, and a full batch of any document-length class replays a
graph instead of recording one (a graph the warm-up recorded without running gives the eager
result); a same-shape weight update in place keeps the graphs and changes the results.

Compiles are counted with Triton's `jit_cache_hook`, which Triton calls before every compile
(a miss of its in-memory cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from consumer.forward.graphs import GraphedForward  # noqa: E402
from consumer.forward.model import ModelSpec, build_model  # noqa: E402
from consumer.forward.scoring import Scorer  # noqa: E402
from consumer.group.batching import batch_from_jobs  # noqa: E402
from consumer.serve import warmup  # noqa: E402
from shared.messages import Job, TeacherRequest  # noqa: E402

SPEC = ModelSpec(
    family="qwen2",
    vocab_size=32000,
    hidden_size=512,
    num_layers=4,
    num_attention_heads=8,
    num_kv_heads=2,
    ffn_hidden_size=1408,
    max_position_embeddings=16384,
    qkv_bias=True,
)
CUDA = torch.device("cuda")
BUDGET = 8192
LIMITS = {"max_top_k": 64, "max_sample_n": 32}


@pytest.fixture(scope="module")
def scorer(layout) -> Scorer:
    """A bf16 model with bucketed CUDA graphs, warmed up as a consumer does."""
    torch.manual_seed(0)
    model = build_model(SPEC, layout, params_dtype=torch.bfloat16, device=CUDA)
    with torch.no_grad():  # unit-scale weights: peaked predictions, so changes show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    graphs = GraphedForward(model, max_graphs=64, buckets=True, max_rows=BUDGET)
    s = Scorer(model=model, spec=SPEC, layout=layout, device=CUDA, graphs=graphs)
    plan = warmup.plan(
        **LIMITS,
        vocab_size=SPEC.vocab_size,
        max_input_tokens=SPEC.max_input_tokens,
        token_budget=BUDGET,
        full=True,
        graphs=True,
    )
    report = warmup.run(s, plan)
    # 128 .. 8192-token documents, and the short outputs' batches' own bucket
    assert report["graphs_recorded"] >= 7
    assert report["graphs_not_run"] == 6  # every class after the first: recorded, not run
    return s


@pytest.mark.parametrize("doc", [256, 4096])
def test_a_class_recorded_without_running_replays_the_eager_result(scorer, doc) -> None:
    """A length class the warm-up only recorded: its first batch replays the graph (records
    nothing) and scores what an eager forward of the same weights scores."""
    captures = scorer.graphs.captures
    batch = _batch([doc] * (BUDGET // doc), seed=doc + 1)
    replayed = scorer.score(batch)
    assert scorer.graphs.captures == captures
    eager = Scorer(model=scorer.model, spec=SPEC, layout=scorer.layout, device=CUDA)
    for got, want in zip(replayed, eager.score(batch), strict=True):
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=0.1)


def _batch(lengths: list[int], seed: int, **opts):
    rng = np.random.default_rng(seed)
    jobs = []
    for i, n in enumerate(lengths):
        req = TeacherRequest(input_ids=rng.integers(0, SPEC.vocab_size, n), seed=i, **opts)
        jobs.append(Job(job_id=f"j{i}", entry_id=f"0-{i}", request=req, submitted_at=0.0))
    return batch_from_jobs(jobs)


@pytest.fixture
def compiles():
    """Triton compiles (their kernels' names) while the test runs."""
    from triton import knobs

    seen: list[str] = []

    def hook(*args, **kwargs) -> bool:
        seen.append(str(kwargs.get("repr") or kwargs.get("fn") or args))
        return False  # compile as usual

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    yield seen
    knobs.runtime.jit_cache_hook = before


OUTPUTS = [
    {},
    {"top_k": 1},
    {"top_k": 7},
    {"top_k": 64},
    {"sample_n": 1},
    {"sample_n": 6},
    {"sample_n": 32},
    {"return_entropy": True},
    {"temperature": 0.7, "top_k": 20, "sample_n": 3, "return_entropy": True},
]


@pytest.mark.parametrize("opts", OUTPUTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("lengths", [[37], [2048] * 4, [1500, 700, 3000, 999]])
def test_no_output_at_any_size_compiles_after_warmup(scorer, compiles, opts, lengths) -> None:
    """Every output within the limits, at row counts the warm-up never used, runs kernels the
    warm-up compiled: no Triton compile at all."""
    scorer.score(_batch(lengths, seed=len(lengths), **opts))
    torch.cuda.synchronize()
    assert compiles == [], compiles


@pytest.mark.parametrize("doc", [128, 512, 2048, 8192])
def test_full_batches_of_each_length_class_replay(scorer, doc) -> None:
    """A full batch of documents of one length class was recorded by the warm-up: scoring one
    (new ids) replays it, recording nothing."""
    captures = scorer.graphs.captures
    scorer.score(_batch([doc] * (BUDGET // doc), seed=doc))
    assert scorer.graphs.captures == captures


def test_update_in_place_keeps_graphs_and_changes_results(scorer) -> None:
    """Parameters overwritten in place (as a same-shape update does) keep every graph, and
    the replayed results follow the new weights: equal to an eager forward of them."""
    graphs_before = scorer.graphs.size
    batch = _batch([2048] * 4, seed=5)
    old = scorer.score(batch)[0]["logprobs"]
    with torch.no_grad():
        for p in scorer.model.parameters():
            if p.dim() > 1:
                p.mul_(1.5)
    replayed = scorer.score(batch)[0]["logprobs"]
    assert scorer.graphs.size == graphs_before
    eager = Scorer(model=scorer.model, spec=SPEC, layout=scorer.layout, device=CUDA)
    np.testing.assert_allclose(replayed, eager.score(batch)[0]["logprobs"], atol=0.1)
    assert np.abs(replayed - old).max() > 0.5
