"""Mixture-of-experts teachers on CUDA (#23): the paths the CPU tests cannot reach.

- The expert GEMM takes torch's grouped GEMM in bf16 (checked to be available on this GPU) and
  agrees with a float32 per-expert loop, empty experts included.
- Each family (Qwen3-MoE, Qwen2-MoE, Mixtral), loaded in float32 on CUDA, gives transformers'
  float32 log-probs, top-k and entropy (<= 2e-3); loaded in bf16 (grouped GEMM, fused SwiGLU),
  it is no further from that float32 reference than transformers' own bf16 forward is (2x,
  plus a small floor).
- With one expert-parallel rank, the MoE forward and the head queue without a host sync, so the
  consumer can queue the next batch while the device computes this one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from consumer.checkpoints import load_hf_checkpoint  # noqa: E402
from consumer.forward import moe_gemm  # noqa: E402
from consumer.forward.scoring import Scorer  # noqa: E402
from consumer.group.batching import batch_from_jobs  # noqa: E402
from shared.messages import Job, TeacherRequest  # noqa: E402
from tests.reference import hf_full_log_softmax  # noqa: E402

CUDA = torch.device("cuda")
VOCAB = 2000
TOP_K = 5
LENGTHS = [40, 100, 7, 64, 33]
SHAPE = {"hidden_size": 256, "num_layers": 2, "num_experts": 16, "top_k": 4, "vocab_size": VOCAB}
CASES = {
    "qwen3_moe": {"family": "qwen3_moe", "moe_intermediate_size": 128, "norm_topk_prob": True},
    "qwen2_moe": {"family": "qwen2_moe", "moe_intermediate_size": 128},
    "mixtral": {"family": "mixtral", "intermediate_size": 128},
}


def test_grouped_gemm_is_used_and_agrees_with_a_float32_loop() -> None:
    assert moe_gemm.grouped_available("cuda", torch.cuda.current_device(), torch.bfloat16)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    counts = torch.randint(0, 400, (32,), generator=gen, device=CUDA)
    counts[[3, 17]] = 0  # experts no token chose
    rows = int(counts.sum())
    x = torch.randn(rows, 512, device=CUDA, generator=gen).bfloat16()
    w = (torch.randn(32, 384, 512, device=CUDA, generator=gen) / 512**0.5).bfloat16()
    got = moe_gemm.expert_matmul(x, w, counts).float()
    want = moe_gemm._looped(x.float(), w.float(), counts)
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-2, rel


def _jobs() -> list[Job]:
    rng = np.random.default_rng(3)
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
        for i, n in enumerate(LENGTHS)
    ]


def _ours(path: str, layout, dtype: torch.dtype) -> list[dict]:
    model, spec = load_hf_checkpoint(path, layout, params_dtype=dtype, device=CUDA)
    scorer = Scorer(model=model, spec=spec, layout=layout, device=CUDA)
    return scorer.score(batch_from_jobs(_jobs()))


@torch.inference_mode()
def _hf_bf16(path: str) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).to(CUDA)
    out = []
    for job in _jobs():
        ids = torch.as_tensor(job.request.input_ids, device=CUDA)[None]
        logits = model(ids).logits[0, :-1].double()
        out.append(torch.log_softmax(logits, dim=-1).cpu().numpy())
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_family_on_cuda_matches_transformers(name, hf_checkpoint, layout) -> None:
    case = dict(CASES[name])
    path = str(hf_checkpoint(case.pop("family"), f"gpu-moe-{name}", seed=7, **SHAPE, **case))
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


def test_the_moe_forward_never_waits_for_the_device(hf_checkpoint, layout) -> None:
    case = dict(CASES["qwen2_moe"])  # routed experts and the shared expert
    path = str(hf_checkpoint(case.pop("family"), "gpu-moe-qwen2_moe", seed=7, **SHAPE, **case))
    model, spec = load_hf_checkpoint(path, layout, params_dtype=torch.bfloat16, device=CUDA)
    scorer = Scorer(model=model, spec=spec, layout=layout, device=CUDA)
    batch = batch_from_jobs(_jobs())
    scorer.score(batch)  # first use: rotary table and kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = scorer.launch(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.result()[0]["topk_token_ids"].shape == (LENGTHS[0] - 1, TOP_K)


@pytest.mark.parametrize("hidden", [1024, 7168])
@pytest.mark.parametrize("scale", [0.02, 3.0])
def test_deepseek_router_on_the_tensor_cores_keeps_18_bits_of_its_sums(scale, hidden) -> None:
    """DeepSeekMoE's float32 router logits through one bf16 GEMM against three bf16 parts of
    the weight (consumer/forward/moe.py), on a weight with more bits than bf16 holds: each
    logit within 2^-18 of the sum of its products' magnitudes from float64. Hopper's tensor
    cores do not add in full IEEE float32 (the reference's float32 GEMM is closer: 9e-6
    against 5e-5 at DeepSeek-V3's shape, docs/benchmarks.md), but a router on the bf16 weight
    alone breaks the bound, so the parts are what the bound tests."""
    from torch.nn import functional as F

    from consumer.forward.moe import bf16_parts, split_router_logits

    gen = torch.Generator(device=CUDA).manual_seed(7)
    x = torch.randn(2048, hidden, device=CUDA, generator=gen).bfloat16()
    weight = torch.randn(256, hidden, device=CUDA, generator=gen) * scale
    want = x.double() @ weight.double().T
    bound = 2.0**-18 * (x.double().abs() @ weight.double().abs().T)
    got = split_router_logits(x, bf16_parts(weight).flatten(0, 1))
    assert got.dtype == torch.float32 and got.shape == want.shape
    reference = F.linear(x.float(), weight)  # what transformers computes
    errors = {
        name: ((t.double() - want).abs() / bound).max().item()
        for name, t in (("split", got), ("float32", reference))
    }
    assert errors["split"] <= 1.0 and errors["float32"] <= 1.0, errors
    bf16_only = x.float() @ weight.bfloat16().float().T
    assert ((bf16_only.double() - want).abs() / bound).max().item() > 4.0, errors
