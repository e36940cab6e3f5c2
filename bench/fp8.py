"""FP8 block-scaled GEMMs against bf16 on a Qwen3-8B-shaped stack of dense layers' linears.

Each layer runs the four projections of a Qwen3-8B decoder layer (hidden 4096, 32 q heads and
8 KV heads of 128, intermediate 12288): fused QKV [6144 x 4096], o_proj [4096 x 4096],
gate/up [24576 x 4096], SwiGLU, down [4096 x 12288]; attention itself (the same in every
path) is left out, so the figure is the linears' share. Weights are random, block-quantized
128 x 128 as FP8 checkpoints store them; activations quantized per token and 128-channel
group at run time. Paths, side by side on the same weights and tokens:

    bf16           F.linear on the unquantized weights
    fp8            consumer.forward.fp8_gemm.fp8_block_linear (`auto`: cuBLAS where it runs,
                   the activations quantized by one Triton kernel)
    fp8_unfused_quantize  the same with the activations quantized by PyTorch ops
    fp8_emulated   the same FP8 product expanded to float32 (what the CPU does)
    transformers   transformers' FP8Linear kernel (finegrained_fp8.fp8_linear), if it loads

`gemm_only`: each shape's GEMM alone, bf16 against FP8 on activations quantized beforehand
(the FP8 path's ceiling). Prints tokens/s per path, each FP8 path's relative error against
bf16 at the stack's output, and GB of weights per layer. One fixed token count per run (say
so next to the figure).

    python bench/fp8.py                        # H100/H200: 8 layers, 8192 tokens
    python bench/fp8.py --tokens 512 --layers 2 --device cpu   # smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from consumer.forward import fp8_gemm  # noqa: E402 - after the sys.path insert

HIDDEN, FFN, Q, KV = 4096, 12288, 32 * 128, 8 * 128
SHAPES = {"qkv": (Q + 2 * KV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * FFN, HIDDEN),
          "down": (HIDDEN, FFN)}  # fmt: skip

Linear = Callable[[torch.Tensor, str, int], torch.Tensor]


def _weights(layers: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        {name: (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(torch.bfloat16)
         for name, (n, k) in SHAPES.items()}
        for _ in range(layers)
    ]  # fmt: skip


def _stack(x: torch.Tensor, layers: int, linear: Linear) -> torch.Tensor:
    for i in range(layers):
        qkv = linear(x, "qkv", i)
        x = x + linear(qkv[:, :Q], "o", i)  # attention left out: its q rows stand in
        gate, up = linear(x, "gate_up", i).chunk(2, dim=-1)
        x = x + linear(F.silu(gate) * up, "down", i)
        x = x / x.float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt().to(x.dtype)
    return x


def _time(fn: Callable[[], torch.Tensor], iters: int, device: torch.device) -> float:
    fn()  # warm-up (cuBLAS / Triton autotuning, the scaled_mm probe)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _gemm_only(x, bf16, fp8, iters: int, device: torch.device) -> dict[str, object]:
    """The GEMMs alone, per shape of the first layer: bf16 F.linear against cuBLAS's
    block-scaled FP8 GEMM on activations quantized beforehand (the ceiling of the FP8 path)."""
    out: dict[str, object] = {}
    t = x.shape[0]
    for name, (n, k) in SHAPES.items():
        a = torch.randn(t, k, device=device).to(torch.bfloat16)
        q, s = fp8_gemm.quantize_activations(a)
        w_q, w_s = fp8[0][name]
        b16 = _time(lambda a=a, name=name: F.linear(a, bf16[0][name]), iters * 4, device)
        f8 = _time(
            lambda q=q, s=s, w_q=w_q, w_s=w_s: fp8_gemm.scaled_mm_block_linear(
                q, s, w_q, w_s, torch.bfloat16
            ),
            iters * 4,
            device,
        )
        out[name] = {
            "bf16_tflops": round(2 * t * n * k / b16 / 1e12, 1),
            "fp8_tflops": round(2 * t * n * k / f8 / 1e12, 1),
            "speedup": round(b16 / f8, 3),
        }
    return out


def _transformers_linear() -> tuple[Callable | None, str | None]:
    try:
        from transformers.integrations.finegrained_fp8 import fp8_linear
    except ImportError as exc:
        return None, f"unavailable: {exc}"
    return fp8_linear, None


def main() -> None:
    """Time each path on the same weights and tokens; print one JSON report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    bf16 = _weights(args.layers, device)
    fp8 = [{n: fp8_gemm.quantize_weight(w) for n, w in layer.items()} for layer in bf16]
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.tokens, HIDDEN, generator=gen, device=device).to(torch.bfloat16)

    def path(fp8_path: str, fused: bool = True) -> Linear:
        return lambda h, n, i: fp8_gemm.fp8_block_linear(
            h, *fp8[i][n], path=fp8_path, fused_quantize=fused
        )

    linears: dict[str, Linear] = {
        "bf16": lambda h, n, i: F.linear(h, bf16[i][n]),
        "fp8": path("auto"),
        "fp8_unfused_quantize": path("auto", fused=False),
        "fp8_emulated": path("emulated"),
    }
    tf_linear, tf_why = _transformers_linear()
    if tf_linear is not None:
        linears["transformers"] = lambda h, n, i: tf_linear(h, *fp8[i][n], [128, 128])
    report: dict[str, object] = {
        "shape": "Qwen3-8B layer linears", "tokens": args.tokens, "layers": args.layers,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "fp8_path": fp8_gemm.scaled_mm_unsupported(device, HIDDEN) or "scaled_mm (cuBLAS)",
        "weight_gb_per_layer": {"bf16": sum(n * k for n, k in SHAPES.values()) * 2 / 1e9,
                                "fp8": sum(n * k for n, k in SHAPES.values()) / 1e9},
    }  # fmt: skip
    if tf_why:
        report["transformers"] = tf_why
    with torch.inference_mode():
        want = _stack(x, args.layers, linears["bf16"]).float()
        for name, linear in linears.items():
            try:
                seconds = _time(lambda lin=linear: _stack(x, args.layers, lin), args.iters, device)
                got = _stack(x, args.layers, linear).float()
            except (RuntimeError, ImportError, ValueError) as exc:  # a path this machine lacks
                report[name] = f"failed: {str(exc).splitlines()[0]}"
                continue
            report[name] = {
                "tokens_per_s": round(args.tokens / seconds),
                "ms": round(seconds * 1e3, 2),
                "rel_err_vs_bf16": round(((got - want).norm() / want.norm()).item(), 4),
            }
        if device.type == "cuda" and not fp8_gemm.scaled_mm_unsupported(device, HIDDEN):
            report["gemm_only"] = _gemm_only(x, bf16, fp8, args.iters, device)
    base = report["bf16"]
    for name in ("fp8", "fp8_unfused_quantize", "transformers"):
        entry = report.get(name)
        if isinstance(entry, dict) and isinstance(base, dict):
            entry["speedup_vs_bf16"] = round(entry["tokens_per_s"] / base["tokens_per_s"], 3)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
