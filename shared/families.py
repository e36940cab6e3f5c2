"""The model families teacherq serves from Hugging Face checkpoints: one table, torch-free.

Every reader of a family's properties looks here: the Hugging Face loader
(`consumer/checkpoints/hf.py`, `hf_moe.py`, `hf_mla.py`), the mixture-of-experts layer
(`consumer/forward/moe.py`), the synthetic checkpoint writer (`consumer/checkpoints/synthetic.py`)
and the
torch-free probe `teacherq update-weights` runs (`shared/checkpoint_probe.py`). A family is named
by transformers' `model_type`; its record says what the config leaves implicit (the defaults of
transformers' config class) and how its layers are built.

Adding a family: a `Family` record in `FAMILIES`, then whatever its record names that the code
does not know yet (a routing, an attention, an expert naming).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

Routing = Literal["dense", "softmax", "sigmoid_grouped"]
Attention = Literal["gqa", "mla"]
ExpertNaming = Literal["none", "qwen", "mixtral"]


@dataclass(frozen=True)
class Family:
    """One family: its transformers names and defaults, and how teacherq builds it.

    - `routing`: "dense" (no experts); "softmax" (a float32 softmax over all experts, top-k,
      renormalised iff `norm_topk_prob` or `always_renormalise`: Qwen-MoE, Mixtral);
      "sigmoid_grouped" (DeepSeekMoE: sigmoid scores, a correction bias for the choice only,
      group-limited top-k, `routed_scaling_factor`).
    - `attention`: "gqa" (megatron's grouped-query attention, q/k/v fused per KV group) or
      "mla" (multi-head latent attention, `consumer/forward/mla.py`).
    - `shared_expert`: "none", "gated" (Qwen2-MoE: scaled by sigmoid(shared_expert_gate(x)))
      or "plain" (DeepSeekMoE: `n_shared_experts` x `moe_intermediate_size` wide, ungated).
    - `dense_layers`: how a MoE config names its dense layers: "none" (Mixtral),
      "qwen" (`mlp_only_layers` / `decoder_sparse_step`), "first_k" (`first_k_dense_replace`).
    - `expert_naming`: how a checkpoint names per-expert tensors: "qwen" (`mlp.experts.{e}.
      gate_proj / up_proj / down_proj`, also DeepSeek's and GLM's) or "mixtral"
      (`block_sparse_moe.experts.{e}.w1 / w3 / w2`); fused `mlp.experts.gate_up_proj` is read
      for every family.
    - `expert_ffn_field`: the config field holding each expert's FFN width.
    - `float_router_weights`: the reference scales expert outputs by float32 routing weights
      (else by weights cast to the activations' dtype first).
    - `float_router`: the router weight (and its bias) stay float32 whatever the model's dtype,
      and the router multiplies float32 activations (transformers keeps them in fp32).
    """

    name: str
    architecture: str
    config_class: str
    qkv_bias: bool = False
    qk_norm: bool = False
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    routing: Routing = "dense"
    attention: Attention = "gqa"
    expert_naming: ExpertNaming = "none"
    expert_ffn_field: str = "moe_intermediate_size"
    shared_expert: Literal["none", "gated", "plain"] = "none"
    dense_layers: Literal["none", "qwen", "first_k"] = "none"
    always_renormalise: bool = False
    float_router_weights: bool = False
    float_router: bool = False
    # None: every q/k dim rotates (partial_rotary_factor must be 1); a number: the factor when
    # the config names none (transformers' default), any other in (0, 1] accepted
    partial_rotary_factor: float | None = None
    nextn_layers: bool = False  # published checkpoints carry multi-token-prediction layers
    # other model_types whose config.json is this family's (trust_remote_code configs whose
    # fields are transformers' own, e.g. Kimi-K2's kimi_k2 is DeepSeek-V3's)
    aliases: tuple[str, ...] = ()
    qkv_bias_field: str | None = None  # config field that overrides `qkv_bias`
    qk_norm_field: str | None = None  # config field that overrides `qk_norm`

    @property
    def is_moe(self) -> bool:
        """Whether the family has mixture-of-experts layers."""
        return self.routing != "dense"


_TABLE = (
    Family("llama", "LlamaForCausalLM", "LlamaConfig", max_position_embeddings=2048),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", qkv_bias=True,
           max_position_embeddings=32768),
    # Qwen3Config's own head_dim default is 128, not hidden_size // heads
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3Config", qk_norm=True, head_dim=128,
           max_position_embeddings=32768),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", qk_norm=True, head_dim=128,
           max_position_embeddings=32768, routing="softmax", expert_naming="qwen",
           dense_layers="qwen"),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", qkv_bias=True,
           max_position_embeddings=8192, routing="softmax", expert_naming="qwen",
           shared_expert="gated", dense_layers="qwen", qkv_bias_field="qkv_bias"),
    Family("mixtral", "MixtralForCausalLM", "MixtralConfig",
           max_position_embeddings=4096 * 32, routing="softmax", expert_naming="mixtral",
           expert_ffn_field="intermediate_size", always_renormalise=True,
           float_router_weights=True),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
           max_position_embeddings=4096, routing="sigmoid_grouped", attention="mla",
           expert_naming="qwen", shared_expert="plain", dense_layers="first_k",
           float_router_weights=True, float_router=True, nextn_layers=True,
           aliases=("kimi_k2",)),
    # GLM-4.5 / 4.6 / 4.5-Air: q/k/v biases and q/k norms as the config says
    Family("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig",
           max_position_embeddings=131072, routing="sigmoid_grouped", expert_naming="qwen",
           shared_expert="plain", dense_layers="first_k", float_router_weights=True,
           float_router=True, nextn_layers=True, partial_rotary_factor=0.5,
           qkv_bias_field="attention_bias", qk_norm_field="use_qk_norm"),
)  # fmt: skip

FAMILIES: MappingProxyType[str, Family] = MappingProxyType({f.name: f for f in _TABLE})
"""model_type -> Family, for every family a consumer serves."""

_ALIASES = {alias: f for f in _TABLE for alias in f.aliases}

MOE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.is_moe)
"""The mixture-of-experts families, in table order."""

# model_types transformers knows as mixture-of-experts; those outside FAMILIES are refused
# with that reason (a config of one may not say so in any field teacherq reads).
KNOWN_MOE_MODEL_TYPES = frozenset(
    {
        *MOE_FAMILIES,
        "qwen3_next",
        "deepseek_v2",
        "deepseek_v32",
        "dbrx",
        "olmoe",
        "granitemoe",
        "phimoe",
        "jetmoe",
        "llama4",
        "llama4_text",
        "gpt_oss",
        "glm4_moe_lite",
    }
)


def family_of(model_type: object, architectures: object = ()) -> Family | None:
    """The family a config names: by `model_type` (or one of a family's aliases), or (only
    when that is absent) by one of its `architectures`; None when it names none teacherq
    serves."""
    if isinstance(model_type, str) and model_type in FAMILIES:
        return FAMILIES[model_type]
    if isinstance(model_type, str) and model_type in _ALIASES:
        return _ALIASES[model_type]
    if model_type is None and isinstance(architectures, list | tuple):
        by_arch = {f.architecture: f for f in FAMILIES.values()}
        for arch in architectures:
            if arch in by_arch:
                return by_arch[arch]
    return None


def describe() -> str:
    """'name (Architecture), ...' for messages that list what is served."""
    return ", ".join(f"{f.name} ({f.architecture})" for f in FAMILIES.values())
