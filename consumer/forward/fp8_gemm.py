"""Block-scaled FP8 GEMMs for FP8 checkpoints: y = x @ W^T with W stored in float8_e4m3fn and
one float32 scale per 128 x 128 block (the checkpoint's `weight_scale_inv`), and x quantized
at run time per token and 128-channel group (DeepSeek-V3's recipe, `activation_scheme:
dynamic`).

Two paths compute the same quantized product:

- `scaled_mm`: `torch._scaled_mm` with (BlockWise1x128, BlockWise128x128) scales, i.e.
  cuBLAS's block-scaled FP8 GEMM: sm90+ and CUDA >= 12.9; the activation scales go in
  outer-dim-major ([T, G] with stride (1, T)) and the weight scales as [G, N/128] with the
  group dim innermost; cuBLAS wants G a multiple of 4 (K a multiple of 512), else the
  emulated path runs.
- `emulated`: the same FP8 operands expanded by their scales and multiplied in float32 (any
  device): the reference the GPU test holds `scaled_mm` to.

`consumer/checkpoints/hf_fp8_linears.py` puts it in the model's tensor-parallel linears.
Shape letters: T tokens, K input features, N output features, G = K / 128 groups.
"""

from __future__ import annotations

import functools

import torch

from consumer import kernels

FP8_MAX = 448.0  # largest finite float8_e4m3fn
GROUP = 128  # activation channels per scale, and the weight block cuBLAS accepts
_TINY = 1e-12  # keeps an all-zero group's scale positive


def quantize_activations(x_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per token and 128-channel group: returns (float8_e4m3fn [T, K],
    float32 scales [T, G]) with x ~= fp8 x scale; K must be a multiple of 128."""
    t, k = x_TK.shape
    if k % GROUP:
        raise ValueError(f"FP8 activations need a multiple of {GROUP} channels, got {k}")
    groups_TGC = x_TK.float().view(t, k // GROUP, GROUP)
    scale_TG = groups_TGC.abs().amax(dim=-1).clamp(min=_TINY) / FP8_MAX
    q_TK = (groups_TGC / scale_TG[..., None]).to(torch.float8_e4m3fn).view(t, k)
    return q_TK, scale_TG


def dequantize_weight(
    w_NK: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (GROUP, GROUP)
) -> torch.Tensor:
    """A block-quantized weight in float32: each stored value times its block's scale."""
    br, bc = block
    n, k = w_NK.shape
    full = scale_inv.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)[:n, :k]
    return w_NK.float() * full


def emulated_block_linear(
    q_TK: torch.Tensor,
    scale_TG: torch.Tensor,
    w_NK: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    block: tuple[int, int] = (GROUP, GROUP),
) -> torch.Tensor:
    """The quantized product computed in float32 from the expanded operands (any device,
    any weight block)."""
    t, k = q_TK.shape
    x_TK = (q_TK.float().view(t, k // GROUP, GROUP) * scale_TG[..., None]).view(t, k)
    return (x_TK @ dequantize_weight(w_NK, scale_inv, block).T).to(out_dtype)


def scaled_mm_block_linear(
    q_TK: torch.Tensor,
    scale_TG: torch.Tensor,
    w_NK: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The quantized product through cuBLAS's block-scaled FP8 GEMM (`torch._scaled_mm`).
    Tokens are padded to a multiple of 16 (cuBLAS's FP8 alignment; scale strides stay
    unambiguous for one token)."""
    t = q_TK.shape[0]
    pad = -t % 16
    if pad:
        q_TK = torch.cat([q_TK, q_TK.new_zeros(pad, q_TK.shape[1])])
        scale_TG = torch.cat([scale_TG, scale_TG.new_ones(pad, scale_TG.shape[1])])
    a_scale = scale_TG.t().contiguous().t()  # outer-dim-major, as cuBLAS reads 1x128 scales
    b_scale = scale_inv.float().contiguous().t()  # [G, N/128], group dim innermost
    y = torch._scaled_mm(q_TK, w_NK.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)
    return y[:t]


def scaled_mm_unsupported(device: torch.device | str, k: int) -> str | None:
    """Why the cuBLAS path cannot run a GEMM with `k` input features on `device` (None when
    it can): the device, its capability, the CUDA version, the K alignment, or a failed probe."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"no FP8 GEMM on {device.type}"
    if k % (4 * GROUP):
        return f"K={k} is not a multiple of {4 * GROUP} (cuBLAS pads 128x128 scales to 4 groups)"
    return _device_problem(device.index if device.index is not None else 0)


def platform_problem(index: int = 0) -> str | None:
    """What `scaled_mm_unsupported` finds against CUDA device `index` before its probe: the
    device's capability and the CUDA version, asked without a launch (what the precompile
    workers, which create no CUDA context, can know)."""
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return f"sm{major}{minor}: block-scaled FP8 GEMMs need sm90+"
    return cuda_problem()


def cuda_problem() -> str | None:
    """Why torch's CUDA build has no block-scaled FP8 GEMM (None where it has)."""
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 9):
        return f"CUDA {torch.version.cuda}: cuBLAS block-scaled FP8 needs 12.9+"
    return None


@functools.cache
def _device_problem(index: int) -> str | None:
    if problem := platform_problem(index):
        return problem
    device = torch.device("cuda", index)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 512, generator=gen, device=device)
    w = torch.randn(256, 512, generator=gen, device=device) / 20
    w_q, w_s = quantize_weight(w)
    q, s = quantize_activations(x)
    try:
        got = scaled_mm_block_linear(q, s, w_q, w_s, torch.float32)
    except RuntimeError as exc:  # the build lacks the block-scaled kernels
        return f"torch._scaled_mm refused block scales: {str(exc).splitlines()[0]}"
    want = emulated_block_linear(q, s, w_q, w_s, torch.float32)
    if not torch.allclose(got, want, atol=1e-2, rtol=1e-2):
        return "torch._scaled_mm block-scaled probe disagreed with the emulated product"
    return None


@torch.no_grad()
def quantize_weight(
    w_NK: torch.Tensor, block: tuple[int, int] = (GROUP, GROUP)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a weight as FP8 checkpoints store it: (float8_e4m3fn [N, K], float32
    scale_inv [ceil(N / br), ceil(K / bc)]) with each block's absmax at 448. Without autograd:
    from a parameter, a graph would keep the float32 copies of every block alive."""
    br, bc = block
    n, k = w_NK.shape
    nr, nc = -(-n // br), -(-k // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32, device=w_NK.device)
    padded[:n, :k] = w_NK.float()
    blocks = padded.view(nr, br, nc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=_TINY) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nr * br, nc * bc)
    return q[:n, :k].contiguous(), scale


def fp8_block_linear(
    x: torch.Tensor,
    w_NK: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    path: str = "auto",
    block: tuple[int, int] = (GROUP, GROUP),
    fused_quantize: bool = True,
) -> torch.Tensor:
    """y = x @ W^T for a block-quantized FP8 weight (`block`: its scale blocks; cuBLAS takes
    128 x 128 only), x quantized per token and 128-channel group. `path`: `auto` (cuBLAS
    where `scaled_mm_unsupported` finds nothing against it, else emulated), `scaled_mm` or
    `emulated`. On CUDA the cuBLAS path quantizes x in one Triton kernel
    (`consumer.kernels.fp8_quant`; `fused_quantize=False`: PyTorch ops, for comparison).
    x: [..., K] -> [..., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x_TK = x.reshape(-1, k)
    out_dtype = out_dtype or x.dtype
    if path == "auto":
        cublas = block == (GROUP, GROUP) and not scaled_mm_unsupported(x.device, k)
        path = "scaled_mm" if cublas else "emulated"
    fused = kernels.load(x.device) if path == "scaled_mm" and fused_quantize else None
    if fused is not None:  # one Triton pass quantizes, pads and lays out for cuBLAS
        q_TK, a_scale = fused.fp8_quantize(x_TK)
        y = torch._scaled_mm(
            q_TK, w_NK.t(), scale_a=a_scale, scale_b=scale_inv.t(), out_dtype=out_dtype
        )[: x_TK.shape[0]]
        return y.view(*lead, w_NK.shape[0])
    q_TK, scale_TG = quantize_activations(x_TK)
    if path == "scaled_mm":
        y = scaled_mm_block_linear(q_TK, scale_TG, w_NK, scale_inv, out_dtype)
    elif path == "emulated":
        y = emulated_block_linear(q_TK, scale_TG, w_NK, scale_inv, out_dtype, block)
    else:
        raise ValueError(f"path must be 'auto', 'scaled_mm' or 'emulated', got {path!r}")
    return y.view(*lead, w_NK.shape[0])
