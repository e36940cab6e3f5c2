"""The expert GEMMs of a mixture-of-experts layer: SwiGLU FFNs of many experts over their tokens.

`routed_swiglu` is what TeacherMoE calls: the tokens' rows sorted by expert, each expert's
FFN, the routing weight, and each result stored at its [token, choice] row. Where
quack-kernels is installed (sm90, bf16 experts), TeacherMoE calls `routed_combined` first:
quack's GEMMs (gate/up on rows gathered in one pass, for wide rows), and each token's rows
summed in one pass.

On CUDA `routed_swiglu` runs the fused Triton grouped GEMMs (`consumer/kernels/expert_gemm.py`:
the gather, SwiGLU, the weight and the scatter inside the two GEMMs), in bf16 or, for an FP8
checkpoint's block-quantized experts, in FP8. `path="unfused"` is the reference it is tested
against: a gather, `swiglu_experts`, a multiply and a scatter (FP8 experts: the same quantized
operands expanded by their scales and multiplied in float32).

Below that, rows arrive sorted by expert, `counts[e]` rows for local expert e. On CUDA the
grouped GEMM torch provides (`torch.nn.functional.grouped_mm`, or `torch._grouped_mm` in older
releases) runs every expert in one kernel per projection, without a host sync on the counts; it
is used only where a feature test on the device passes (dtype, architecture). Elsewhere a loop
over experts computes the same thing with one pair of matmuls per expert that has rows. SwiGLU
is the fused kernel the dense MLP uses on CUDA (consumer/kernels/swiglu.py), PyTorch elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn import functional as F

from consumer import kernels
from consumer.forward import fp8_gemm


def _grouped_mm_fn() -> Callable[..., torch.Tensor] | None:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn if callable(fn) else None


@functools.cache
def grouped_available(device_type: str, device_index: int | None, dtype: torch.dtype) -> bool:
    """Whether the grouped GEMM runs (and agrees with a loop) on this device and dtype."""
    fn = _grouped_mm_fn()
    if fn is None or device_type != "cuda":
        return False
    device = (
        torch.device(device_type)
        if device_index is None
        else torch.device(device_type, device_index)
    )
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(48, 64, device=device, dtype=dtype, generator=gen)
        w = torch.randn(3, 32, 64, device=device, dtype=dtype, generator=gen)
        counts = torch.tensor([16, 0, 32], device=device)
        got = _grouped(fn, x, w, counts)
        want = _looped(x, w, counts)
        return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _grouped(fn, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [T, k] by experts' w [E, n, k] -> [T, n], rows of expert e at its offsets."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return fn(x, w.transpose(-2, -1), offs=offs)


def _looped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start : start + n] = x[start : start + n] @ w[e].T
        start += n
    return out


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` [T, k] (sorted by expert, counts[e] rows each) times their expert's
    `w` [E, n, k] transposed: [T, n]."""
    fn = _grouped_mm_fn()
    if (
        fn is not None
        and x.is_cuda
        and x.shape[0] > 0
        and grouped_available(x.device.type, x.device.index, x.dtype)
    ):
        return _grouped(fn, x.contiguous(), w, counts)
    return _looped(x, w, counts)


def swiglu_experts(
    x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """SwiGLU FFN of each expert over its rows: fc1 [E, 2f, h] = [gate; up], fc2 [E, h, f];
    x [T, h] sorted by expert with counts[e] rows each; returns [T, h]."""
    return expert_matmul(swiglu(expert_matmul(x, fc1, counts)), fc2, counts)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up]: the fused kernel on CUDA (consumer/kernels);
    elsewhere PyTorch, in float32 for 16-bit rows and rounded once, as that kernel does."""
    fused = kernels.load(h.device)
    if fused is not None and h.shape[0] > 0:
        return fused.swiglu(h)
    gate, up = h.chunk(2, dim=-1)
    if h.dtype in (torch.bfloat16, torch.float16):  # rounded once, as the fused kernel does
        return (F.silu(gate.float()) * up.float()).to(h.dtype)
    return F.silu(gate) * up


def routed_swiglu(
    x: torch.Tensor,
    rows: torch.Tensor,
    dst: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    out: torch.Tensor,
    *,
    fc1_scale: torch.Tensor | None = None,
    fc2_scale: torch.Tensor | None = None,
    path: str = "auto",
) -> None:
    """out[dst[i]] = weights[dst[i]] * FFN_e(x[rows[i]]) for the R rows i sorted by expert
    (`counts[e]` rows of local expert e, in order); other rows of `out` are left alone.

    x [T, h]; rows, dst [R] (int64: a token of x, a row of out and of the flat `weights`);
    fc1 [E, 2f, h] = [gate; up] rows, fc2 [E, h, f]: bf16/fp16, or float8_e4m3fn with
    `fc1_scale` [E, 2f/128, h/128] and `fc2_scale` [E, h/128, f/128] (a block-quantized
    checkpoint's `weight_scale_inv`). `path`: "auto" (the fused Triton kernels where
    `fused_available`, else "unfused"), "triton" or "unfused"."""
    fp8 = fc1_scale is not None
    if path == "auto":
        path = "triton" if x.is_cuda and fused_available(x.device, x.dtype, fp8) else "unfused"
    if path == "triton":
        _fused(x, rows, dst, weights, counts, fc1, fc2, out, fc1_scale, fc2_scale)
    elif path == "unfused":
        if fc1_scale is not None and fc2_scale is not None:
            y = _fp8_emulated(x[rows], fc1, fc1_scale, fc2, fc2_scale, counts, x.dtype)
        else:
            y = swiglu_experts(x[rows], fc1, fc2, counts)
        out[dst] = (y * weights[dst, None]).to(out.dtype)
    else:
        raise ValueError(f"path must be 'auto', 'triton' or 'unfused', got {path!r}")


def routed_combined(
    x: torch.Tensor,
    tokens: torch.Tensor,
    picks: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    top_k: int,
) -> torch.Tensor | None:
    """out [T, h] = the sum over each token's k choices of weight * FFN_e(x[token]), through
    quack-kernels' GEMMs (consumer/forward/quack_gemm.py) and the combine kernel, where
    that path serves: bf16 experts on a device `quack_gemm.available` accepts, widths whose
    rows are whole 16-byte units. Else None: the caller takes `routed_swiglu` and its sum.

    Arguments as `routed_swiglu`'s (`tokens` its `rows`, `picks` its `dst`); `weights` [T k]
    flat. A choice no row names (another rank's expert) adds nothing."""
    from consumer.forward import quack_gemm

    hidden, ffn = fc2.shape[1], fc2.shape[2]
    if not (x.is_cuda and fc1.dtype == fc2.dtype == x.dtype and quack_gemm.takes_rows(hidden, ffn)):
        return None
    if not quack_gemm.available(x.device, x.dtype, hidden) or kernels.load(x.device) is None:
        return None
    from consumer.kernels import expert_gemm, moe_combine

    x, fc1, fc2 = _rows_contiguous(x, fc1, fc2)
    starts = quack_gemm.offsets(counts)
    if quack_gemm.takes_gate_up(hidden):
        h = quack_gemm.gate_up(x, tokens, fc1, starts)
    else:
        h = expert_gemm.gate_up(x, tokens, fc1, counts)[0]
    y = quack_gemm.down(h, fc2, starts)
    pos = torch.full((weights.numel(),), -1, dtype=torch.int64, device=x.device)
    pos[picks] = torch.arange(picks.numel(), device=x.device)
    return moe_combine.combine(y, pos, weights, top_k)


def _rows_contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor with its last dim contiguous (the kernels step along it); no copy where it
    is already, as TeacherMoE's operands are."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _fused(x, rows, dst, weights, counts, fc1, fc2, out, fc1_scale, fc2_scale) -> None:
    from consumer.kernels import expert_gemm as eg

    x, fc1, fc2 = _rows_contiguous(x, fc1, fc2)
    x_scale = None
    if fc1_scale is not None:
        x, x_scale = _quantize(x)
    h, h_scale = eg.gate_up(
        x, rows, fc1, counts, x_scale=x_scale, fc1_scale=fc1_scale, dtype=out.dtype
    )  # fmt: skip
    eg.down(h, fc2, counts, dst, weights, out, h_scale=h_scale, fc2_scale=fc2_scale)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x per token and 128-channel group: the one-pass kernel on CUDA, PyTorch ops elsewhere."""
    fused = kernels.load(x.device)
    if fused is not None:
        return fused.fp8_quantize(x)
    return fp8_gemm.quantize_activations(x)


def _fp8_emulated(
    x: torch.Tensor,
    fc1: torch.Tensor,
    fc1_scale: torch.Tensor,
    fc2: torch.Tensor,
    fc2_scale: torch.Tensor,
    counts: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The FP8 expert FFN from its quantized operands expanded by their scales, in float32:
    each product rounded to `dtype`, SwiGLU's output quantized per row and 128 columns."""
    out = x.new_empty(x.shape[0], fc2.shape[1], dtype=dtype)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            part = x[start : start + n]
            q, s = fp8_gemm.quantize_activations(part)
            up = fp8_gemm.emulated_block_linear(q, s, fc1[e], fc1_scale[e], dtype)
            h = swiglu(up)
            q, s = fp8_gemm.quantize_activations(h)
            out[start : start + n] = fp8_gemm.emulated_block_linear(
                q, s, fc2[e], fc2_scale[e], dtype
            )
        start += n
    return out


@functools.cache
def fused_available(device: torch.device, dtype: torch.dtype, fp8: bool = False) -> bool:
    """Whether the fused Triton expert GEMMs run on `device` for activations of `dtype` (FP8
    weights: block-quantized, sm90+), checked once against the unfused path."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if fp8 and (torch.cuda.get_device_capability(device)[0] < 9 or dtype != torch.bfloat16):
        return False
    if kernels.load(device) is None:
        return False
    try:
        return _probe(device, dtype, fp8)
    except (RuntimeError, ValueError, ImportError):  # Triton cannot build it here
        return False


def _probe(device: torch.device, dtype: torch.dtype, fp8: bool) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    t, k, h, f, e = 24, 2, 256, 128, 3
    x = torch.randn(t, h, device=device, dtype=dtype, generator=gen)
    fc1 = torch.randn(e, 2 * f, h, device=device, generator=gen) / 16
    fc2 = torch.randn(e, h, f, device=device, generator=gen) / 16
    scales = {}
    if fp8:
        (fc1, s1), (fc2, s2) = (_quantize_experts(w) for w in (fc1, fc2))
        scales = {"fc1_scale": s1, "fc2_scale": s2}
    else:
        fc1, fc2 = fc1.to(dtype), fc2.to(dtype)
    ids = torch.randint(0, e - 1, (t * k,), device=device, generator=gen)  # expert 2 gets none
    dst = torch.argsort(ids, stable=True)
    counts = torch.zeros(e, dtype=torch.int64, device=device).scatter_add_(
        0, ids[dst], torch.ones_like(dst)
    )
    weights = torch.rand(t * k, device=device, generator=gen)
    got, want = (torch.zeros(t * k, h, device=device, dtype=dtype) for _ in range(2))
    args = (x, dst // k, dst, weights, counts, fc1, fc2)
    routed_swiglu(*args, got, path="triton", **scales)
    routed_swiglu(*args, want, path="unfused", **scales)
    return bool(torch.allclose(got.float(), want.float(), rtol=3e-2, atol=3e-2))


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a stack of expert weights [E, N, K] as FP8 checkpoints store them, one
    expert at a time into the result (DeepSeek-V3's gate/up weights are 15 GB a layer in bf16)."""
    e, n, k = w.shape
    g = fp8_gemm.GROUP
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(e, -(-n // g), -(-k // g), dtype=torch.float32, device=w.device)
    for i, part in enumerate(w):
        q[i], scale[i] = fp8_gemm.quantize_weight(part)
    return q, scale
