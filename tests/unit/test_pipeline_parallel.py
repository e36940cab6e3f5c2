"""Pipeline parallelism (#24) on gloo: a replica's layers split over stages score as one model.

Every layout scores the same batch (documents of mixed lengths, two responses sharing a prompt,
top-k, samples, labels, entropy) from the same Hugging Face checkpoint; the leader's outputs
are compared with transformers' float32 log-probs (<= 2e-3) and with pp = 1 (log-probs within
float32 reduction noise, samples and top-k ids identical). The checkpoints have 3 layers, so
pp = 2 splits them unevenly (2 + 1); one of them ties its embeddings, so the last stage reads
its output weight from the embedding itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gloo import run_gloo
from tests.reference import hf_token_logprobs
from tests.timing import scaled

ATOL_HF = 2e-3
ATOL_PP1 = 1e-4
LENGTHS = [9, 14, 6, 11, 8, 13]
VOCAB = 300


def _requests() -> list[dict]:
    gen = np.random.default_rng(7)
    prompt = gen.integers(0, VOCAB, 6).tolist()
    out = []
    for j, n in enumerate(LENGTHS):
        req: dict = {
            "input_ids": gen.integers(0, VOCAB, n).tolist(),
            "top_k": 3,
            "sample_n": 2,
            "seed": 11 + j,
            "temperature": 1.0 if j % 2 else 0.8,
            "return_entropy": j == 1,
        }
        if j == 2:
            req["label_token_ids"] = gen.integers(0, VOCAB, (n - 1, 2)).tolist()
        if j in (3, 4):  # two responses to one prompt: packed as a prompt and its responses
            req["input_ids"] = prompt + req["input_ids"]
            req["prefix_id"] = "p"
        out.append(req)
    return out


def _jobs(requests: list[dict]) -> list:
    from shared.messages import Job, TeacherRequest

    return [
        Job(job_id=f"j{i}", entry_id=f"{i}-0", request=TeacherRequest(**r), submitted_at=0)
        for i, r in enumerate(requests)
    ]


def _scorer(tp: int, pp: int, path: str, microbatches: int = 0, ep: int = 1):
    from consumer import cpu_compat
    from consumer.checkpoints import load_teacher
    from consumer.forward.pipeline import PipelineScorer
    from consumer.forward.scoring import Scorer
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=tp, pp=pp, ep=ep)
    model, spec, _ = load_teacher(path, layout, params_dtype=torch.float32, device="cpu")
    common = {"model": model, "spec": spec, "layout": layout, "device": torch.device("cpu")}
    if pp == 1:
        return Scorer(**common)
    return PipelineScorer(**common, microbatches=microbatches)


def _score_worker(
    rank: int, world: int, tp: int, pp: int, path: str, microbatches: int, ep: int = 1
):
    from consumer.group.agreement import score_agreed
    from consumer.group.batching import batch_from_jobs
    from consumer.group.faults import FaultInjector

    scorer = _scorer(tp, pp, path, microbatches, ep)
    layout = scorer.layout
    span = layout.replica_size * pp  # replicas of consecutive ranks, stage by stage
    assert layout.leader_rank == rank - rank % span and layout.dp == world // span
    assert layout.pp_rank == rank % span // layout.replica_size and layout.tp_rank == rank % tp
    batch = batch_from_jobs(_jobs(_requests()))
    outputs, phases = score_agreed(scorer, batch, FaultInjector(None, rank=rank))
    assert len(phases) == span  # every rank of the replica
    layers = len(scorer.model.decoder.layers)
    return {"outputs": outputs if layout.is_leader else None, "layers": layers}


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint) -> dict:
    return {
        "qwen2_tied": hf_checkpoint(
            "qwen2", "pp-qwen2-tied", seed=31, vocab_size=VOCAB, num_layers=3, tie_embeddings=True
        ),
        "llama": hf_checkpoint("llama", "pp-llama", seed=32, vocab_size=VOCAB, num_layers=3),
    }


@pytest.fixture(scope="module")
def pp1(checkpoints) -> dict:
    return {
        name: run_gloo(1, _score_worker, 1, 1, str(path), 0, timeout=scaled(120))[0]["outputs"]
        for name, path in checkpoints.items()
    }


def _compare(got: list[dict], want: list[dict], path, requests: list[dict]) -> None:
    assert len(got) == len(want) == len(requests)
    for j, (g, w, req) in enumerate(zip(got, want, requests, strict=True)):
        assert set(g) == set(w), j
        ref = hf_token_logprobs(path, req["input_ids"])
        if req["temperature"] == 1.0:
            np.testing.assert_allclose(g["logprobs"], ref, atol=ATOL_HF, rtol=0)
        for key, value in g.items():
            if value.dtype.kind in "iu":  # ids: top-k and samples exactly as at pp = 1
                np.testing.assert_array_equal(value, w[key], err_msg=f"job {j} {key}")
            else:
                np.testing.assert_allclose(value, w[key], atol=ATOL_PP1, rtol=0, err_msg=key)


@pytest.mark.parametrize("case", ["qwen2_tied", "llama"])
def test_pp2_matches_transformers_and_pp1(case, checkpoints, pp1) -> None:
    results = run_gloo(2, _score_worker, 1, 2, str(checkpoints[case]), 0, timeout=scaled(180))
    assert [r["layers"] for r in results] == [2, 1]  # 3 layers: the first stage takes the extra
    _compare(results[0]["outputs"], pp1[case], checkpoints[case], _requests())


def test_two_pipeline_replicas_in_one_launch(checkpoints, pp1) -> None:
    # dp = 2 x pp = 2: ranks 0-1 and 2-3 are two replicas, each leader gets every output.
    results = run_gloo(4, _score_worker, 1, 2, str(checkpoints["llama"]), 0, timeout=scaled(240))
    assert results[1]["outputs"] is None and results[3]["outputs"] is None
    for leader in (0, 2):
        _compare(results[leader]["outputs"], pp1["llama"], checkpoints["llama"], _requests())


def test_tp2_pp2_matches_transformers_and_pp1(checkpoints, pp1) -> None:
    results = run_gloo(
        4, _score_worker, 2, 2, str(checkpoints["qwen2_tied"]), 0, timeout=scaled(240)
    )
    assert [r["layers"] for r in results] == [2, 2, 1, 1]
    _compare(results[0]["outputs"], pp1["qwen2_tied"], checkpoints["qwen2_tied"], _requests())


def test_moe_ep2_pp2_matches_transformers_and_pp1(hf_checkpoint) -> None:
    # A mixture-of-experts teacher: each stage splits its experts over its own two ranks.
    path = str(
        hf_checkpoint(
            "qwen3_moe", "pp-qwen3-moe", seed=33, vocab_size=VOCAB, num_layers=3, num_experts=4
        )
    )
    [want] = run_gloo(1, _score_worker, 1, 1, path, 0, timeout=scaled(120))
    results = run_gloo(4, _score_worker, 1, 2, path, 0, 2, timeout=scaled(240))
    assert [r["layers"] for r in results] == [2, 2, 1, 1]
    _compare(results[0]["outputs"], want["outputs"], path, _requests())


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_torch_dist_checkpoint_loads_by_stage(tp, checkpoints, pp1, layout, tmp_path) -> None:
    # A torch_dist checkpoint written at pp = 1 (stacked layer tensors) loads at pp = 2 (and
    # TP = 2 x pp = 2): each stage reads its slice of the layer axis.
    from consumer.checkpoints import load_hf_checkpoint, save_megatron_checkpoint

    model, spec = load_hf_checkpoint(checkpoints["qwen2_tied"], layout)
    save_megatron_checkpoint(model, tmp_path / "mg", spec=spec)
    results = run_gloo(tp * 2, _score_worker, tp, 2, str(tmp_path / "mg"), 0, timeout=scaled(240))
    _compare(results[0]["outputs"], pp1["qwen2_tied"], checkpoints["qwen2_tied"], _requests())


def test_moe_torch_dist_checkpoint_loads_by_stage(hf_checkpoint, layout, tmp_path) -> None:
    # MoE torch_dist checkpoints key each layer by its index: a stage loads its layers' keys.
    from consumer.checkpoints import load_hf_checkpoint, save_megatron_checkpoint

    path = hf_checkpoint(
        "qwen3_moe", "pp-qwen3-moe", seed=33, vocab_size=VOCAB, num_layers=3, num_experts=4
    )
    model, spec = load_hf_checkpoint(path, layout)
    save_megatron_checkpoint(model, tmp_path / "mg", spec=spec)
    [want] = run_gloo(1, _score_worker, 1, 1, str(path), 0, timeout=scaled(120))
    results = run_gloo(2, _score_worker, 1, 2, str(tmp_path / "mg"), 0, timeout=scaled(240))
    _compare(results[0]["outputs"], want["outputs"], path, _requests())


def test_one_microbatch_and_many_agree(checkpoints, pp1) -> None:
    # One micro-batch at a time (no overlap) and more micro-batches than documents allow.
    path = str(checkpoints["llama"])
    for microbatches in (1, 50):
        results = run_gloo(2, _score_worker, 1, 2, path, microbatches, timeout=scaled(180))
        _compare(results[0]["outputs"], pp1["llama"], path, _requests())


def _failing_stage_worker(rank: int, world: int, path: str, failing_rank: int):
    from consumer.group.agreement import GroupFailure, score_agreed
    from consumer.group.batching import batch_from_jobs
    from consumer.group.faults import FaultInjector

    scorer = _scorer(1, 2, path)
    batch = batch_from_jobs(_jobs(_requests()))
    faults = FaultInjector(None, rank=rank)
    model = scorer.model
    if rank == failing_rank:  # this stage fails on its second micro-batch
        calls = {"n": 0}
        original = model.forward

        def failing(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected stage failure")
            return original(*args, **kwargs)

        model.forward = failing
    failed = None
    try:
        score_agreed(scorer, batch, faults)
    except GroupFailure as exc:
        failed = str(exc)
    if rank == failing_rank:
        model.forward = original
    outputs, _ = score_agreed(scorer, batch, faults)  # the next batch is unaffected
    return {"failed": failed, "outputs": outputs if scorer.layout.is_leader else None}


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failing_stage_fails_the_batch_on_every_stage(checkpoints, pp1, failing_rank) -> None:
    path = str(checkpoints["llama"])
    results = run_gloo(2, _failing_stage_worker, path, failing_rank, timeout=scaled(180))
    assert all(r["failed"] for r in results), results
    assert "injected stage failure" in results[failing_rank]["failed"]
    _compare(results[0]["outputs"], pp1["llama"], path, _requests())


def test_micro_batches_keep_documents_and_shared_prompts_whole() -> None:
    from consumer.forward.pipeline import document_cuts, split_rows

    # documents [0,5) [5,9); a prompt [9,12) with responses [12,15) and [15,20); a document.
    segments = ((0, 5, 0, 0), (5, 9, 5, 5), (9, 12, 9, 9), (12, 15, 9, 12), (15, 20, 9, 12))
    segments = (*segments, (20, 26, 20, 20))
    assert document_cuts(segments) == [0, 5, 9, 20]
    assert split_rows(segments, 3) == [range(0, 9), range(9, 20), range(20, 26)]
    assert split_rows(segments, 1) == [range(0, 26)]
    assert split_rows(segments, 10) == [range(0, 5), range(5, 9), range(9, 20), range(20, 26)]


def test_stage_layers_split_and_refusal() -> None:
    from consumer.forward.model import stage_layers

    assert [len(stage_layers(32, 3, s)) for s in range(3)] == [11, 11, 10]
    assert [stage_layers(3, 2, s) for s in range(2)] == [range(0, 2), range(2, 3)]
    assert stage_layers(80, 4, 3) == range(60, 80)
    with pytest.raises(ValueError, match="pp=4 exceeds the model's 3 layers"):
        stage_layers(3, 4, 0)


def test_layout_accepts_pipelines() -> None:
    from consumer.parallel import LayoutError, check_layout

    assert check_layout(world_size=8, tp=2, pp=2) == 2
    assert check_layout(world_size=8, tp=1, pp=4, ep=2) == 1
    with pytest.raises(LayoutError, match="multiple of 4"):
        check_layout(world_size=6, tp=2, pp=2)


def _peer_gone_worker(rank: int, world: int, path: str):
    import time

    from consumer.forward.peers import ReplicaBroken
    from consumer.group.agreement import score_agreed
    from consumer.group.batching import batch_from_jobs
    from consumer.group.faults import FaultInjector

    scorer = _scorer(1, 2, path)
    batch = batch_from_jobs(_jobs(_requests()))
    faults = FaultInjector(None, rank=rank)
    score_agreed(scorer, batch, faults)
    if rank == 1:
        return "left"  # the last stage leaves: its connections close
    time.sleep(2.0)
    try:
        score_agreed(scorer, batch, faults)
    except ReplicaBroken as exc:
        return f"broken: {exc}"
    except Exception as exc:  # noqa: BLE001 - the test reports what it got instead
        return f"wrong kind: {type(exc).__name__}: {exc}"
    return "scored without its last stage"


def test_a_vanished_stage_breaks_the_replica_instead_of_failing_jobs(checkpoints) -> None:
    # A stage that is gone is not the batch's fault: the leader must not fail (and in the end
    # dead-letter) jobs for it, but end with ReplicaBroken (the process exits; see
    # consumer/group/agreement.py), so its entries go to another consumer.
    results = run_gloo(2, _peer_gone_worker, str(checkpoints["llama"]), timeout=scaled(120))
    assert results[1] == "left"
    assert results[0].startswith("broken: ") and "a peer rank is gone" in results[0], results[0]


def _random_init_worker(rank: int, world: int, pp: int, tied: bool):
    import dataclasses

    from consumer import cpu_compat
    from consumer.forward.model import TINY, build_model
    from consumer.forward.pipeline import PipelineScorer
    from consumer.forward.scoring import Scorer
    from consumer.group.batching import batch_from_jobs
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=1, pp=pp)
    spec = dataclasses.replace(TINY, num_layers=3, tie_embeddings=tied)
    model = build_model(spec, layout)
    kind = PipelineScorer if pp > 1 else Scorer
    scorer = kind(model=model, spec=spec, layout=layout, device=torch.device("cpu"))
    requests = [{k: v for k, v in r.items() if k != "label_token_ids"} for r in _requests()]
    outputs = scorer.score(batch_from_jobs(_jobs(requests)))
    return outputs if layout.is_leader else None


@pytest.mark.parametrize("tied", [False, True])
def test_random_weights_are_one_teacher_whatever_the_stages(tied) -> None:
    # The tiny preset (random weights from a seed) is the same model at pp = 2 as at pp = 1:
    # each stage keeps its part of the whole model drawn as at pp = 1.
    [want] = run_gloo(1, _random_init_worker, 1, tied, timeout=scaled(120))
    got = run_gloo(2, _random_init_worker, 2, tied, timeout=scaled(120))[0]
    for g, w in zip(got, want, strict=True):
        for key, value in g.items():
            if value.dtype.kind in "iu":
                np.testing.assert_array_equal(value, w[key], err_msg=key)
            else:
                np.testing.assert_allclose(value, w[key], atol=ATOL_PP1, rtol=0, err_msg=key)


def _save_worker(rank: int, world: int, tp: int, pp: int, path: str, out: str, ep: int = 1):
    from consumer.checkpoints import save_megatron_checkpoint

    scorer = _scorer(tp, pp, path, ep=ep)
    save_megatron_checkpoint(scorer.model, out, spec=scorer.spec)
    return len(scorer.model.decoder.layers)


def _saved_by_stages_scores_at_pp1(path, out, want: list[dict], *, tp=1, ep=1) -> None:
    """Save a pp = 2 model (each stage its own layers, under their global indices) and load
    the checkpoint whole at pp = 1: it scores as `want`."""
    world = 2 * max(tp, ep)
    layers = run_gloo(world, _save_worker, tp, 2, str(path), str(out), ep, timeout=scaled(240))
    assert sorted(set(layers)) == [1, 2]  # 3 layers over two stages: 2 + 1
    [got] = run_gloo(1, _score_worker, 1, 1, str(out), 0, timeout=scaled(120))
    assert got["layers"] == 3
    _compare(got["outputs"], want, path, _requests())


def test_torch_dist_checkpoint_saved_by_stages_loads_at_pp1(checkpoints, pp1, tmp_path):
    path = checkpoints["qwen2_tied"]
    _saved_by_stages_scores_at_pp1(path, tmp_path / "mg", pp1["qwen2_tied"])


@pytest.mark.slow
def test_torch_dist_checkpoint_saved_by_tp2_stages_loads_at_pp1(checkpoints, pp1, tmp_path):
    path = checkpoints["llama"]
    _saved_by_stages_scores_at_pp1(path, tmp_path / "mg", pp1["llama"], tp=2)


@pytest.mark.parametrize("ep", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_moe_torch_dist_checkpoint_saved_by_stages_loads_at_pp1(ep, hf_checkpoint, tmp_path):
    # Expert blocks, router and dense layers alike: each written once, by its stage.
    path = hf_checkpoint(
        "qwen3_moe", "pp-qwen3-moe", seed=33, vocab_size=VOCAB, num_layers=3, num_experts=4
    )
    [want] = run_gloo(1, _score_worker, 1, 1, str(path), 0, timeout=scaled(120))
    _saved_by_stages_scores_at_pp1(path, tmp_path / "mg", want["outputs"], ep=ep)
