"""consumer/forward/fp8_gemm.py on an H100/H200: cuBLAS's block-scaled FP8 GEMM (`torch._scaled_mm`
with 1x128 activation and 128x128 weight scales) against the emulated product of the same FP8
operands, and FP8 against the bf16 GEMM of the unquantized weights.

Tolerances: the two FP8 paths multiply the same operands, so they differ only by accumulation
order and the bf16 output: within 2 % of the output's scale (atol 2e-2 x max |y|, rtol 2e-2).
Against the unquantized product, e4m3 on both operands costs a relative Frobenius error of a
few percent: under 6 % here (measured ~3-4 % on Gaussian data).

End to end, an FP8 checkpoint (128 x 128 blocks) loaded with `model.fp8=auto` keeps its
linears in FP8 and scores within the activations' FP8 rounding of its dequantized load
(mean |d logprob| < 0.1, max < 0.5, bf16 on both sides).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from consumer.forward import fp8_gemm  # noqa: E402 - after the skip

CUDA = torch.device("cuda")
SHAPES = [(1, 4096, 4096), (300, 4096, 12288), (2048, 12288, 4096), (77, 1024, 640)]


def _operands(t: int, k: int, n: int):
    gen = torch.Generator(device=CUDA).manual_seed(t + k + n)
    x = torch.randn(t, k, generator=gen, device=CUDA).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=CUDA) / k**0.5).to(torch.bfloat16)
    return x, w


@pytest.fixture(scope="module")
def cublas() -> None:
    why = fp8_gemm.scaled_mm_unsupported(CUDA, 4096)
    if why:
        pytest.skip(why)


@pytest.mark.parametrize(("t", "k", "n"), SHAPES)
def test_scaled_mm_matches_emulated(t, k, n, cublas):
    """cuBLAS's FP8 product equals the emulated one of the same quantized operands (bf16
    output, ragged N included)."""
    if fp8_gemm.scaled_mm_unsupported(CUDA, k):
        pytest.skip(f"K={k}: emulated path only")
    x, w = _operands(t, k, n)
    w_q, w_s = fp8_gemm.quantize_weight(w)
    got = fp8_gemm.fp8_block_linear(x, w_q, w_s, path="scaled_mm").float()
    want = fp8_gemm.fp8_block_linear(x, w_q, w_s, path="emulated", out_dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("t", [1, 37, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_quantize_equals_the_pytorch_ops(t, dtype):
    """The Triton kernel's FP8 values and scales are `quantize_activations`' bit for bit
    (rows strided in a wider tensor here), its padding rows zero, its scales laid out
    outer-dim-major for cuBLAS."""
    from consumer.kernels import load

    fused = load(CUDA)
    assert fused is not None, "Triton kernels did not load"
    gen = torch.Generator(device=CUDA).manual_seed(t)
    wide = (torch.randn(t, 1024 + 256, generator=gen, device=CUDA) * 5).to(dtype)
    wide[0, :128] = 0  # an all-zero group
    x = wide[:, :1024]
    q, s = fused.fp8_quantize(x)
    q0, s0 = fp8_gemm.quantize_activations(x)
    pad = -t % 16
    assert q.shape == (t + pad, 1024) and s.shape == (t + pad, 8) and s.stride() == (1, t + pad)
    assert torch.equal(q[:t].view(torch.uint8), q0.view(torch.uint8))
    assert torch.equal(s[:t], s0)
    assert not q[t:].view(torch.uint8).any()


@pytest.mark.parametrize(("t", "k", "n"), SHAPES)
def test_fp8_close_to_bf16(t, k, n):
    """Whichever path `auto` takes, FP8 stays within 6 % (relative Frobenius) of the bf16
    GEMM of the unquantized weights."""
    x, w = _operands(t, k, n)
    w_q, w_s = fp8_gemm.quantize_weight(w)
    got = fp8_gemm.fp8_block_linear(x, w_q, w_s).float()
    exact = x.float() @ w.float().T
    assert ((got - exact).norm() / exact.norm()).item() < 0.06


def test_fp8_checkpoint_serves_fp8_linears(hf_checkpoint, tmp_path, layout, cublas):
    """`model.fp8=auto` on this GPU: every attention and MLP linear holds FP8 weights and
    the scores stay close to the dequantized load (`model.fp8=dequantize`) of the same
    checkpoint."""
    import numpy as np

    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward.scoring import Scorer
    from consumer.group.batching import batch_from_jobs
    from tests.fp8_reference import VOCAB, fp8_jobs, write_fp8_pair

    sizes = {"hidden_size": 512, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 128,
             "intermediate_size": 1024, "num_layers": 2}  # fmt: skip
    source = hf_checkpoint("qwen3", "gpu-fp8-src", seed=3, vocab_size=VOCAB, **sizes)
    fp8_path, _ = write_fp8_pair(source, tmp_path, [128, 128])
    scores = {}
    for mode in ("auto", "dequantize"):
        model, spec = load_hf_checkpoint(
            str(fp8_path), layout, params_dtype=torch.bfloat16, device=CUDA, fp8=mode
        )
        fp8_params = [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
        assert len(fp8_params) == (8 if mode == "auto" else 0), fp8_params
        scorer = Scorer(model=model, spec=spec, layout=layout, device=CUDA)
        scores[mode] = scorer.score(batch_from_jobs(fp8_jobs()))
    pairs = zip(scores["auto"], scores["dequantize"], strict=True)
    diff = np.concatenate([np.abs(a["logprobs"] - d["logprobs"]) for a, d in pairs])
    assert diff.mean() < 0.1 and diff.max() < 0.5, (diff.mean(), diff.max())


def test_fp8_update_in_place_keeps_cuda_graphs_valid(hf_checkpoint, tmp_path, layout, cublas):
    """An update between two FP8 checkpoints of one shape while CUDA graphs are recorded on
    the model: it loads in place (the FP8 weights and scales overwritten in their tensors),
    and the recorded graph's next replay scores exactly as a fresh load of the new checkpoint
    (a graph still reading the old tensors, or their freed memory, would not)."""
    import numpy as np

    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward.graphs import GraphedForward
    from consumer.forward.scoring import Scorer
    from consumer.group.batching import batch_from_jobs
    from consumer.serve.reload import Reloader
    from tests.fp8_reference import VOCAB, fp8_jobs, write_fp8_pair

    sizes = {"hidden_size": 512, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 128,
             "intermediate_size": 1024, "num_layers": 2}  # fmt: skip
    paths = []
    for name, seed in (("a", 3), ("b", 4)):
        source = hf_checkpoint("qwen3", f"gpu-fp8-src-{name}", seed=seed, vocab_size=VOCAB, **sizes)
        paths.append(str(write_fp8_pair(source, tmp_path / name, [128, 128])[0]))
    graphs: list[GraphedForward] = []

    def build(path: str, graphed: bool = True):
        model, spec = load_hf_checkpoint(
            path, layout, params_dtype=torch.bfloat16, device=CUDA, fp8="auto"
        )
        recorder = GraphedForward(model, max_graphs=2) if graphed else None
        graphs.extend([recorder] if recorder else [])
        return Scorer(model=model, spec=spec, layout=layout, device=CUDA, graphs=recorder), path

    scorer, _ = build(paths[0])
    batch = batch_from_jobs(fp8_jobs())
    for _ in range(3):  # eager, recorded (second sighting), replayed
        scorer.score(batch)
    assert graphs[0].captures == 1 and graphs[0].replays >= 1
    reloader = Reloader(scorer=scorer, path=paths[0], configured=None, build=build,
                        warm=lambda s: None, fp8="auto")  # fmt: skip
    got, _ = reloader(paths[1])
    assert got is scorer and reloader.last_in_place
    replays = graphs[0].replays
    have = scorer.score(batch)
    assert graphs[0].replays == replays + 1 and graphs[0].captures == 1
    want = build(paths[1], graphed=False)[0].score(batch)
    for a, b in zip(have, want, strict=True):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)


def test_fp8_moe_checkpoint_serves_fp8_experts(hf_checkpoint, tmp_path, layout, cublas):
    """`model.fp8=auto` on this GPU with an FP8 MoE checkpoint: every sparse layer holds its
    experts in FP8 with their block scales (computed by the fused Triton expert kernel), and
    the scores stay close to the dequantized load of the same checkpoint."""
    import numpy as np

    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward import moe_gemm
    from consumer.forward.moe import TeacherMoE
    from consumer.forward.scoring import Scorer
    from consumer.group.batching import batch_from_jobs
    from tests.fp8_reference import VOCAB, fp8_jobs, write_fp8_pair

    if not moe_gemm.fused_available(CUDA, torch.bfloat16, fp8=True):
        pytest.skip("the fused FP8 expert kernel does not run here")
    sizes = {"hidden_size": 512, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 128,
             "intermediate_size": 1024, "num_layers": 2, "num_experts": 8, "top_k": 2,
             "moe_intermediate_size": 256}  # fmt: skip
    source = hf_checkpoint("qwen3_moe", "gpu-fp8-moe-src", seed=3, vocab_size=VOCAB, **sizes)
    fp8_path, _ = write_fp8_pair(source, tmp_path, [128, 128])
    scores = {}
    for mode in ("auto", "dequantize"):
        model, spec = load_hf_checkpoint(
            str(fp8_path), layout, params_dtype=torch.bfloat16, device=CUDA, fp8=mode
        )
        moes = [m for m in model.modules() if isinstance(m, TeacherMoE)]
        held = [m.expert_scale("fc1") is not None for m in moes]
        assert held == [mode == "auto"] * 2
        if mode == "auto":
            assert all(m.experts_fc1.dtype == torch.float8_e4m3fn for m in moes)
        scorer = Scorer(model=model, spec=spec, layout=layout, device=CUDA)
        scores[mode] = scorer.score(batch_from_jobs(fp8_jobs()))
    pairs = zip(scores["auto"], scores["dequantize"], strict=True)
    diff = np.concatenate([np.abs(a["logprobs"] - d["logprobs"]) for a, d in pairs])
    assert diff.mean() < 0.1 and diff.max() < 0.6, (diff.mean(), diff.max())
    assert diff.max() > 0
