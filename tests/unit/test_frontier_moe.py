"""DeepSeek-V3 (multi-head latent attention, DeepSeekMoE routing) and GLM-4.5 MoE teachers (#36):
checkpoints written by transformers, scored through the real Scorer at TP=1, EP=2, TP=2 and
TP=2 x EP=2 on gloo, against transformers' own forward in float32. The tiny configs keep every
feature on: q-LoRA and no q-LoRA, several expert groups of which a token may use some, a
correction bias that moves the choice, shared experts, dense first layers, YaRN with its
mscale, interleaved and plain rotary layouts (DeepSeek); partial rotary, q/k norms and q/k/v
biases (GLM). Router weights are drawn large so the choice of experts is decisive."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumer.group.batching import batch_from_jobs
from shared.messages import Job, TeacherRequest
from tests.gloo import run_gloo
from tests.reference import hf_full_log_softmax
from tests.timing import scaled

ATOL = 2e-3
VOCAB = 300
TOP_K = 3
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 1.0}  # fmt: skip
MOE = {"num_layers": 3, "num_experts": 8, "top_k": 3, "moe_intermediate_size": 16,
       "first_k_dense_replace": 1}  # fmt: skip
CASES = {
    # q-LoRA, 4 groups of 2 experts of which a token uses 2, 2 shared experts, YaRN, interleaved
    # rotary pairs, renormalised and scaled weights
    "deepseek_v3": {"family": "deepseek_v3", **MOE, "n_group": 4, "topk_group": 2,
                    "n_shared_experts": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                    "rope_scaling": YARN},
    # no q-LoRA, rotate-half rotary, one group, unnormalised weights, two dense layers
    "deepseek_v3_plain": {"family": "deepseek_v3", **MOE, "q_lora_rank": None,
                          "rope_interleave": False, "first_k_dense_replace": 2},
    # partial rotary, q/k norms, q/k/v biases, 2 groups of which a token uses 1
    "glm4_moe": {"family": "glm4_moe", **MOE, "head_dim": 16, "partial_rotary_factor": 0.5,
                 "use_qk_norm": True, "attention_bias": True, "n_group": 2, "topk_group": 1,
                 "norm_topk_prob": True, "routed_scaling_factor": 1.5},
}  # fmt: skip
LENGTHS = [9, 14, 6, 11]


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint) -> dict[str, str]:
    return {
        name: str(
            hf_checkpoint(
                case["family"],
                f"frontier-{name}",
                seed=7,
                vocab_size=VOCAB,
                num_kv_heads=4,
                **{k: v for k, v in case.items() if k != "family"},
            )
        )
        for name, case in CASES.items()
    }


def _jobs(lengths: list[int], seed: int) -> list[Job]:
    rng = np.random.default_rng(seed)
    return [
        Job(job_id=f"j{i}", entry_id=f"0-{i}", submitted_at=0.0,
            request=TeacherRequest(input_ids=rng.integers(0, VOCAB, n).tolist(), top_k=TOP_K,
                                   sample_n=2, return_entropy=True, seed=i))
        for i, n in enumerate(lengths)
    ]  # fmt: skip


def _batches() -> list[list[Job]]:
    together = _jobs(LENGTHS, seed=3)
    return [together, together[1:2]]


def _score(model, spec, layout) -> list:
    from consumer.forward.scoring import Scorer

    scorer = Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu"))
    return [scorer.score(batch_from_jobs(jobs)) for jobs in _batches()]


def _score_all(layout, checkpoints: dict[str, str]) -> dict:
    from consumer.checkpoints import load_hf_checkpoint

    return {name: _score(*load_hf_checkpoint(path, layout), layout)
            for name, path in checkpoints.items()}  # fmt: skip


def _layout_worker(rank: int, world_size: int, tp: int, ep: int, checkpoints):
    from consumer import cpu_compat
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=tp, pp=1, ep=ep)
    scored = _score_all(layout, checkpoints)
    return scored if layout.is_leader else None


@pytest.fixture(scope="module")
def tp1_scores(layout, checkpoints) -> dict:
    return _score_all(layout, checkpoints)


def _check_against_transformers(path: str, jobs: list[Job], got: list[dict]) -> None:
    for job, out in zip(jobs, got, strict=True):
        ids = np.asarray(job.request.input_ids)
        ref = hf_full_log_softmax(path, ids)
        np.testing.assert_allclose(out["logprobs"], ref[np.arange(len(ids) - 1), ids[1:]],
                                   atol=ATOL, rtol=0)  # fmt: skip
        top = np.argsort(-ref, axis=-1, kind="stable")[:, :TOP_K]
        np.testing.assert_array_equal(out["topk_token_ids"], top)
        np.testing.assert_allclose(out["topk_logprobs"], np.take_along_axis(ref, top, -1),
                                   atol=ATOL, rtol=0)  # fmt: skip
        entropy = -(np.exp(ref) * ref).sum(-1)
        np.testing.assert_allclose(out["entropy"], entropy, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_tp1_matches_transformers(name, checkpoints, tp1_scores):
    """Log-probs, top-k and entropy of a packed batch equal transformers' float32 forward."""
    _check_against_transformers(checkpoints[name], _batches()[0], tp1_scores[name][0])


def test_outputs_do_not_depend_on_batch_mates(tp1_scores):
    """A job scores and samples the same alone as packed with three others."""
    for name, (together, alone) in tp1_scores.items():
        mine = together[1]
        np.testing.assert_allclose(mine["logprobs"], alone[0]["logprobs"], atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(mine["sampled_token_ids"], alone[0]["sampled_token_ids"])


def _check_layout(tp: int, ep: int, checkpoints, tp1_scores) -> None:
    scored = run_gloo(max(tp, ep), _layout_worker, tp, ep, checkpoints, timeout=scaled(300))[0]
    for name, path in checkpoints.items():
        _check_against_transformers(path, _batches()[0], scored[name][0])
        for got_batch, want_batch in zip(scored[name], tp1_scores[name], strict=True):
            for got, want in zip(got_batch, want_batch, strict=True):
                # the same seed samples the same tokens in every layout
                np.testing.assert_array_equal(got["sampled_token_ids"], want["sampled_token_ids"])
                np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-4)


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 1), (2, 2)], ids=["ep2", "tp2", "tp2xep2"])
def test_layouts_match_transformers_and_tp1(tp, ep, checkpoints, tp1_scores):
    """Heads split over TP (latent attention by whole heads), experts over EP, both at once:
    transformers' outputs, and the TP=1 samples token for token."""
    _check_layout(tp, ep, checkpoints, tp1_scores)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "ep"), [(4, 2), (1, 4)], ids=["tp4xep2", "ep4"])
def test_wide_layouts_match_transformers(tp, ep, checkpoints, tp1_scores):
    """Four-way head and expert splits, expert tensor parallelism included."""
    _check_layout(tp, ep, checkpoints, tp1_scores)


# --------------------------------------------------------------------------------------------
# pipeline stages and torch_dist checkpoints


def _stage_worker(rank, world, tp, ep, pp, roots: dict, out_root: str | None):
    """Load each checkpoint at tp x ep x pp, score both batches on every rank together (the
    pipeline's schedule at pp > 1) and, with `out_root`, save a torch_dist checkpoint there."""
    from consumer import cpu_compat
    from consumer.checkpoints import load_teacher, save_megatron_checkpoint
    from consumer.forward.pipeline import PipelineScorer
    from consumer.forward.scoring import Scorer
    from consumer.group.agreement import score_agreed
    from consumer.group.faults import FaultInjector
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=tp, pp=pp, ep=ep)
    out = {}
    for name, root in roots.items():
        model, spec, _ = load_teacher(root, layout, params_dtype=torch.float32, device="cpu")
        common = {"model": model, "spec": spec, "layout": layout, "device": torch.device("cpu")}
        scorer = PipelineScorer(**common, microbatches=0) if pp > 1 else Scorer(**common)
        faults = FaultInjector(None, rank=rank)
        out[name] = [score_agreed(scorer, batch_from_jobs(jobs), faults)[0]
                     for jobs in _batches()]  # fmt: skip
        if out_root:
            save_megatron_checkpoint(model, f"{out_root}/{name}", spec=spec)
    return out if layout.is_leader else None


def _same_as_tp1(scored: dict, tp1_scores: dict) -> None:
    for name, run in scored.items():
        for got_batch, want_batch in zip(run, tp1_scores[name], strict=True):
            for got, want in zip(got_batch, want_batch, strict=True):
                np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-4)
                np.testing.assert_array_equal(got["sampled_token_ids"], want["sampled_token_ids"])
                np.testing.assert_array_equal(got["topk_token_ids"], want["topk_token_ids"])


def test_pipeline_stages_match_tp1(checkpoints, tp1_scores):
    """Two pipeline stages (dense first layers on stage 0, sparse ones after) score and sample
    as TP=1 does."""
    _same_as_tp1(run_gloo(2, _stage_worker, 1, 1, 2, checkpoints, None, timeout=scaled(300))[0],
                 tp1_scores)  # fmt: skip


def test_torch_dist_reloads_at_other_layouts(layout, checkpoints, tp1_scores, tmp_path):
    """A torch_dist checkpoint written at TP=1 loads at TP=2 x EP=2, which writes another; that
    one loads at two pipeline stages, which write a third; that one loads at TP=1 again. Every
    step scores and samples as the Hugging Face checkpoint at TP=1."""
    from consumer.checkpoints import (
        load_hf_checkpoint,
        load_megatron_checkpoint,
        save_megatron_checkpoint,
    )

    roots = {}
    for name, path in checkpoints.items():
        model, spec = load_hf_checkpoint(path, layout)
        save_megatron_checkpoint(model, tmp_path / "tp1" / name, spec=spec)
        roots[name] = str(tmp_path / "tp1" / name)
    wide = str(tmp_path / "tp2xep2")
    _same_as_tp1(
        run_gloo(4, _stage_worker, 2, 2, 1, roots, wide, timeout=scaled(400))[0], tp1_scores
    )
    staged = str(tmp_path / "pp2")
    wide_roots = {name: f"{wide}/{name}" for name in roots}
    _same_as_tp1(run_gloo(2, _stage_worker, 1, 1, 2, wide_roots, staged, timeout=scaled(300))[0],
                 tp1_scores)  # fmt: skip
    back = {}
    for name in roots:
        model, spec = load_megatron_checkpoint(f"{staged}/{name}", layout)
        assert spec == load_hf_checkpoint(checkpoints[name], layout)[1]
        back[name] = _score(model, spec, layout)
    _same_as_tp1(back, tp1_scores)


# --------------------------------------------------------------------------------------------
# published configs, refusals, multi-token-prediction layers

DEEPSEEK_V3 = {  # the published config.json's fields (less its fp8 quantization_config)
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096},
}  # fmt: skip
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840,
           "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
           "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
           "routed_scaling_factor": 2.827, "rope_theta": 50000,
           "max_position_embeddings": 131072,
           "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 32.0}}  # fmt: skip
GLM45_AIR = {
    "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552,
    "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
    "rope_theta": 1000000, "use_qk_norm": False, "attention_bias": True,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "num_nextn_predict_layers": 1,
}  # fmt: skip


def test_published_configs_map_to_their_specs():
    """DeepSeek-V3, Kimi-K2 (model_type kimi_k2: DeepSeek-V3's config) and GLM-4.5-Air
    config.json files give the specs their cards describe, split over 8 or 16 ranks."""
    from consumer.checkpoints import validate_hf_config

    v3 = validate_hf_config(DEEPSEEK_V3, tp=8, ep=8)
    assert (v3.family, v3.num_experts, v3.moe_top_k, v3.moe_groups, v3.moe_topk_groups) == (
        "deepseek_v3", 256, 8, 8, 4)  # fmt: skip
    assert v3.moe_dense_layers == (0, 1, 2) and v3.moe_shared_ffn_hidden_size == 2048
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.kv_channels, v3.v_head_dim) == (1536, 512, 192,
                                                                                  128)  # fmt: skip
    assert v3.rope_scaling["rope_type"] == "yarn" and v3.max_input_tokens == 163840
    assert v3.rope_interleave and v3.moe_routed_scale == 2.5
    kimi = validate_hf_config(KIMI_K2, tp=1, ep=16)
    assert (kimi.family, kimi.num_experts, kimi.num_attention_heads) == ("deepseek_v3", 384, 64)
    air = validate_hf_config(GLM45_AIR, tp=8, ep=8)
    assert (air.family, air.rotary_dim, air.qkv_bias, air.qk_norm) == ("glm4_moe", 64, True,
                                                                       False)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "tp", "ep", "message"),
    [
        (DEEPSEEK_V3, 3, 1, "num_attention_heads=128 is not divisible by tp=3"),
        ({**DEEPSEEK_V3, "n_group": 3}, 1, 1, "n_routed_experts=256 is not divisible by n_group=3"),
        ({**DEEPSEEK_V3, "topk_group": 9}, 1, 1, "topk_group=9 exceeds n_group=8"),
        ({**DEEPSEEK_V3, "scoring_func": "softmax"}, 1, 1, "scoring_func='softmax'"),
        ({**DEEPSEEK_V3, "qk_rope_head_dim": 63}, 1, 1, "qk_rope_head_dim=63"),
        ({**DEEPSEEK_V3, "attention_bias": True}, 1, 1, "attention_bias=true"),
        ({**DEEPSEEK_V3, "rope_scaling": {"type": "llama3", "factor": 8}}, 1, 1,
         "'llama3' is not supported for deepseek_v3"),
        ({**DEEPSEEK_V3, "moe_intermediate_size": 2050}, 1, 4,
         "n_shared_experts x moe_intermediate_size = 2050 is not divisible"),
        ({**GLM45_AIR, "first_k_dense_replace": 2, "intermediate_size": None}, 1, 1,
         "layers \\[0, 1\\] are dense \\(first_k_dense_replace\\)"),
        (GLM45_AIR, 16, 1, "num_key_value_heads=8 is smaller than tp=16"),
        ({**GLM45_AIR, "rope_scaling": {"type": "yarn", "factor": 4,
                                        "original_max_position_embeddings": 4096}}, 1, 1,
         "'yarn' is not supported for glm4_moe"),
    ],
)  # fmt: skip
def test_refusals_name_the_field_and_the_layout(config, tp, ep, message):
    """What cannot be served, or not split this way, is refused naming the field."""
    from consumer.checkpoints import CheckpointError, validate_hf_config

    with pytest.raises(CheckpointError, match=message):
        validate_hf_config(config, tp=tp, ep=ep)


def test_multi_token_prediction_layers_are_skipped_and_logged(checkpoints, layout, tmp_path):
    """A checkpoint carrying the next-token-prediction layer after the last one (as published
    V3 does: `model.layers.61.*`) validates, loads with the skip in the log, and scores as
    without it."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from structlog.testing import capture_logs

    from consumer.checkpoints import load_hf_checkpoint

    src = Path(checkpoints["deepseek_v3"])
    tensors = load_file(src / "model.safetensors")
    last = CASES["deepseek_v3"]["num_layers"]  # the layer after the model's own
    extra = {
        k.replace(f"model.layers.{last - 1}.", f"model.layers.{last}."): v.clone()
        for k, v in tensors.items()
        if k.startswith(f"model.layers.{last - 1}.")
    }
    extra[f"model.layers.{last}.eh_proj.weight"] = torch.zeros(64, 128)
    (tmp_path / "mtp").mkdir()
    shutil.copy(src / "config.json", tmp_path / "mtp" / "config.json")
    save_file({**tensors, **extra}, str(tmp_path / "mtp" / "model.safetensors"))
    with capture_logs() as logs:
        model, spec = load_hf_checkpoint(tmp_path / "mtp", layout)
    skipped = [e for e in logs if e["event"] == "checkpoint.nextn_layers_skipped"]
    assert skipped and skipped[0]["layers"] == [last]
    got = _score(model, spec, layout)
    want = _score(*load_hf_checkpoint(src, layout), layout)
    np.testing.assert_array_equal(got[0][0]["logprobs"], want[0][0]["logprobs"])
