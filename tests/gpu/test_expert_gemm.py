"""The fused expert GEMMs (consumer/kernels/expert_gemm.py) compiled on CUDA (#50).

Each case routes random tokens to experts and holds the Triton kernels to a float32
per-expert loop written here (gather, gate/up, SwiGLU, down, routing weight, scatter), at
awkward shapes: an expert with no tokens, a single token, depths that are not a multiple of
the tile or of 128, 256 experts. bf16 must be no further from float32 than the unfused bf16
path (torch's grouped GEMM and separate passes) is, plus a floor. FP8 (block-quantized
experts) must agree with the same quantized operands multiplied in float32, and be about as
far from the bf16 weights' result as that emulation is.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import dataclasses  # noqa: E402

from consumer.forward import moe_gemm  # noqa: E402
from consumer.kernels import expert_gemm  # noqa: E402

CUDA = torch.device("cuda")

# tokens, top-k, hidden, ffn, experts, experts given no tokens
SHAPES = [
    pytest.param(1, 2, 256, 128, 8, (), id="one-token"),
    pytest.param(37, 4, 200, 72, 16, (3, 5), id="k-not-multiple-of-128"),
    pytest.param(300, 8, 512, 256, 64, (0, 63), id="first-and-last-empty"),
    pytest.param(2048, 8, 1024, 256, 256, (7,), id="256-experts"),
    pytest.param(129, 1, 384, 384, 4, (), id="top-1"),
]


@pytest.fixture(params=[False, True], ids=["pointers", "tma"])
def tma(request, monkeypatch):
    """Every case with the weights (and the second GEMM's rows) read by pointer, then
    through TMA tensor descriptors, whichever the tile constants say now."""
    for name in ("BF16_TILES", "BF16_DOWN_TILES", "FP8_TILES", "FP8_DOWN_TILES"):
        tiles = getattr(expert_gemm, name)
        monkeypatch.setattr(expert_gemm, name, dataclasses.replace(tiles, tma=request.param))
    return request.param


def _routing(tokens: int, k: int, experts: int, empty: tuple[int, ...], gen):
    allowed = torch.tensor([e for e in range(experts) if e not in empty], device=CUDA)
    scores = torch.rand(tokens, allowed.numel(), device=CUDA, generator=gen)
    ids = allowed[scores.topk(min(k, allowed.numel()), dim=-1).indices]
    flat = ids.reshape(-1)
    dst = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    weights = torch.rand(flat.numel(), device=CUDA, generator=gen)
    return dst, counts, weights, ids.shape[1]


def _reference(x, dst, counts, weights, fc1, fc2, k):
    """float32, one expert at a time, from first principles."""
    out = torch.zeros(x.shape[0] * k, fc2.shape[1], device=CUDA)
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = dst[start : start + n]
        h = x[rows // k].float() @ fc1[e].float().T
        gate, up = h.chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ fc2[e].float().T
        out[rows] = y * weights[rows, None]
        start += n
    return out


@pytest.mark.parametrize("tokens,k,hidden,ffn,experts,empty", SHAPES)
def test_bf16_kernel_is_as_close_to_float32_as_the_unfused_path(
    tokens, k, hidden, ffn, experts, empty, tma
):
    gen = torch.Generator(device=CUDA).manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, device=CUDA, generator=gen).bfloat16()
    fc1 = (torch.randn(experts, 2 * ffn, hidden, device=CUDA, generator=gen) / 16).bfloat16()
    fc2 = (torch.randn(experts, hidden, ffn, device=CUDA, generator=gen) / 16).bfloat16()
    dst, counts, weights, k = _routing(tokens, k, experts, empty, gen)
    want = _reference(x, dst, counts, weights, fc1, fc2, k)
    got, unfused = (torch.full_like(want, float("nan"), dtype=torch.bfloat16) for _ in "ab")
    args = (x, dst // k, dst, weights, counts, fc1, fc2)
    moe_gemm.routed_swiglu(*args, got, path="triton")
    moe_gemm.routed_swiglu(*args, unfused, path="unfused")
    assert not got.isnan().any(), "a routed row was never written"
    err, err_unfused = ((t.float() - want).abs().max().item() for t in (got, unfused))
    assert err <= 2 * err_unfused + 1e-3 * want.abs().max().item(), (err, err_unfused)


@pytest.mark.parametrize("tokens,experts,empty", [(1, 4, ()), (200, 8, (2,)), (1024, 64, (0,))])
def test_fp8_kernel_matches_its_quantized_operands_in_float32(tokens, experts, empty, tma):
    hidden, ffn, k = 512, 256, 4
    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=CUDA, generator=gen).bfloat16()
    w1 = torch.randn(experts, 2 * ffn, hidden, device=CUDA, generator=gen) / 16
    w2 = torch.randn(experts, hidden, ffn, device=CUDA, generator=gen) / 16
    (fc1, s1), (fc2, s2) = (moe_gemm._quantize_experts(w) for w in (w1, w2))
    dst, counts, weights, k = _routing(tokens, k, experts, empty, gen)
    scales = {"fc1_scale": s1, "fc2_scale": s2}
    got, emulated = (torch.zeros(tokens * k, hidden, device=CUDA).bfloat16() for _ in "ab")
    args = (x, dst // k, dst, weights, counts, fc1, fc2)
    moe_gemm.routed_swiglu(*args, got, path="triton", **scales)
    moe_gemm.routed_swiglu(*args, emulated, path="unfused", **scales)
    scale = emulated.float().abs().max().item()
    # the two differ in summation order only, which can move one FP8 rounding of SwiGLU's output
    diff = (got.float() - emulated.float()).abs()
    assert diff.max().item() <= 0.03 * scale and diff.mean().item() <= 1e-3 * scale
    exact = _reference(x, dst, counts, weights, w1.bfloat16(), w2.bfloat16(), k)
    rel_kernel = ((got.float() - exact).norm() / exact.norm()).item()
    rel_emulated = ((emulated.float() - exact).norm() / exact.norm()).item()
    assert rel_kernel <= 1.1 * rel_emulated + 1e-3, (rel_kernel, rel_emulated)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "tokens,experts,empty", [(1, 4, ()), (300, 64, (0, 63)), (2048, 256, (7,))]
)
def test_tail_launch_gives_the_one_launch_result(tokens, experts, empty, fp8, tma, monkeypatch):
    """Each expert's last part of at most half a tile in a second launch of smaller tiles
    (`schedule`'s tail): the same FFN as one launch gives."""
    hidden, ffn, k = (512, 256, 4) if fp8 else (200, 200, 4)
    gen = torch.Generator(device=CUDA).manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, device=CUDA, generator=gen).bfloat16()
    w1 = torch.randn(experts, 2 * ffn, hidden, device=CUDA, generator=gen) / 16
    w2 = torch.randn(experts, hidden, ffn, device=CUDA, generator=gen) / 16
    if fp8:
        (fc1, s1), (fc2, s2) = (moe_gemm._quantize_experts(w) for w in (w1, w2))
        scales = {"fc1_scale": s1, "fc2_scale": s2}
    else:
        fc1, fc2, scales = w1.bfloat16(), w2.bfloat16(), {}
    dst, counts, weights, k = _routing(tokens, k, experts, empty, gen)
    args = (x, dst // k, dst, weights, counts, fc1, fc2)
    want, got = (
        torch.full((tokens * k, hidden), float("nan"), device=CUDA).bfloat16() for _ in "ab"
    )
    for name in ("BF16", "BF16_DOWN", "FP8", "FP8_DOWN"):
        monkeypatch.setattr(expert_gemm, name + "_TAIL_TILES", None)
    moe_gemm.routed_swiglu(*args, want, path="triton", **scales)
    for name in ("BF16", "BF16_DOWN", "FP8", "FP8_DOWN"):
        main = getattr(expert_gemm, name + "_TILES")
        tail = dataclasses.replace(main, bm=main.bm // 2, warps=4)
        monkeypatch.setattr(expert_gemm, name + "_TAIL_TILES", tail)
    moe_gemm.routed_swiglu(*args, got, path="triton", **scales)
    assert not got.isnan().any(), "a routed row was never written"
    diff = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item()
    # the same products; tiles of under 64 rows may take other MMA instructions, which sum
    # in their own order (FP8: which can move one quantization step of SwiGLU's output)
    assert diff.max().item() <= (0.03 if fp8 else 0.01) * scale, (diff.max(), scale)
    assert diff.mean().item() <= 1e-3 * scale, (diff.mean(), scale)


def test_auto_path_takes_the_fused_kernels_on_this_gpu():
    assert moe_gemm.fused_available(CUDA, torch.bfloat16)
    if torch.cuda.get_device_capability()[0] >= 9:
        assert moe_gemm.fused_available(CUDA, torch.bfloat16, True)
