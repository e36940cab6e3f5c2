"""`ModelSpec`: a teacher's architecture in plain numbers, and the tiny built-in preset.

A leaf module (no torch, no megatron): the checkpoint readers, the model builder, the
mixture-of-experts and latent-attention layers all take a spec, and none of them needs another
to describe one. Per-family behaviour (how routing works, which attention) is looked up in
`shared/families.py` by `ModelSpec.family`; the spec holds the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.families import FAMILIES, Family

VOCAB_PAD_MULTIPLE = 128  # per TP rank, as Megatron's --make-vocab-size-divisible-by


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer in plain numbers: the dense Llama / Qwen2 / Qwen3 families,
    the mixture-of-experts Qwen3-MoE / Qwen2-MoE / Mixtral / GLM-4.5 ones, and DeepSeek-V3 with
    multi-head latent attention. `num_experts` = 0 is a dense model; `kv_lora_rank` > 0 is
    latent attention (then `num_kv_heads` equals the heads and `head_dim` is ignored)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope_scaling: dict | None = field(default=None, hash=False)
    rotary_percent: float = 1.0  # share of each head's dims that rotate (GLM-4.5: 0.5)
    num_experts: int = 0  # routed experts per sparse layer; 0: dense
    moe_top_k: int = 0  # experts per token
    moe_ffn_hidden_size: int = 0  # each expert's intermediate size
    moe_norm_topk: bool = False  # renormalise the top-k weights (Mixtral always does)
    moe_shared_ffn_hidden_size: int = 0  # the shared expert's width (all of them); 0: none
    moe_dense_layers: tuple[int, ...] = ()  # layers of a MoE model that keep a dense MLP
    moe_groups: int = 1  # DeepSeekMoE: expert groups (n_group)
    moe_topk_groups: int = 1  # DeepSeekMoE: groups a token may pick experts from (topk_group)
    moe_routed_scale: float = 1.0  # DeepSeekMoE: routed_scaling_factor
    q_lora_rank: int = 0  # latent attention: rank of q's down-projection; 0: q projected directly
    kv_lora_rank: int = 0  # latent attention: rank of the joint k/v latent; 0: not latent
    qk_nope_head_dim: int = 0  # latent attention: per-head q/k dims without rotation
    qk_rope_head_dim: int = 0  # latent attention: per-head q/k dims with rotation
    v_head_dim: int = 0  # latent attention: per-head value dims
    rope_interleave: bool = False  # rotated dims stored as interleaved pairs (DeepSeek)

    @property
    def family_record(self) -> Family | None:
        """This spec's row of the family table (None for a spec from a Megatron trainer)."""
        return FAMILIES.get(self.family)

    @property
    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers."""
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (DeepSeek-V3)."""
        return self.kv_lora_rank > 0

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) is a mixture-of-experts layer."""
        return self.is_moe and index not in self.moe_dense_layers

    @property
    def max_input_tokens(self) -> int:
        """Longest input this model scores: max_position_embeddings, or the context its RoPE
        scaling extends the original one to (factor x original_max_position_embeddings)."""
        scaling = self.rope_scaling or {}
        original = scaling.get("original_max_position_embeddings")
        if original and scaling.get("factor"):
            extended = int(float(scaling["factor"]) * int(original))
            return max(self.max_position_embeddings, extended)
        return self.max_position_embeddings

    @property
    def kv_channels(self) -> int:
        """Per-head dimension of q and k (latent attention: nope + rope dims)."""
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """How many of each head's q/k dims rotate."""
        if self.is_mla:
            return self.qk_rope_head_dim
        return int(self.kv_channels * self.rotary_percent)

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary padded so every TP rank holds the same multiple of VOCAB_PAD_MULTIPLE."""
        multiple = VOCAB_PAD_MULTIPLE * tp
        return -(-self.vocab_size // multiple) * multiple


# The built-in preset used when TEACHERQ_MODEL__PATH is unset: tiny, random-init, fixed seed.
TINY_SEED = 1234
TINY = ModelSpec(
    family="tiny",
    vocab_size=1000,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=128,
    max_position_embeddings=4096,
)


def param_dtype(setting: str, device_type: str):
    """The parameters' torch dtype for `model.dtype` = `setting` on a `device_type` device:
    auto is bfloat16 on CUDA, float32 elsewhere."""
    import torch

    if setting == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[setting]
