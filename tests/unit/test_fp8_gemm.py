"""consumer/forward/fp8_gemm.py on the CPU: the run-time activation quantizer and the emulated
block-scaled FP8 GEMM (the reference tests/gpu/test_fp8.py holds cuBLAS's path to)."""

from __future__ import annotations

import pytest
import torch

from consumer.forward import fp8_gemm


def _operands(t: int = 37, k: int = 384, n: int = 200):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(t, k, generator=gen).pow(3)  # heavy tails: groups of very different range
    w = torch.randn(n, k, generator=gen) / k**0.5
    return x, w


def test_activation_groups_round_trip_within_e4m3_step():
    """Per token and 128-channel group, each value comes back within e4m3's relative step
    (2^-3 of the group's absmax at worst), and each group's absmax maps to 448 exactly."""
    x, _ = _operands()
    q, scale = fp8_gemm.quantize_activations(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (37, 3)
    back = (q.float().view(37, 3, 128) * scale[..., None]).view(37, 384)
    amax = x.view(37, 3, 128).abs().amax(-1, keepdim=True)
    assert ((back - x).view(37, 3, 128).abs() <= amax / 8).all()
    assert torch.equal(q.float().view(37, 3, 128).abs().amax(-1), torch.full((37, 3), 448.0))
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_gemm.quantize_activations(torch.ones(2, 100))


def test_emulated_gemm_is_the_exact_quantized_product():
    """The emulated path equals a float64 product of the dequantized operands to float32
    rounding, and stays near the unquantized product (FP8's error, documented in
    tests/gpu/test_fp8.py: relative Frobenius error under 6 %)."""
    x, w = _operands()
    w_q, w_s = fp8_gemm.quantize_weight(w)
    assert w_s.shape == (2, 3)  # ragged: 200 rows are two 128-row blocks
    y = fp8_gemm.fp8_block_linear(x, w_q, w_s, path="emulated")
    q, s = fp8_gemm.quantize_activations(x)
    xd = (q.double().view(37, 3, 128) * s.double()[..., None]).view(37, 384)
    wd = fp8_gemm.dequantize_weight(w_q, w_s).double()
    torch.testing.assert_close(y.double(), xd @ wd.T, atol=1e-4, rtol=1e-5)
    exact = x.double() @ w.double().T
    assert (y.double() - exact).norm() / exact.norm() < 0.06


def test_auto_path_on_cpu_is_emulated():
    """On the CPU `auto` runs the emulated path and says why cuBLAS cannot."""
    x, w = _operands(k=512)
    w_q, w_s = fp8_gemm.quantize_weight(w)
    assert fp8_gemm.scaled_mm_unsupported("cpu", 512) == "no FP8 GEMM on cpu"
    auto = fp8_gemm.fp8_block_linear(x.view(1, 37, 512), w_q, w_s)
    assert auto.shape == (1, 37, 200)
    assert torch.equal(auto[0], fp8_gemm.fp8_block_linear(x, w_q, w_s, path="emulated"))


def test_quantizing_a_parameter_keeps_no_autograd_graph():
    """A model's weights are parameters: their quantized copies must not carry a graph, which
    would hold every block's float32 intermediates (the GEMM bench's FP8 experts at
    DeepSeek-V3's shape ran out of an H100's memory that way)."""
    from consumer.forward import moe_gemm

    w = torch.nn.Parameter(torch.randn(3, 256, 384))
    for q, scale in (fp8_gemm.quantize_weight(w[0]), moe_gemm._quantize_experts(w)):
        assert not q.requires_grad and not scale.requires_grad
        assert q.grad_fn is None and scale.grad_fn is None
