"""DeepSeek-V3 and GLM-4.5 MoE teachers on CUDA (#36): the paths the CPU tests cannot reach.

Each family (DeepSeek-V3 with q-LoRA, grouped routing and YaRN; DeepSeek-V3 without q-LoRA;
GLM-4.5 with partial rotary, q/k norms and biases), loaded in float32 on CUDA, gives
transformers' float32 log-probs, top-k and entropy (<= 2e-3); loaded in bf16 (latent attention
through the packed varlen flash call with values padded to the q/k head size, grouped expert
GEMM, fused SwiGLU and RoPE) it is no further from that float32 reference than transformers'
own bf16 forward is (2x, plus a small floor).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from consumer.checkpoints import load_hf_checkpoint  # noqa: E402
from consumer.forward.attention import varlen_supported  # noqa: E402
from consumer.forward.scoring import Scorer  # noqa: E402
from consumer.group.batching import batch_from_jobs  # noqa: E402
from shared.messages import Job, TeacherRequest  # noqa: E402
from tests.reference import hf_full_log_softmax  # noqa: E402

CUDA = torch.device("cuda")
VOCAB = 2000
TOP_K = 5
LENGTHS = [40, 100, 7, 64, 33]
SHAPE = {"hidden_size": 256, "num_layers": 3, "num_experts": 16, "top_k": 4,
         "moe_intermediate_size": 128, "first_k_dense_replace": 1, "vocab_size": VOCAB,
         "num_attention_heads": 8, "num_kv_heads": 8}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
MLA = {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}
CASES = {
    "deepseek_v3": {"family": "deepseek_v3", **MLA, "q_lora_rank": 96, "n_group": 4,
                    "topk_group": 2, "n_shared_experts": 1, "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5, "rope_scaling": YARN,
                    "max_position_embeddings": 256},
    "deepseek_v3_plain": {"family": "deepseek_v3", **MLA, "q_lora_rank": None,
                          "rope_interleave": False},
    "glm4_moe": {"family": "glm4_moe", "head_dim": 32, "partial_rotary_factor": 0.5,
                 "use_qk_norm": True, "attention_bias": True, "n_group": 2, "topk_group": 1,
                 "norm_topk_prob": True},
}  # fmt: skip


def _jobs() -> list[Job]:
    rng = np.random.default_rng(3)
    return [
        Job(job_id=f"j{i}", entry_id=f"0-{i}", submitted_at=0.0,
            request=TeacherRequest(input_ids=rng.integers(0, VOCAB, n).tolist(), top_k=TOP_K,
                                   sample_n=2, return_entropy=True, seed=i))
        for i, n in enumerate(LENGTHS)
    ]  # fmt: skip


def _ours(path: str, layout, dtype: torch.dtype) -> list[dict]:
    model, spec = load_hf_checkpoint(path, layout, params_dtype=dtype, device=CUDA)
    scorer = Scorer(model=model, spec=spec, layout=layout, device=CUDA)
    return scorer.score(batch_from_jobs(_jobs()))


@torch.inference_mode()
def _hf_bf16(path: str) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(CUDA)
    out = []
    for job in _jobs():
        ids = torch.as_tensor(job.request.input_ids, device=CUDA)[None]
        logits = model(ids).logits[0, :-1].double()
        out.append(torch.log_softmax(logits, dim=-1).cpu().numpy())
    return out


def test_latent_attention_takes_the_varlen_path() -> None:
    """The q/k head size of latent attention (nope + rope, values padded to it) is one the
    packed varlen flash call takes in bf16: DeepSeek-V3's 192 and the test's 48."""
    for head in (192, MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]):
        assert varlen_supported(CUDA, torch.bfloat16, head), head


@pytest.mark.parametrize("name", list(CASES))
def test_family_on_cuda_matches_transformers(name, hf_checkpoint, layout) -> None:
    """float32 on CUDA equals transformers' float32; bf16 is no further from it than
    transformers' own bf16 forward."""
    case = dict(CASES[name])
    path = str(hf_checkpoint(case.pop("family"), f"gpu-frontier-{name}", seed=7, **SHAPE, **case))
    refs = [hf_full_log_softmax(path, np.asarray(j.request.input_ids)) for j in _jobs()]
    fp32 = _ours(path, layout, torch.float32)
    bf16 = _ours(path, layout, torch.bfloat16)
    hf16 = _hf_bf16(path)
    ours_err, hf_err = 0.0, 0.0
    for job, ref, a, b, h in zip(_jobs(), refs, fp32, bf16, hf16, strict=True):
        ids = np.asarray(job.request.input_ids)
        rows = np.arange(len(ids) - 1)
        np.testing.assert_allclose(a["logprobs"], ref[rows, ids[1:]], atol=2e-3, rtol=0)
        top = np.argsort(-ref, axis=-1, kind="stable")[:, :TOP_K]
        np.testing.assert_allclose(
            a["topk_logprobs"], np.take_along_axis(ref, top, -1), atol=2e-3, rtol=0
        )
        np.testing.assert_allclose(a["entropy"], -(np.exp(ref) * ref).sum(-1), atol=2e-3, rtol=0)
        ours_err = max(ours_err, float(np.abs(b["logprobs"] - ref[rows, ids[1:]]).max()))
        hf_err = max(hf_err, float(np.abs(h[rows, ids[1:]] - ref[rows, ids[1:]]).max()))
    assert ours_err <= 2 * hf_err + 2e-2, (ours_err, hf_err)
