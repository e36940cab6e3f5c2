"""FP8 block-quantized Hugging Face checkpoints, as DeepSeek-V3/R1, Kimi-K2 and the `-FP8`
releases of Qwen3 and GLM-4.5 publish them: dequantized at load, on each rank's slice.

The format (`config.json` -> `quantization_config`): `quant_method: fp8`, `fmt: e4m3`,
`activation_scheme: dynamic`, `weight_block_size: [BR, BC]`, optionally
`modules_to_not_convert`. Each quantized linear stores `weight` [out, in] in float8_e4m3fn
and beside it a float32 `weight_scale_inv` [ceil(out / BR), ceil(in / BC)]: the real weight
is each stored value times the scale of its block. Tensors kept unquantized (norms, routers,
embeddings, lm_head, `modules_to_not_convert`) simply have no scale and load as before.

A rank reads only its slice of a weight and the scale blocks that slice touches, then
multiplies in float32 (the parameter's copy casts to the model's dtype). The multiply is exact
for any slice; a TP split whose per-rank share is not whole blocks is still refused
(`split_problems`), since block-scaled FP8 compute needs every rank to own whole blocks.
Shape letters: E experts, R rows (out), C columns (in).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from consumer.forward.spec import ModelSpec

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3",)  # the safetensors header's name for float8_e4m3fn


@dataclass(frozen=True)
class Fp8Format:
    """What `quantization_config` says about a block-quantized FP8 checkpoint."""

    block_rows: int
    block_cols: int
    not_converted: tuple[str, ...] = ()


def fp8_compute_problem(mode: str, device: torch.device | str, fmt: Fp8Format) -> str | None:
    """Why an FP8 checkpoint in `fmt` is dequantized at load under `model.fp8` = `mode` on
    `device`, or None when its linears can run FP8 GEMMs (`auto` on sm90+ with cuBLAS's
    block-scaled kernel and 128 x 128 blocks)."""
    from consumer.forward import fp8_gemm

    device = torch.device(device)
    return format_problem(mode, fmt) or fp8_gemm.scaled_mm_unsupported(device, 4 * fp8_gemm.GROUP)


def format_problem(mode: str, fmt: Fp8Format) -> str | None:
    """`fp8_compute_problem`'s part that the setting and the format decide, device aside."""
    from consumer.forward import fp8_gemm

    if mode == "dequantize":
        return "model.fp8=dequantize"
    if (fmt.block_rows, fmt.block_cols) != (fp8_gemm.GROUP, fp8_gemm.GROUP):
        return f"weight_block_size [{fmt.block_rows}, {fmt.block_cols}]: FP8 GEMMs take 128x128"
    return None


def quantization_problems(config: dict) -> list[str]:
    """Why the `quantization_config` of a config.json dict cannot be loaded (empty if it can,
    or if there is none)."""
    q = config.get("quantization_config")
    if not q:
        return []
    if not isinstance(q, dict):
        return ["quantization_config is not a JSON object"]
    method = q.get("quant_method")
    if method != "fp8":
        return [f"quantization_config.quant_method={method!r} (only 'fp8' block-quantized)"]
    problems = []
    if q.get("fmt", "e4m3") != "e4m3":
        problems.append(f"quantization_config.fmt={q.get('fmt')!r} (only 'e4m3')")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(
            f"quantization_config.activation_scheme={q.get('activation_scheme')!r} "
            "(only 'dynamic': static activation scales are not read)"
        )
    block = q.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        problems.append(
            f"quantization_config.weight_block_size={block!r} (only block-wise scales, "
            "[rows, cols] of positive integers)"
        )
    return problems


def fp8_format(config: dict) -> Fp8Format | None:
    """The FP8 format of a config.json dict, or None when it is not quantized. Call
    `quantization_problems` first: a config it refuses raises ValueError here."""
    q = config.get("quantization_config")
    if not q:
        return None
    problems = quantization_problems(config)
    if problems:
        raise ValueError("; ".join(problems))
    rows, cols = q["weight_block_size"]
    return Fp8Format(rows, cols, tuple(q.get("modules_to_not_convert") or ()))


def scale_name(weight: str) -> str:
    """The scale tensor's name for a quantized tensor's name (`x.weight` ->
    `x.weight_scale_inv`; a fused expert tensor `x.gate_up_proj` -> `x.gate_up_proj_scale_inv`)."""
    return weight + SCALE_SUFFIX


def scale_shape(shape: Sequence[int], fmt: Fp8Format) -> tuple[int, ...]:
    """The scale shape of a quantized tensor of `shape` ([..., R, C] -> [..., R/BR, C/BC],
    rounded up)."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / fmt.block_rows), math.ceil(cols / fmt.block_cols))


def scales_of(names: Iterable[str]) -> dict[str, str]:
    """Quantized tensor name -> its scale's name, for every scale stored among `names`."""
    stored = set(names)
    out = {}
    for name in stored:
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)]
            if weight in stored:
                out[weight] = name
    return out


def slice_ranges(shape: Sequence[int], slices: Sequence[slice]) -> list[tuple[int, int]]:
    """(start, stop) per dimension of `shape` that contiguous `slices` (leading dims; the rest
    whole) select."""
    out = []
    for i, n in enumerate(shape):
        s = slices[i] if i < len(slices) else slice(None)
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"FP8 reads take contiguous slices, got step {step}")
        out.append((start, stop))
    return out


def read_dequantized(weight_view, scale_view, slices: Sequence[slice], fmt: Fp8Format):
    """`weight_view[slices]` (a safetensors slice of an FP8 tensor [..., R, C]) times the scale
    of each element's block, in float32; reads only the scale blocks the slice touches."""
    ranges = slice_ranges(weight_view.get_shape(), slices)
    if len(ranges) < 2:
        raise ValueError("an FP8-quantized tensor must have at least two dimensions")
    weight = weight_view[tuple(slice(a, b) for a, b in ranges)]
    (r0, r1), (c0, c1) = ranges[-2], ranges[-1]
    br, bc = fmt.block_rows, fmt.block_cols
    scale_slices = [slice(a, b) for a, b in ranges[:-2]]
    scale_slices += [slice(r0 // br, -(-r1 // br)), slice(c0 // bc, -(-c1 // bc))]
    scale = scale_view[tuple(scale_slices)].to(torch.float32)
    scale = scale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    dr, dc = r0 - (r0 // br) * br, c0 - (c0 // bc) * bc
    scale = scale[..., dr : dr + (r1 - r0), dc : dc + (c1 - c0)]
    return weight.to(torch.float32) * scale


def split_problems(
    spec: ModelSpec, fmt: Fp8Format, quantized: Iterable[str], *, tp: int, ep: int = 1
) -> list[str]:
    """Why splitting this FP8 checkpoint's quantized tensors over `tp` x `ep` would cut its
    scale blocks (empty when every rank's share is whole blocks). `quantized`: the names of
    the tensors stored with a scale (a module kept unquantized constrains nothing)."""
    names = list(quantized)
    br, bc = fmt.block_rows, fmt.block_cols
    checks: list[tuple[str, str, int, int, int]] = []  # (marker, what, size, parts, block)
    if tp > 1 and spec.is_mla:
        heads = spec.num_attention_heads // tp
        qk, v, kv = spec.kv_channels, spec.v_head_dim, spec.qk_nope_head_dim + spec.v_head_dim
        q = "self_attn.q_b_proj." if spec.q_lora_rank else "self_attn.q_proj."
        checks += [
            (q, f"rows ({heads} heads x {qk})", heads * qk, 1, br),
            ("self_attn.kv_b_proj.", f"rows ({heads} heads x {kv})", heads * kv, 1, br),
            ("self_attn.o_proj.", f"columns ({heads} heads x {v})", heads * v, 1, bc),
        ]  # fmt: skip
    elif tp > 1:
        d = spec.kv_channels
        q_rows, kv_rows = spec.num_attention_heads * d, spec.num_kv_heads * d
        checks += [
            ("self_attn.q_proj.", "rows (num_attention_heads x head_dim / tp)", q_rows, tp, br),
            ("self_attn.k_proj.", "rows (num_key_value_heads x head_dim / tp)", kv_rows, tp, br),
            ("self_attn.v_proj.", "rows (num_key_value_heads x head_dim / tp)", kv_rows, tp, br),
            ("self_attn.o_proj.", "columns (num_attention_heads x head_dim / tp)", q_rows, tp, bc),
        ]  # fmt: skip
    if tp > 1 and (not spec.is_moe or spec.moe_dense_layers):
        f = spec.ffn_hidden_size
        checks += [
            (".mlp.gate_proj.", "rows (intermediate_size / tp)", f, tp, br),
            (".mlp.down_proj.", "columns (intermediate_size / tp)", f, tp, bc),
        ]
    width = max(tp, ep)
    etp = width // ep
    if spec.is_moe and etp > 1:
        f, what = spec.moe_ffn_hidden_size, "moe_intermediate_size x ep / max(tp, ep)"
        checks += [
            (".experts.", f"rows ({what})", f, etp, br),
            (".experts.", f"columns ({what})", f, etp, bc),
        ]
    if spec.is_moe and spec.moe_shared_ffn_hidden_size and width > 1:
        s, what = spec.moe_shared_ffn_hidden_size, "shared expert FFN / max(tp, ep)"
        checks += [
            ("shared_expert", f"rows ({what})", s, width, br),
            ("shared_expert", f"columns ({what})", s, width, bc),
        ]
    problems = []
    for marker, what, size, parts, block in checks:
        share = size // parts
        if share % block and any(marker in n for n in names):
            problems.append(
                f"{marker.strip('.')}: each rank's {share} {what} cut the FP8 scale blocks "
                f"(quantization_config.weight_block_size [{br}, {bc}]) at tp={tp} ep={ep}"
            )
    return sorted(set(problems))
