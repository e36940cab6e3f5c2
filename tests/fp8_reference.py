"""A reference block-wise FP8 quantizer for tests (#40), independent of teacherq's loader: it
turns a transformers checkpoint into the format DeepSeek-V3 and the `-FP8` releases publish
(float8_e4m3fn weights, a float32 `weight_scale_inv` per block) and writes the exact
dequantization of that beside it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from shared.messages import Job, TeacherRequest

VOCAB = 300
FP8_MAX = 448.0  # largest finite float8_e4m3fn
LENGTHS = [9, 14, 6]


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """Which tensors the reference quantizes: the linears' weights, as the published
    checkpoints do (not embeddings, lm_head, norms, routers, biases)."""
    if tensor.ndim < 2 or "embed_tokens" in name or name.startswith("lm_head"):
        return False
    return not name.endswith("mlp.gate.weight") and "norm" not in name


def quantize_blockwise(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer: each [br, bc] block of the last two dims scaled by its absmax / 448
    into float8_e4m3fn; returns (fp8 weight, float32 scale_inv [.., ceil(R/br), ceil(C/bc)])."""
    br, bc = block
    *lead, rows, cols = w.shape
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.zeros(*lead, nr * br, nc * bc, dtype=torch.float32)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.reshape(*lead, nr, br, nc, bc)
    absmax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, nr * br, nc * bc)[..., :rows, :cols].contiguous()
    return q, scale


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    """Reference dequantization: each stored value times its block's scale, in float32."""
    br, bc = block
    *lead, rows, cols = q.shape
    nr, nc = scale.shape[-2:]
    padded = torch.zeros(*lead, nr * br, nc * bc, dtype=torch.float32)
    padded[..., :rows, :cols] = q.float()
    blocks = padded.reshape(*lead, nr, br, nc, bc) * scale[..., :, None, :, None]
    return blocks.reshape(*lead, nr * br, nc * bc)[..., :rows, :cols].contiguous()


def write_fp8_pair(source: Path, out: Path, block: list[int], **quant) -> tuple[Path, Path]:
    """From a transformers checkpoint, write its FP8 version (`out/fp8`) and the reference
    dequantization of that (`out/ref`, float32, no quantization_config)."""
    fp8, ref = out / "fp8", out / "ref"
    for d in (fp8, ref):
        d.mkdir(parents=True)
        for f in source.iterdir():
            if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, d / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(f))
    stored, plain = {}, {}
    for name, t in tensors.items():
        if quantized(name, t):
            q, scale = quantize_blockwise(t, block)
            stored[name], stored[name + "_scale_inv"] = q, scale
            plain[name] = dequantize_blockwise(q, scale, block)
        else:
            stored[name], plain[name] = t, t.float()
    save_file(stored, str(fp8 / "model.safetensors"))
    save_file(plain, str(ref / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": block, **quant}  # fmt: skip
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, ref


def fp8_jobs() -> list[Job]:
    """Three short jobs over VOCAB asking for the top 3."""
    rng = np.random.default_rng(5)
    return [
        Job(job_id=f"j{i}", entry_id=f"0-{i}", submitted_at=0.0,
            request=TeacherRequest(input_ids=rng.integers(0, VOCAB, n).tolist(), top_k=3))
        for i, n in enumerate(LENGTHS)
    ]  # fmt: skip
