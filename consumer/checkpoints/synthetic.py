"""Small random-init Hugging Face checkpoints of each supported family, made locally.

Tests and demos need real checkpoint directories (config.json + safetensors written by
transformers itself) without downloading anything. Weights are redrawn at unit scale after
transformers' init: its defaults (std 0.02, unit norms, zero biases) would give near-uniform
attention and predictions, under which a wrong RoPE, bias or norm mapping could go unnoticed.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
# Router weights are drawn this many times larger than other matrices: router logits of a few
# units apart make the choice of experts decisive, so rounding cannot flip it between layouts.
ROUTER_SCALE = 4.0


def hf_config(
    family: str,
    *,
    vocab_size: int = 500,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
    tie_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    max_position_embeddings: int | None = None,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    shared_expert_intermediate_size: int = 48,
    norm_topk_prob: bool = False,
    mlp_only_layers: tuple[int, ...] = (),
    decoder_sparse_step: int = 1,
):
    """A transformers config object for a small model of `family` (see FAMILIES); the
    mixture-of-experts arguments apply to qwen3_moe, qwen2_moe (shared expert) and mixtral
    (whose experts are `intermediate_size` wide, always renormalised, never dense)."""
    from transformers import (
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "qwen3_moe": Qwen3MoeConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "mixtral": MixtralConfig,
    }
    if family not in classes:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling:
        rope.update(rope_scaling)
    kwargs: dict[str, object] = {}
    if head_dim is not None or family in ("qwen3", "qwen3_moe"):
        # Qwen3's own default head_dim is 128 whatever the hidden size
        kwargs["head_dim"] = head_dim or hidden_size // num_attention_heads
    if max_position_embeddings is None:
        original = (rope_scaling or {}).get("original_max_position_embeddings", 0)
        max_position_embeddings = max(4096, 4 * int(original))
    if family == "mixtral":
        kwargs.update(num_local_experts=num_experts, num_experts_per_tok=top_k)
    elif family in MOE_FAMILIES:
        kwargs.update(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=norm_topk_prob,
            mlp_only_layers=list(mlp_only_layers),
            decoder_sparse_step=decoder_sparse_step,
        )
        if family == "qwen2_moe":
            kwargs["shared_expert_intermediate_size"] = shared_expert_intermediate_size
    return classes[family](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        rope_parameters=rope,
        **kwargs,
    )


def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim == 1 and "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif param.ndim == 1:  # q/k/v biases
                param.copy_(0.2 * noise)
            elif name.endswith("mlp.gate.weight"):  # a MoE router
                param.copy_(ROUTER_SCALE * noise / math.sqrt(param.shape[-1]))
            else:  # [out, in] or experts' [E, out, in]
                param.copy_(noise / math.sqrt(param.shape[-1]))


def write_random_hf_checkpoint(
    out: str | Path,
    family: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    **sizes,
) -> Path:
    """Write a random-init `family` checkpoint (config.json + safetensors) into `out`.

    `sizes` are `hf_config`'s keyword arguments (vocab_size, hidden_size, num_layers,
    num_attention_heads, num_kv_heads, intermediate_size, head_dim, tie_embeddings, rope_theta,
    rope_scaling, max_position_embeddings). `max_shard_size` (e.g. "40KB") splits the weights
    over several files with a model.safetensors.index.json. Returns `out`.
    """
    from transformers import AutoModelForCausalLM

    config = hf_config(family, **sizes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    model.to(dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out
