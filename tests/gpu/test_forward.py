"""The consumer's forward on CUDA: packed documents, no device syncs, and CUDA graphs.

- Documents packed into one forward (adjacent ones of one length batched into one flash SDPA
  call) give each document's hidden states as scored alone, within bf16 tolerance.
- The packed forward issues no device sync (torch's sync debug mode raises on one): the host
  can queue the next layers while the device runs.
- A CUDA graph replay gives bit-identical outputs to the eager forward of the same layout,
  across layouts, evictions and a sleep (offload / onload) that moves the weights.
"""

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
from shared.messages import Job, TeacherRequest  # noqa: E402

SPEC = ModelSpec(
    family="qwen2",
    vocab_size=32000,
    hidden_size=512,
    num_layers=4,
    num_attention_heads=8,
    num_kv_heads=2,
    ffn_hidden_size=1408,
    max_position_embeddings=8192,
    qkv_bias=True,
)
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def model(layout):
    torch.manual_seed(0)
    m = build_model(SPEC, layout, params_dtype=torch.bfloat16, device=CUDA)
    with torch.no_grad():  # unit-scale weights: peaked predictions, so errors show
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5)
    return m


def _batch(lengths: list[int], seed: int, **opts):
    rng = np.random.default_rng(seed)
    jobs = []
    for i, n in enumerate(lengths):
        req = TeacherRequest(input_ids=rng.integers(0, SPEC.vocab_size, n), **opts)
        jobs.append(Job(job_id=f"j{i}", entry_id=f"0-{i}", request=req, submitted_at=0.0))
    return batch_from_jobs(jobs)


def _scorer(model, layout, graphs: GraphedForward | None = None) -> Scorer:
    return Scorer(model=model, spec=SPEC, layout=layout, device=CUDA, graphs=graphs)


def test_packed_documents_match_each_document_alone(model, layout) -> None:
    lengths = [512, 512, 512, 300, 700, 700]
    scorer = _scorer(model, layout)
    packed = scorer.hidden_states(_batch(lengths, seed=1)).float()
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in range(len(lengths)):
        ids = _batch(lengths, seed=1).input_ids_T[starts[i] : starts[i + 1]]
        alone = scorer.hidden_states(
            batch_from_jobs(
                [
                    Job(
                        job_id="a",
                        entry_id="0-0",
                        request=TeacherRequest(input_ids=ids.numpy()),
                        submitted_at=0.0,
                    )
                ]
            )
        ).float()
        torch.testing.assert_close(packed[starts[i] : starts[i + 1]], alone, atol=3e-2, rtol=3e-2)


def test_the_forward_and_head_never_wait_for_the_device(model, layout) -> None:
    scorer = _scorer(model, layout)
    batch = _batch([1024] * 4 + [512, 256], seed=2)
    tree = scorer.layout_of(batch)
    scorer.packed_hidden_states(tree)  # first use: the rotary table moves to the device
    torch.cuda.synchronize()
    full = _batch([1024] * 4 + [512, 256], seed=3, top_k=8, sample_n=2, return_entropy=True)
    scorer.score(full)  # first use of the head's kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scorer.packed_hidden_states(tree)
        pending = scorer.launch(full)  # forward, head and copies back: all queued
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.result()[0]["topk_token_ids"].shape == (1023, 8)


def test_graph_replays_equal_the_eager_forward(model, layout) -> None:
    eager = _scorer(model, layout)
    graphs = GraphedForward(model, max_graphs=2)
    graphed = _scorer(model, layout, graphs)
    layouts = [[1024] * 4, [700, 300, 1024], [1024] * 4, [2048, 2048], [700, 300, 1024]]
    for round_ in range(3):
        for i, lengths in enumerate(layouts):
            batch = _batch(lengths, seed=10 * round_ + i, top_k=8, sample_n=2, return_entropy=True)
            want, got = eager.score(batch), graphed.score(batch)
            for a, b in zip(want, got, strict=True):
                assert a.keys() == b.keys()
                for name in a:
                    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert graphs.captures >= 3 and graphs.replays > 0 and graphs.size == 2
    graphed.offload()  # sleep: the weights move, the graphs go
    assert graphs.size == 0
    graphed.onload()
    batch = _batch([1024] * 4, seed=99)
    for _ in range(3):
        assert all(
            np.array_equal(a["logprobs"], b["logprobs"])
            for a, b in zip(eager.score(batch), graphed.score(batch), strict=True)
        )
    assert graphs.size == 1


def test_shared_prompt_layouts_replay_too(model, layout) -> None:
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, SPEC.vocab_size, 600)
    jobs = [
        Job(
            job_id=f"r{i}",
            entry_id=f"0-{i}",
            submitted_at=0.0,
            request=TeacherRequest(
                input_ids=np.concatenate([prompt, rng.integers(0, SPEC.vocab_size, 200 + 50 * i)]),
                prefix_id="p",
                top_k=4,
            ),
        )
        for i in range(4)
    ]
    from consumer.forward.prefix import plan_shared_microbatches

    [group] = plan_shared_microbatches(jobs, token_budget=16384)
    batch = batch_from_jobs(group)
    assert batch.prefix_tokens_saved > 0
    graphs = GraphedForward(model, max_graphs=1)
    eager, graphed = _scorer(model, layout), _scorer(model, layout, graphs)
    for _ in range(3):
        for a, b in zip(eager.score(batch), graphed.score(batch), strict=True):
            np.testing.assert_array_equal(a["topk_token_ids"], b["topk_token_ids"])
            np.testing.assert_array_equal(a["logprobs"], b["logprobs"])
    assert graphs.captures == 1 and graphs.replays == 1  # eager, recorded, replayed


def test_fused_swiglu_matches_pytorch_in_fp32() -> None:
    pytest.importorskip("triton")
    from consumer.kernels.swiglu import swiglu

    gen = torch.Generator(device=CUDA).manual_seed(3)
    for rows, ffn in ((1, 7), (333, 1000), (4096, 8960)):
        x = (torch.randn(rows, 2 * ffn, device=CUDA, generator=gen) * 3).to(torch.bfloat16)
        gate, up = x.float().chunk(2, dim=-1)
        want = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
        out = torch.full((rows, ffn), float("nan"), dtype=torch.bfloat16, device=CUDA)
        out.copy_(swiglu(x))  # every element written: no NaN survives
        torch.testing.assert_close(out.float(), want.float(), atol=0, rtol=8e-3)
        # a strided view of a larger buffer (fc1's output as megatron hands it over: [s, 1, 2f])
        torch.testing.assert_close(swiglu(x[:, None]).squeeze(1), out, atol=0, rtol=0)


def test_fused_rope_matches_pytorch_in_fp32() -> None:
    pytest.importorskip("triton")
    from consumer.forward.attention import apply_rope
    from consumer.kernels.rope import rope

    gen = torch.Generator(device=CUDA).manual_seed(4)
    for rows, heads, dim in ((1, 1, 16), (777, 12, 128), (4096, 28, 128), (300, 6, 80)):
        # q as megatron's qkv split leaves it: a strided view into a wider per-row buffer
        mixed = torch.randn(rows, heads + 4, dim, device=CUDA, generator=gen).to(torch.bfloat16)
        x = mixed[:, 2 : 2 + heads]
        angles = torch.rand(rows, dim // 2, device=CUDA, generator=gen) * 1000
        cos, sin = angles.cos(), angles.sin()
        want = apply_rope(x.cpu().float(), cos.cpu(), sin.cpu())  # the CPU path, fp32
        got = rope(x, cos, sin)
        assert got.is_contiguous() and not got.isnan().any()
        torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=1e-2)


def test_batches_launched_back_to_back_through_one_graph_keep_their_own_outputs(
    model, layout
) -> None:
    """Two batches of one layout queued before either is collected: the second replays the
    graph the first used, overwriting its hidden-state buffer; each must still get its own
    outputs (the head reads a copy taken in stream order before the replay)."""
    eager = _scorer(model, layout)
    graphed = _scorer(model, layout, GraphedForward(model, max_graphs=2))
    a, b = (_batch([1024] * 4, seed=s, top_k=4, sample_n=2) for s in (40, 41))
    for _ in range(2):  # record the layout's graph
        graphed.score(a)
    first, second = graphed.launch(a), graphed.launch(b)
    got_b, got_a = second.result(), first.result()
    assert graphed.graphs is not None and graphed.graphs.replays == 2
    for got, batch in ((got_a, a), (got_b, b)):
        for g, w in zip(got, eager.score(batch), strict=True):
            for name in w:
                np.testing.assert_array_equal(g[name], w[name], err_msg=name)


def _random_batches(count: int, seed: int, tokens: int = 6000, **opts) -> list:
    """Batches of documents whose lengths never repeat, about `tokens` each (as traffic)."""
    rng = np.random.default_rng(seed)
    batches = []
    for i in range(count):
        lengths, total = [], 0
        while total < tokens - 700:
            lengths.append(int(rng.integers(40, 1500)))
            total += lengths[-1]
        batches.append(_batch(lengths, seed=seed + i, **opts))
    return batches


def _padded_reference(model, scorer: Scorer, batch) -> torch.Tensor:
    """The eager forward of a batch padded to its bucket, cut to the batch's rows: what a
    bucketed graph must replay bit for bit."""
    from consumer.forward.graphs import Bucket, _bucket_bounds, eager_forward

    tree = scorer.layout_of(batch)
    bucket = Bucket.of(tree.segments)
    rows = len(tree.input_ids_P)
    ids = torch.zeros(bucket.tokens, dtype=torch.long, device=CUDA)
    pos = torch.zeros(bucket.tokens, dtype=torch.long, device=CUDA)
    ids[:rows], pos[:rows] = tree.input_ids_P.to(CUDA), tree.position_P.to(CUDA)
    bounds = _bucket_bounds(bucket, max(tree.lengths) - 1, CUDA)
    with torch.inference_mode():
        hidden = eager_forward(model, ids, pos, bounds)[:rows]
        if tree.shared:  # each job's rows, as Scorer.hidden_states gives them
            return hidden[torch.as_tensor(tree.row_of_T, device=CUDA)]
        return hidden.clone()


def _check_forward(model, graphed: Scorer, eager: Scorer, batch) -> None:
    """The graphed scorer's hidden states: bit for bit the padded batch's eager forward where a
    bucketed graph served (recorded or replayed), else the plain eager forward's."""
    graphs = graphed.graphs
    assert graphs is not None
    before = graphs.captures + graphs.replays
    got = graphed.hidden_states(batch)
    if graphs.captures + graphs.replays > before:
        want = _padded_reference(model, graphed, batch)
    else:
        want = eager.hidden_states(batch)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_bucketed_graphs_replay_batches_of_lengths_never_seen(model, layout) -> None:
    """Batches whose lengths never repeat replay a few bucketed graphs: each replay equals the
    eager forward of the padded batch bit for bit, and the scores equal the unpadded eager
    forward's within bf16 tolerance."""
    graphs = GraphedForward(model, max_graphs=16, buckets=True, max_rows=8192)
    eager, graphed = _scorer(model, layout), _scorer(model, layout, graphs)
    batches = _random_batches(24, seed=100, top_k=4, return_entropy=True)
    for batch in batches:
        _check_forward(model, graphed, eager, batch)
        for a, b in zip(eager.score(batch), graphed.score(batch), strict=True):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=0.1, rtol=0)
            np.testing.assert_allclose(a["entropy"], b["entropy"], atol=0.1, rtol=0)
    keys = set(_keys(graphed, batches))
    assert len(keys) <= 12  # 24 batches of new lengths, fewer buckets
    assert graphs.captures == graphs.size == len(keys)
    # Two forwards per batch above, each a replay but the very first: that one is recorded
    # and keeps the eager run that precedes the first capture; later recordings replay.
    assert graphs.replays == 2 * len(batches) - 1


def _keys(scorer: Scorer, batches: list) -> list[tuple[int, ...]]:
    from consumer.forward.graphs import Bucket

    return [Bucket.of(scorer.layout_of(b).segments).key for b in batches]


def test_bucketed_graphs_serve_shared_prompts(model, layout) -> None:
    from consumer.forward.prefix import plan_shared_microbatches

    rng = np.random.default_rng(7)
    graphs = GraphedForward(model, max_graphs=4, buckets=True, max_rows=16384)
    eager, graphed = _scorer(model, layout), _scorer(model, layout, graphs)
    for g in range(6):  # GRPO groups: a prompt and responses of new lengths each time
        prompt = rng.integers(0, SPEC.vocab_size, int(rng.integers(300, 700)))
        jobs = [
            Job(
                job_id=f"g{g}r{i}",
                entry_id=f"0-{i}",
                submitted_at=0.0,
                request=TeacherRequest(
                    input_ids=np.concatenate(
                        [prompt, rng.integers(0, SPEC.vocab_size, int(rng.integers(50, 900)))]
                    ),
                    prefix_id=f"p{g}",
                    top_k=4,
                ),
            )
            for i in range(8)
        ]
        [group] = plan_shared_microbatches(jobs, token_budget=16384)
        batch = batch_from_jobs(group)
        assert batch.prefix_tokens_saved > 0
        for _ in range(2):
            _check_forward(model, graphed, eager, batch)
        for a, b in zip(eager.score(batch), graphed.score(batch), strict=True):
            np.testing.assert_array_equal(a["topk_token_ids"][:, 0], b["topk_token_ids"][:, 0])
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=0.1, rtol=0)
    assert graphs.replays > 0


def test_bucketed_recordings_and_replays_never_wait_for_the_device(model, layout) -> None:
    """After the first capture neither a replay nor recording a new bucket syncs the device:
    the host queues the batch behind whatever is still computing."""
    graphs = GraphedForward(model, max_graphs=4, buckets=True)
    graphed = _scorer(model, layout, graphs)
    first, second = _batch([900, 1100, 2000], seed=5), _batch([1000, 1000, 1990], seed=6)
    new_bucket = _batch([3000, 2500, 700, 900], seed=7)
    graphed.score(first)  # recorded the first time its bucket comes
    graphed.score(first)  # replayed
    torch.cuda.synchronize()
    assert graphs.captures == 1 and graphs.replays == 1
    eager = _scorer(model, layout)
    want = eager.score(new_bucket)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = graphed.launch(second)  # other lengths, same bucket: a replay
        recorded = graphed.launch(new_bucket)  # a new bucket: recorded, then replayed
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphs.captures == 2 and graphs.replays == 3
    assert pending.result()[0]["logprobs"].shape == (999,)
    for a, b in zip(want, recorded.result(), strict=True):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=0.1, rtol=0)


def test_full_bucketed_graphs_do_not_record_on_every_batch(model, layout) -> None:
    """More buckets in rotation than graphs kept: captures stay bounded by the replays instead
    of one per batch."""
    graphs = GraphedForward(model, max_graphs=1, buckets=True)
    graphed = _scorer(model, layout, graphs)
    shapes = [[600, 600], [1500, 1500], [3000, 2000]]  # three buckets
    for i in range(30):
        graphed.hidden_states(_batch(shapes[i % 3], seed=i))
    assert graphs.size == 1
    assert graphs.captures <= 1 + graphs.replays // 8 + 1
