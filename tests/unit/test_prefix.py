"""Shared-prefix packing scores every job exactly as it is scored alone.

The planner and the packed layout are checked on plain jobs; the numerics on real Hugging Face
checkpoints (unit-scale random weights, so predictions are peaked and a wrong position, mask or
prompt shows up), TP = 1 in this process and TP = 2 on two gloo ranks, each against the
unshared path: every job scored alone. Tolerances: log-probs within 2e-5 (only reduction order
differs between the two forwards); token ids (top-k, samples) identical.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from consumer.forward.prefix import (
    MIN_SHARED_PREFIX,
    MicroBatch,
    PrefixGroup,
    find_shared_prefixes,
    pack_tree,
    plan_shared_microbatches,
)
from shared.messages import Job, Limits, TeacherRequest, decode_job, encode_job
from tests.gloo import run_gloo
from tests.timing import scaled

ATOL = 2e-5
VOCAB = 300
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
CASES = {
    "llama3_rope": {"family": "llama", "rope_theta": 500000.0, "rope_scaling": LLAMA3},
    "linear_rope": {"family": "qwen3", "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "qwen3_qknorm_head_dim": {"family": "qwen3", "head_dim": 32},
    "one_kv_head": {"family": "llama", "num_kv_heads": 1},  # multi-query: K/V heads expanded
}
ARRAYS = (
    "logprobs",
    "label_logprobs",
    "topk_logprobs",
    "topk_rest_logprob",
    "sampled_logprobs",
    "entropy",
)
IDS = ("topk_token_ids", "sampled_token_ids")


def _job(ids, i: int = 0, **opts) -> Job:
    req = TeacherRequest(input_ids=np.asarray(ids, dtype=np.int64), **opts)
    return Job(job_id=f"j{i}", entry_id=f"0-{i}", request=req, submitted_at=0.0)


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n)


# ---------------------------------------------------------------------------------------------
# Finding and planning


def test_prefix_id_groups_share_their_common_prefix_whatever_its_length() -> None:
    rng = np.random.default_rng(0)
    prompt = _tokens(rng, 10)  # far below MIN_SHARED_PREFIX
    jobs = [
        _job(np.concatenate([prompt, _tokens(rng, 5)]), 0, prefix_id="g"),
        _job(_tokens(rng, 30), 1),
        _job(np.concatenate([prompt, _tokens(rng, 7)]), 2, prefix_id="g"),
        _job(prompt, 3, prefix_id="g"),  # the bare prompt: capped so it keeps a token
        _job(np.concatenate([prompt, _tokens(rng, 5)]), 4, prefix_id="lonely"),
    ]
    assert find_shared_prefixes(jobs) == [PrefixGroup((0, 2, 3), 9)]


def test_identical_leading_runs_are_found_above_the_threshold_only() -> None:
    rng = np.random.default_rng(1)
    long_prompt, short_prompt = _tokens(rng, MIN_SHARED_PREFIX), _tokens(rng, MIN_SHARED_PREFIX - 1)
    jobs = [_job(np.concatenate([long_prompt, _tokens(rng, 3 + i)]), i) for i in range(3)]
    jobs += [_job(np.concatenate([short_prompt, _tokens(rng, 3)]), 3 + i) for i in range(2)]
    assert find_shared_prefixes(jobs) == [PrefixGroup((0, 1, 2), MIN_SHARED_PREFIX)]
    assert find_shared_prefixes(jobs, min_prefix_tokens=None) == []
    assert find_shared_prefixes(jobs, min_prefix_tokens=MIN_SHARED_PREFIX - 1) == [
        PrefixGroup((0, 1, 2), MIN_SHARED_PREFIX),
        PrefixGroup((3, 4), MIN_SHARED_PREFIX - 1),
    ]


def test_two_prompts_agreeing_on_a_stem_become_two_groups() -> None:
    # A and B share 80 tokens, then run 200 more tokens each: two groups of ~280 save far more
    # than one group of 80; one lone job sharing only the stem joins neither.
    rng = np.random.default_rng(2)
    stem = _tokens(rng, 80)
    a, b = np.concatenate([stem, _tokens(rng, 200)]), np.concatenate([stem, _tokens(rng, 200)])
    jobs = []
    for i in range(6):
        prompt = a if i % 2 else b
        jobs.append(_job(np.concatenate([prompt, _tokens(rng, 4)]), i))
    jobs.append(_job(np.concatenate([stem, _tokens(rng, 50)]), 6))
    groups = find_shared_prefixes(jobs, min_prefix_tokens=16)
    assert sorted(groups, key=lambda g: g.members) == [
        PrefixGroup((0, 2, 4), 280),
        PrefixGroup((1, 3, 5), 280),
    ]


def test_planner_counts_each_prompt_once_against_the_budget() -> None:
    rng = np.random.default_rng(3)
    prompt = _tokens(rng, 200)
    jobs = [_job(np.concatenate([prompt, _tokens(rng, 50)]), i, prefix_id="p") for i in range(8)]
    jobs.insert(3, _job(_tokens(rng, 100), 99))
    # Unshared the group needs 8 * 250 = 2000 tokens; shared, 200 + 8 * 50 = 600, and with the
    # other job 700: one micro-batch.
    [batch] = plan_shared_microbatches(jobs, token_budget=700)
    assert sorted(j.job_id for j in batch) == sorted(j.job_id for j in jobs)
    assert batch.prefix_tokens_saved == 7 * 200
    assert batch.computed_tokens == 700
    [group] = batch.groups
    assert [batch[m].request.prefix_id for m in group.members] == ["p"] * 8


def test_a_group_over_budget_is_cut_into_chunks_that_repeat_the_prompt() -> None:
    rng = np.random.default_rng(4)
    prompt = _tokens(rng, 200)
    jobs = [_job(np.concatenate([prompt, _tokens(rng, 100)]), i) for i in range(7)]
    jobs.append(_job(_tokens(rng, 900), 7))  # longer than the budget: runs alone
    batches = plan_shared_microbatches(jobs, token_budget=500, min_prefix_tokens=32)
    assert sorted(j.job_id for b in batches for j in b) == sorted(j.job_id for j in jobs)
    for b in batches:
        assert b.computed_tokens <= 500 or len(b) == 1
        for g in b.groups:
            assert g.prefix_len == 200 and len(g.members) >= 2
    # 7 responses of 100 behind a 200-token prompt: chunks of 3, 3 and 1 (alone).
    assert sorted(len(g.members) for b in batches for g in b.groups) == [3, 3]
    assert sum(b.prefix_tokens_saved for b in batches) == 2 * 2 * 200


def test_plain_job_lists_still_plan_and_pack_without_sharing() -> None:
    from consumer.group.batching import batch_from_jobs

    rng = np.random.default_rng(5)
    prompt = _tokens(rng, 100)
    jobs = [_job(np.concatenate([prompt, _tokens(rng, 5)]), i) for i in range(3)]
    batch = batch_from_jobs(jobs)  # a plain list: no plan, no sharing
    assert batch.group_J.tolist() == [-1, -1, -1] and batch.prefix_tokens_saved == 0
    shared = batch_from_jobs(plan_shared_microbatches(jobs, token_budget=1000)[0])
    assert shared.group_J.tolist() == [0, 0, 0] and shared.prefix_tokens_saved == 200


# ---------------------------------------------------------------------------------------------
# The packed layout


def _tree_of(jobs: list[Job], groups: list[PrefixGroup]):
    from consumer.group.batching import batch_from_jobs

    batch = batch_from_jobs(MicroBatch(jobs, groups))
    return batch, pack_tree(batch.input_ids_T, batch.lengths_J, batch.group_J, batch.prefix_len_J)


def test_pack_tree_lays_each_prompt_once_with_positions_continuing() -> None:
    jobs = [
        _job([1, 2, 3, 4, 5], 0),
        _job([9, 8, 7, 10, 11], 1),
        _job([7, 7], 2),
        _job([9, 8, 7, 12], 3),
    ]
    batch, tree = _tree_of(jobs, [PrefixGroup((1, 3), 3)])
    assert tree.input_ids_P.tolist() == [1, 2, 3, 4, 5, 9, 8, 7, 10, 11, 7, 7, 12]
    assert tree.position_P.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 3]
    assert tree.segments == (
        (0, 5, 0, 0),
        (5, 8, 5, 5),
        (8, 10, 5, 8),
        (10, 12, 10, 10),
        (12, 13, 5, 8),
    )
    # Every job token is found at its packed row: the invariant the scorer relies on.
    assert torch.equal(tree.input_ids_P[tree.row_of_T], batch.input_ids_T)
    assert tree.tokens_saved == 3


@pytest.mark.parametrize(
    ("second", "prefix", "match"),
    [
        ([9, 8, 6, 12], 3, "do not share their prompt"),
        ([9, 8, 7], 3, "cannot share a prompt of 3 tokens"),
    ],
)
def test_pack_tree_refuses_an_inconsistent_plan(second, prefix, match) -> None:
    jobs = [_job([9, 8, 7, 10], 0), _job(second, 1)]
    with pytest.raises(ValueError, match=match):
        _tree_of(jobs, [PrefixGroup((0, 1), prefix)])


def test_prefix_id_travels_on_the_wire_only_when_set() -> None:
    req = TeacherRequest(input_ids=[1, 2, 3], prefix_id="grpo-17")
    fields = {
        k.encode(): (v if isinstance(v, bytes) else str(v).encode())
        for k, v in encode_job(req, job_id="a").items()
    }
    assert decode_job("1-0", fields, limits=Limits()).request.prefix_id == "grpo-17"
    plain = encode_job(TeacherRequest(input_ids=[1, 2, 3]), job_id="b")
    assert "prefix_id" not in plain["meta"]


# ---------------------------------------------------------------------------------------------
# Numerics: shared against each job alone


def _workload(seed: int) -> tuple[list[Job], int]:
    """Two prompt groups (one by prefix_id, one found automatically), and lone jobs; options
    vary inside each group so that some jobs share head rows and some only hidden states."""
    rng = np.random.default_rng(seed)
    jobs: list[Job] = []
    for g, (p, n) in enumerate([(37, 4), (70, 5)]):
        prompt = _tokens(rng, p)
        for r in range(n):
            ids = np.concatenate([prompt, _tokens(rng, int(rng.integers(1, 25)))])
            if r < 3:  # same seed, temperature and kinds of output: one head row per row
                opts = {
                    "seed": 11,
                    "temperature": 0.8,
                    "top_k": [3, 5, 2][r],
                    "sample_n": [4, 2, 3][r],
                    "return_entropy": True,
                }
            else:  # the hidden states are shared, the head runs per job
                opts = {
                    "seed": 20 + r,
                    "temperature": [1.0, 1.7][r % 2],
                    "top_k": [0, 4][r % 2],
                    "sample_n": [2, 0][r % 2],
                    "return_entropy": r % 2 == 0,
                }
            if r in (1, 4):
                opts["label_token_ids"] = rng.integers(0, VOCAB, size=(len(ids) - 1, r // 2 + 1))
            if g == 0:
                opts["prefix_id"] = "first"
            jobs.append(_job(ids, len(jobs), **opts))
        jobs.insert(2, _job(_tokens(rng, 30), 100 + g, top_k=4, sample_n=2, seed=5))
    return jobs, 32  # automatic threshold: the 70-token prompt qualifies


def _assert_same(shared: dict, alone: dict, name: str) -> None:
    assert shared.keys() == alone.keys(), name
    for key in ARRAYS:
        if key in alone:
            assert shared[key].shape == alone[key].shape, (name, key)
            np.testing.assert_allclose(shared[key], alone[key], atol=ATOL, rtol=0, err_msg=name)
    for key in IDS:
        if key in alone:
            np.testing.assert_array_equal(shared[key], alone[key], err_msg=f"{name} {key}")


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint) -> dict:
    paths = {}
    for i, (name, case) in enumerate(CASES.items()):
        case = dict(case)
        family = case.pop("family")
        paths[name] = hf_checkpoint(
            family, f"prefix-{name}", seed=50 + i, **{"vocab_size": VOCAB, **case}
        )
    return paths


def _scorer(path, layout):
    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward.scoring import Scorer

    model, spec = load_hf_checkpoint(path, layout)
    return Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu"))


def _score_shared(scorer, jobs: list[Job], threshold: int) -> tuple[MicroBatch, list[dict]]:
    from consumer.group.batching import batch_from_jobs

    [plan] = plan_shared_microbatches(jobs, token_budget=10_000, min_prefix_tokens=threshold)
    return plan, scorer.score(batch_from_jobs(plan))


def _score_alone(scorer, jobs) -> dict[str, dict]:
    from consumer.group.batching import batch_from_jobs

    return {job.job_id: scorer.score(batch_from_jobs([job]))[0] for job in jobs}


@pytest.mark.parametrize("case", list(CASES))
def test_shared_prompts_score_as_each_job_alone(case, layout, checkpoints, monkeypatch) -> None:
    from consumer.forward import scoring

    scorer = _scorer(checkpoints[case], layout)
    jobs, threshold = _workload(seed=7)
    head_rows: list[int] = []
    chunked_head = scoring.tp_ops.chunked_head

    def counting_head(**kwargs):
        head_rows.append(kwargs["hidden_TH"].shape[0])
        return chunked_head(**kwargs)

    monkeypatch.setattr(scoring.tp_ops, "chunked_head", counting_head)
    plan, shared = _score_shared(scorer, jobs, threshold)
    monkeypatch.undo()
    assert sorted((len(g.members), g.prefix_len) for g in plan.groups) == [(4, 37), (5, 70)]
    alone = _score_alone(scorer, jobs)
    for job, result in zip(plan, shared, strict=True):
        _assert_same(result, alone[job.job_id], f"{case} {job.job_id}")
    # The forward skipped the repeats; the head computed the prompt rows of the three jobs of
    # each group that agree on seed, temperature and kinds of output once, every other row
    # once per job.
    scored_rows = sum(j.request.num_tokens - 1 for j in jobs)
    assert plan.prefix_tokens_saved == 3 * 37 + 4 * 70
    assert sum(head_rows) == scored_rows - 2 * (37 + 70)


def test_positions_continue_from_the_prompt(layout, checkpoints) -> None:
    # Negative control: the same packing with positions restarting at 0 in each response
    # (what megatron's per-segment RoPE would do) must leave the tolerance by far.
    from consumer.group.batching import batch_from_jobs

    scorer = _scorer(checkpoints["llama3_rope"], layout)
    jobs, threshold = _workload(seed=8)
    [plan] = plan_shared_microbatches(jobs, token_budget=10_000, min_prefix_tokens=threshold)
    batch = batch_from_jobs(plan)
    tree = scorer.layout_of(batch)
    restarted = torch.cat([torch.arange(end - start) for start, end, _c0, _c1 in tree.segments])
    right = scorer.packed_hidden_states(tree)
    wrong = scorer.packed_hidden_states(dataclasses.replace(tree, position_P=restarted))
    moved = restarted != tree.position_P
    assert bool(moved.any())
    assert torch.allclose(right[~moved], wrong[~moved], atol=1e-5)  # prompts and lone jobs
    assert (right[moved] - wrong[moved]).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------
# TP = 2


def _tp2_worker(rank: int, world_size: int, paths: dict[str, str]) -> dict:
    from consumer import cpu_compat
    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward.scoring import Scorer
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=world_size, pp=1)
    out = {}
    for name, path in paths.items():
        model, spec = load_hf_checkpoint(path, layout)
        scorer = Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu"))
        jobs, threshold = _workload(seed=9)
        plan, shared = _score_shared(scorer, jobs, threshold)
        out[name] = {job.job_id: result for job, result in zip(plan, shared, strict=True)}
    return out


def test_tp2_shared_prompts_score_as_each_job_alone_at_tp1(layout, checkpoints) -> None:
    names = ["llama3_rope", "qwen3_qknorm_head_dim"]
    ranks = run_gloo(2, _tp2_worker, {n: str(checkpoints[n]) for n in names}, timeout=scaled(180))
    jobs, _ = _workload(seed=9)
    for name in names:
        alone = _score_alone(_scorer(checkpoints[name], layout), jobs)
        for job in jobs:
            for rank in ranks:
                _assert_same(rank[name][job.job_id], alone[job.job_id], f"{name} {job.job_id}")
