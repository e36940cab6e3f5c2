"""Mixture-of-experts teachers (#23): Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints written by
transformers, scored through the real Scorer at TP=1, EP=2, TP=2 and TP=2 x EP=2 on gloo, against
transformers' own forward (float32; router weights drawn large so that the choice of experts is
decisive). Also: the expert GEMM alone, MoE validation, and batch independence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumer.checkpoints import CheckpointError
from consumer.group.batching import batch_from_jobs
from shared.messages import Job, TeacherRequest
from tests.gloo import run_gloo
from tests.reference import hf_full_log_softmax
from tests.timing import scaled

ATOL = 2e-3
VOCAB = 300
TOP_K = 3
CASES = {
    # norm_topk_prob, a dense layer from mlp_only_layers, q/k norms with a head_dim of its own
    "qwen3_moe": {"family": "qwen3_moe", "num_layers": 3, "mlp_only_layers": (1,),
                  "norm_topk_prob": True, "head_dim": 16},
    # shared expert with its sigmoid gate, qkv biases, dense layer 0 from decoder_sparse_step
    "qwen2_moe": {"family": "qwen2_moe", "decoder_sparse_step": 2},
    # experts as wide as intermediate_size, always renormalised, w1/w2/w3 names on disk
    "mixtral": {"family": "mixtral", "intermediate_size": 64},
}  # fmt: skip
LENGTHS = [9, 14, 6, 11]


@pytest.fixture(scope="module")
def moe_checkpoints(hf_checkpoint) -> dict[str, str]:
    return {
        name: str(
            hf_checkpoint(
                case["family"],
                f"moe-{name}",
                seed=5,
                vocab_size=VOCAB,
                num_kv_heads=4,  # four KV heads: TP=4 is possible in the slow layout
                **{k: v for k, v in case.items() if k != "family"},
            )
        )
        for name, case in CASES.items()
    }


def _jobs(lengths: list[int], seed: int) -> list[Job]:
    rng = np.random.default_rng(seed)
    return [
        Job(
            job_id=f"j{i}",
            entry_id=f"0-{i}",
            submitted_at=0.0,
            request=TeacherRequest(
                input_ids=rng.integers(0, VOCAB, n).tolist(),
                top_k=TOP_K,
                sample_n=2,
                return_entropy=True,
                seed=i,
            ),
        )
        for i, n in enumerate(lengths)
    ]


def _score_all(layout, checkpoints: dict[str, str], batches: list[list[Job]]) -> dict:
    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward.scoring import Scorer

    out = {}
    for name, path in checkpoints.items():
        model, spec = load_hf_checkpoint(path, layout)
        scorer = Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu"))
        out[name] = [scorer.score(batch_from_jobs(jobs)) for jobs in batches]
    return out


def _layout_worker(rank: int, world_size: int, tp: int, ep: int, checkpoints, batches):
    from consumer import cpu_compat
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=tp, pp=1, ep=ep)
    assert layout.replica_size == world_size and layout.replica_rank == rank
    scored = _score_all(layout, checkpoints, batches)
    return scored if layout.is_leader else None


def _batches() -> list[list[Job]]:
    together = _jobs(LENGTHS, seed=1)
    return [together, together[1:2]]


@pytest.fixture(scope="module")
def tp1_scores(layout, moe_checkpoints) -> dict:
    return _score_all(layout, moe_checkpoints, _batches())


def _check_against_transformers(path: str, jobs: list[Job], got: list[dict]) -> None:
    for job, out in zip(jobs, got, strict=True):
        ids = np.asarray(job.request.input_ids)
        ref = hf_full_log_softmax(path, ids)
        np.testing.assert_allclose(
            out["logprobs"], ref[np.arange(len(ids) - 1), ids[1:]], atol=ATOL, rtol=0
        )
        top = np.argsort(-ref, axis=-1, kind="stable")[:, :TOP_K]
        np.testing.assert_array_equal(out["topk_token_ids"], top)
        np.testing.assert_allclose(
            out["topk_logprobs"], np.take_along_axis(ref, top, -1), atol=ATOL, rtol=0
        )
        entropy = -(np.exp(ref) * ref).sum(-1)
        np.testing.assert_allclose(out["entropy"], entropy, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_tp1_matches_transformers(name, moe_checkpoints, tp1_scores):
    _check_against_transformers(moe_checkpoints[name], _batches()[0], tp1_scores[name][0])


def test_outputs_do_not_depend_on_batch_mates(tp1_scores):
    for name, (together, alone) in tp1_scores.items():
        mine = together[1]  # job j1 shares its batch with three others, then runs alone
        np.testing.assert_allclose(mine["logprobs"], alone[0]["logprobs"], atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(mine["sampled_token_ids"], alone[0]["sampled_token_ids"])
        np.testing.assert_array_equal(mine["topk_token_ids"], alone[0]["topk_token_ids"])


def _check_layout(tp: int, ep: int, moe_checkpoints, tp1_scores) -> None:
    world = max(tp, ep)
    scored = run_gloo(
        world, _layout_worker, tp, ep, moe_checkpoints, _batches(), timeout=scaled(300)
    )[0]
    for name, path in moe_checkpoints.items():
        _check_against_transformers(path, _batches()[0], scored[name][0])
        for got_batch, want_batch in zip(scored[name], tp1_scores[name], strict=True):
            for got, want in zip(got_batch, want_batch, strict=True):
                # the same seed samples the same tokens in every layout
                np.testing.assert_array_equal(got["sampled_token_ids"], want["sampled_token_ids"])
                np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-4)


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 1), (2, 2)], ids=["ep2", "tp2", "tp2xep2"])
def test_layouts_match_transformers_and_tp1(tp, ep, moe_checkpoints, tp1_scores):
    _check_layout(tp, ep, moe_checkpoints, tp1_scores)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "ep"), [(4, 2), (1, 4)], ids=["tp4xep2", "ep4"])
def test_wide_layouts_match_transformers(tp, ep, moe_checkpoints, tp1_scores):
    _check_layout(tp, ep, moe_checkpoints, tp1_scores)


# --------------------------------------------------------------------------------------------
# the expert GEMM alone


def test_expert_gemm_equals_a_per_expert_reference():
    from consumer.forward.moe_gemm import expert_matmul, swiglu_experts

    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    fc1 = torch.randn(4, 12, 8, generator=gen, dtype=torch.float64)
    fc2 = torch.randn(4, 8, 6, generator=gen, dtype=torch.float64)
    experts = torch.repeat_interleave(torch.arange(4), counts)
    want = torch.stack([x[i] @ fc1[e].T for i, e in enumerate(experts.tolist())])
    torch.testing.assert_close(expert_matmul(x, fc1, counts), want)
    h = want[:, :6]
    act = torch.nn.functional.silu(h) * want[:, 6:]
    want2 = torch.stack([act[i] @ fc2[e].T for i, e in enumerate(experts.tolist())])
    torch.testing.assert_close(swiglu_experts(x, fc1, fc2, counts), want2)


@pytest.mark.parametrize("tail", [None, 64], ids=["one-launch", "tail-64"])
def test_expert_gemm_schedule_covers_each_row_once(tail):
    """The fused expert GEMMs' launches, walked as the kernel walks them (a program's expert
    from the running tile count, its rows from the first-row and end-row tables): every
    sorted row of every expert in exactly one tile, no tile past its expert, and with a tail
    launch each expert's last part of at most 64 rows in one 64-row tile."""
    pytest.importorskip("triton")
    from consumer.kernels import expert_gemm as eg

    counts = torch.tensor([0, 128, 129, 192, 193, 64, 1, 300])
    starts = torch.cumsum(counts, 0) - counts
    main = eg.Tiles(bm=128)
    plans = eg.schedule(counts, int(counts.sum()), main, eg.Tiles(bm=tail) if tail else None)
    seen = torch.zeros(int(counts.sum()), dtype=torch.int64)
    tiles = []
    for plan in plans:
        first, end, tile_end = plan.table.view(3, -1).long()
        assert int(tile_end[-1]) <= plan.max_m_tiles
        for pid_m in range(plan.max_m_tiles):
            e = int((tile_end <= pid_m).sum())
            if e >= len(counts):
                continue
            before = int(tile_end[e - 1]) if e else 0
            lo = int(first[e]) + (pid_m - before) * plan.tiles.bm
            hi = min(lo + plan.tiles.bm, int(end[e]))
            assert starts[e] <= lo < hi <= starts[e] + counts[e], (e, lo, hi)
            seen[lo:hi] += 1
            tiles.append((e, plan.tiles.bm, hi - lo))
    assert seen.eq(1).all(), seen
    per_expert = [sorted((bm, n) for e_, bm, n in tiles if e_ == e) for e in range(len(counts))]
    if tail is None:
        assert [len(t) for t in per_expert] == [0, 1, 2, 2, 2, 1, 1, 3]
    else:  # 129 and 192 rows: one full tile and a tail; 193: two full tiles (65 left)
        assert per_expert[2] == [(64, 1), (128, 128)]
        assert per_expert[3] == [(64, 64), (128, 128)]
        assert per_expert[4] == [(128, 65), (128, 128)]
        assert per_expert[5] == [(64, 64)] and per_expert[6] == [(64, 1)]
        assert per_expert[7] == [(64, 44), (128, 128), (128, 128)]
    with pytest.raises(ValueError, match="fewer rows a tile"):
        eg.schedule(counts, 1, main, eg.Tiles(bm=128))


def test_grouped_gemm_call_agrees_with_the_loop():
    """The grouped GEMM as moe_gemm calls it (weights transposed, int32 end offsets), run where
    this torch has it on the CPU: the convention the CUDA path relies on."""
    from consumer.forward import moe_gemm

    fn = moe_gemm._grouped_mm_fn()
    if fn is None:
        pytest.skip("this torch has no grouped GEMM")
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([16, 0, 24, 8])
    x = torch.randn(48, 32, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(4, 16, 32, generator=gen, dtype=torch.bfloat16)
    try:
        got = moe_gemm._grouped(fn, x, w, counts)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"no grouped GEMM on the CPU here: {exc}")
    want = moe_gemm._looped(x, w, counts)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)


def _fused_copy(src: str, dst) -> None:
    """The checkpoint at `src` with each sparse layer's experts stored fused, as transformers 5
    holds them in memory: experts.gate_up_proj [E, 2f, h] and experts.down_proj [E, h, f]."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{src}/model.safetensors")
    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.match(r"(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.(.*)", name)
        hit = re.match(r"experts\.(\d+)\.(\w+)\.weight", m.group(2)) if m else None
        if hit:
            experts.setdefault(m.group(1), {})[(int(hit.group(1)), hit.group(2))] = t
        elif m:
            out[m.group(1) + "mlp." + m.group(2)] = t
        else:
            out[name] = t
    for layer, by in experts.items():
        n = 1 + max(e for e, _ in by)
        gate, up, down = (
            ("w1", "w3", "w2") if (0, "w1") in by else ("gate_proj", "up_proj", "down_proj")
        )
        out[layer + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by[(e, gate)], by[(e, up)]]) for e in range(n)]
        )
        out[layer + "mlp.experts.down_proj"] = torch.stack([by[(e, down)] for e in range(n)])
    dst.mkdir()
    shutil.copy(f"{src}/config.json", dst / "config.json")
    save_file(out, str(dst / "model.safetensors"))


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_fused_expert_layout_reads_the_same_shards(name, moe_checkpoints, tmp_path):
    """Fused and per-expert storage give every rank of tp2 x ep2 and tp1 x ep2 the same
    shards."""
    from consumer.checkpoints import HfCheckpoint, validate_hf_checkpoint
    from consumer.checkpoints.hf import hf_shard_readers
    from consumer.parallel import ParallelLayout

    fused = tmp_path / "fused"
    _fused_copy(moe_checkpoints[name], fused)
    spec = validate_hf_checkpoint(fused, tp=2, ep=2)
    assert spec == validate_hf_checkpoint(moe_checkpoints[name])
    for tp, rank in [(2, 0), (2, 1), (1, 1)]:
        layout = ParallelLayout(
            world_size=2, rank=rank, tp=tp, pp=1, dp=1, tp_rank=rank % tp, pp_rank=0,
            dp_rank=0, tp_group=None, leader_rank=0, ep=2,
        )  # fmt: skip
        shards = []
        for path in (moe_checkpoints[name], fused):
            with HfCheckpoint(path) as ckpt:
                readers = hf_shard_readers(spec, layout, ckpt.shapes)
                shards.append({k: read(ckpt) for k, read in readers.items()})
        assert shards[0].keys() == shards[1].keys()
        for key in shards[0]:
            torch.testing.assert_close(shards[1][key], shards[0][key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_make_checkpoint_script_writes_moe_families(family, tmp_path):
    import importlib.util
    from pathlib import Path

    from consumer.checkpoints import validate_hf_checkpoint

    path = Path(__file__).resolve().parents[2] / "scripts" / "make_checkpoint.py"
    module_spec = importlib.util.spec_from_file_location("make_checkpoint", path)
    script = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(script)
    out = tmp_path / family
    argv = ["--family", family, "--out", str(out), "--experts", "8", "--top-k", "3"]
    assert script.main([*argv, "--norm-topk", "--shared-ffn", "64"]) == 0
    spec = validate_hf_checkpoint(out, tp=2, ep=4)
    assert (spec.family, spec.num_experts, spec.moe_top_k, spec.moe_norm_topk) == (
        family,
        8,
        3,
        True,
    )
    assert spec.moe_shared_ffn_hidden_size == (64 if family == "qwen2_moe" else 0)


# --------------------------------------------------------------------------------------------
# validation


def _config(family: str, **over) -> dict:
    from consumer.checkpoints.synthetic import hf_config

    config = hf_config(family, num_kv_heads=4).to_dict()
    config.update(over)
    return config


@pytest.mark.parametrize(
    ("family", "over", "tp", "ep", "message"),
    [
        ("qwen3_moe", {}, 1, 3, "num_experts=4 is not divisible by ep=3"),
        ("qwen3_moe", {"moe_intermediate_size": 30}, 4, 1, "moe_intermediate_size\\) 30"),
        ("qwen3_moe", {"num_experts_per_tok": 5}, 1, 1, "num_experts_per_tok=5 exceeds"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 6}, 4, 2,
         "shared_expert_intermediate_size=6 is not divisible"),
        ("mixtral", {"num_local_experts": 0}, 1, 1, "num_experts=0"),
        ("qwen3_moe", {"decoder_sparse_step": 2, "intermediate_size": None}, 1, 1,
         "intermediate_size=None: layers \\[0\\] are dense"),
        ("qwen3_moe", {}, 2, 3, "the smaller must divide the larger"),
        ("qwen3", {}, 1, 2, "parallel.ep=2 needs a mixture-of-experts model"),
    ],
)  # fmt: skip
def test_moe_validation_names_field_and_value(family, over, tp, ep, message):
    from consumer.checkpoints import validate_hf_config

    with pytest.raises(CheckpointError, match=message):
        validate_hf_config(_config(family, **over), tp=tp, ep=ep)


def test_moe_configs_need_no_dense_ffn_size():
    from consumer.checkpoints import validate_hf_config

    config = _config("qwen3_moe")
    del config["intermediate_size"]
    spec = validate_hf_config(config, tp=2, ep=2)
    assert spec.num_experts == 4 and spec.moe_top_k == 2 and spec.moe_dense_layers == ()


@pytest.mark.parametrize(("model_type", "arch"), [("deepseek_v2", "DeepseekV2ForCausalLM"),
                                                  ("olmoe", "OlmoeForCausalLM")])  # fmt: skip
def test_unsupported_moe_families_are_still_refused(model_type, arch):
    """A mixture-of-experts family outside the table is refused, saying it is one."""
    from consumer.checkpoints import validate_hf_config

    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        validate_hf_config({"model_type": model_type, "architectures": [arch]})


def _torch_dist_worker(rank, world_size, tp, ep, roots, out_root, batches):
    from consumer import cpu_compat
    from consumer.checkpoints import load_megatron_checkpoint, save_megatron_checkpoint
    from consumer.forward.scoring import Scorer
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=tp, pp=1, ep=ep)
    out = {}
    for name, root in roots.items():
        model, spec = load_megatron_checkpoint(root, layout)
        scorer = Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu"))
        out[name] = [scorer.score(batch_from_jobs(jobs)) for jobs in batches]
        save_megatron_checkpoint(model, f"{out_root}/{name}")
    return out if layout.is_leader else None


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 2)], ids=["ep2", "tp2xep2"])
def test_torch_dist_moe_reloads_at_any_layout(
    tp, ep, layout, moe_checkpoints, tp1_scores, tmp_path
):
    """Saved at TP=1, loaded at tp x ep (each rank reads its experts) and saved there, then
    loaded at TP=1 again: the same outputs all the way."""
    from consumer.checkpoints import (
        load_hf_checkpoint,
        load_megatron_checkpoint,
        save_megatron_checkpoint,
    )
    from consumer.forward.scoring import Scorer

    roots = {}
    for name, path in moe_checkpoints.items():
        model, spec = load_hf_checkpoint(path, layout)
        save_megatron_checkpoint(model, tmp_path / "tp1" / name, spec=spec)
        roots[name] = str(tmp_path / "tp1" / name)
    out_root = str(tmp_path / "wide")
    scored = run_gloo(
        max(tp, ep), _torch_dist_worker, tp, ep, roots, out_root, _batches(), timeout=scaled(300)
    )[0]
    for name in moe_checkpoints:
        model, spec = load_megatron_checkpoint(f"{out_root}/{name}", layout)
        assert spec.num_experts == 4
        scorer = Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu"))
        back = [scorer.score(batch_from_jobs(jobs)) for jobs in _batches()]
        for run in (scored[name], back):
            for got_batch, want_batch in zip(run, tp1_scores[name], strict=True):
                for got, want in zip(got_batch, want_batch, strict=True):
                    np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-4)
                    np.testing.assert_array_equal(
                        got["sampled_token_ids"], want["sampled_token_ids"]
                    )


def test_layout_degrees():
    from consumer.parallel import LayoutError, check_layout

    assert check_layout(world_size=8, tp=2, pp=1, ep=4) == 2  # replicas of max(tp, ep) ranks
    assert check_layout(world_size=8, tp=4, pp=1, ep=2) == 2
    assert check_layout(world_size=8, tp=2, pp=1) == 4  # dense: unchanged
    with pytest.raises(LayoutError, match="ep=3 and tensor parallelism tp=2"):
        check_layout(world_size=6, tp=2, pp=1, ep=3)
    with pytest.raises(LayoutError, match=r"not a multiple of max\(tp, ep\)\*pp = 4\*1"):
        check_layout(world_size=6, tp=1, pp=1, ep=4)


def test_the_routers_bf16_parts_sum_to_its_float32_weight_exactly():
    """DeepSeekMoE's float32 router runs on the tensor cores as one bf16 GEMM against three
    bf16 parts of its weight (consumer/forward/moe.py): their float32 sum must be the weight,
    bit for bit, at every magnitude a router weight has and at values bf16 cannot hold."""
    from consumer.forward.moe import bf16_parts

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 96, generator=gen) * torch.logspace(-6, 3, 96)
    weight[0, :4] = torch.tensor([1 / 3, -(2.0**-20) + 1e-9, 0.0, 1.0 + 2.0**-23])
    parts = bf16_parts(weight)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 64, 96)
    total = (parts[0].float() + parts[1].float()) + parts[2].float()
    assert torch.equal(total, weight)
    assert not torch.equal(parts[0].float(), weight)  # the other two parts carry bits


def test_quack_path_is_not_taken_on_the_cpu():
    """The quack-kernels path (`moe_gemm.routed_combined`) serves sm90 devices only: on the CPU
    it declines, and TeacherMoE takes the scatter and sum."""
    from consumer.forward import moe_gemm, quack_gemm

    x = torch.randn(4, 16, dtype=torch.bfloat16)
    fc1, fc2 = torch.randn(2, 16, 16, dtype=torch.bfloat16), torch.randn(2, 16, 8).bfloat16()
    picks = torch.arange(8)
    counts = torch.tensor([4, 4])
    assert not quack_gemm.available(torch.device("cpu"), torch.bfloat16, 16)
    assert quack_gemm.preload(torch.device("cpu")) is None  # nor is quack imported for it
    got = moe_gemm.routed_combined(x, picks // 2, picks, torch.ones(8), counts, fc1, fc2, 2)
    assert got is None
