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

from shared.families import FAMILIES, MOE_FAMILIES

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
    n_shared_experts: int = 1,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    first_k_dense_replace: int = 1,
    q_lora_rank: int | None = 24,
    kv_lora_rank: int = 16,
    qk_nope_head_dim: int = 8,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 12,
    rope_interleave: bool = True,
    partial_rotary_factor: float | None = None,
    use_qk_norm: bool = False,
    attention_bias: bool = False,
):
    """A transformers config object for a small model of `family` (a name of
    `shared.families.FAMILIES`); the mixture-of-experts arguments apply to qwen3_moe, qwen2_moe
    (shared expert), mixtral (whose experts are `intermediate_size` wide, always renormalised,
    never dense), deepseek_v3 and glm4_moe (`n_shared_experts`, `n_group`, `topk_group`,
    `routed_scaling_factor`, `first_k_dense_replace`); the latent-attention ones (q_lora_rank
    ... rope_interleave) to deepseek_v3; `partial_rotary_factor`, `use_qk_norm` and
    `attention_bias` to glm4_moe."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {family!r}")
    config_class = getattr(transformers, FAMILIES[family].config_class)
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
    elif FAMILIES[family].routing == "sigmoid_grouped":
        kwargs.update(
            n_routed_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=norm_topk_prob,
            n_shared_experts=n_shared_experts,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
            first_k_dense_replace=first_k_dense_replace,
        )
        if family == "deepseek_v3":
            kwargs.update(
                q_lora_rank=q_lora_rank,
                kv_lora_rank=kv_lora_rank,
                qk_nope_head_dim=qk_nope_head_dim,
                qk_rope_head_dim=qk_rope_head_dim,
                v_head_dim=v_head_dim,
                rope_interleave=rope_interleave,
            )
        else:
            kwargs.update(use_qk_norm=use_qk_norm, attention_bias=attention_bias)
            if partial_rotary_factor is not None:
                rope["partial_rotary_factor"] = partial_rotary_factor
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
    return config_class(
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
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeekMoE: moves the choice only
                noise = torch.randn(buffer.shape, generator=gen, dtype=torch.float32)
                buffer.copy_(0.5 * noise)


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
