"""A Hugging Face `config.json` -> `ModelSpec`: which family (the table in `shared/families.py`),
which of its features teacherq reproduces exactly, and the numbers of the spec.

Every refusal is one `CheckpointError` naming the field and its value: an unknown or
unsupported mixture-of-experts architecture, sliding-window attention, output or MLP biases,
activations other than SiLU, quantizations other than block-wise FP8 (`hf_fp8.py`), RoPE
variants megatron-core (or, for latent attention, `consumer/forward/mla.py`) does not compute, and
splits over tp x ep that do not divide.
"""

from __future__ import annotations

import inspect
import math

from consumer.checkpoints import hf_mla, hf_moe
from consumer.checkpoints.hf_fp8 import quantization_problems
from consumer.checkpoints.validate import CheckpointError, check_parallel
from consumer.forward.spec import ModelSpec
from shared.families import FAMILIES, KNOWN_MOE_MODEL_TYPES, Family, describe, family_of

SUPPORTED_FAMILIES = tuple(FAMILIES)

# Config fields that only mixture-of-experts configs set to a non-empty value.
_MOE_FIELDS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "shared_expert_intermediate_size",
)


def megatron_llama3_constants() -> dict[str, float]:
    """The llama3 RoPE parameters megatron-core applies besides the factor (fixed by it)."""
    # megatron's GPTModel passes only `rope_scaling_factor` on to RotaryEmbedding._apply_scaling;
    # the other llama3 parameters stay at that method's defaults, read here so that a config is
    # judged against what the installed megatron-core really computes.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    params = inspect.signature(RotaryEmbedding._apply_scaling).parameters
    names = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return {name: float(params[name].default) for name in names}


# --------------------------------------------------------------------------------------------
# config.json -> ModelSpec


def moe_reason(config: dict) -> str | None:
    """Why `config` describes a mixture-of-experts model, or None for a dense one."""
    model_type = str(config.get("model_type") or "")
    if model_type in KNOWN_MOE_MODEL_TYPES or "moe" in model_type.lower():
        return f"model_type {model_type!r} is a mixture-of-experts architecture"
    for arch in config.get("architectures") or []:
        lowered = str(arch).lower()
        if "moe" in lowered or "mixtral" in lowered:
            return f"architecture {arch!r} is a mixture-of-experts architecture"
    for name in _MOE_FIELDS:
        value = config.get(name)
        if value not in (None, 0, False, [], {}):
            return f"config sets {name}={value!r} (a mixture-of-experts field)"
    return None


def _family(config: dict) -> Family:
    family = family_of(config.get("model_type"), config.get("architectures"))
    if family is None:
        raise CheckpointError(
            f"unsupported architecture: model_type={config.get('model_type')!r}, "
            f"architectures={config.get('architectures')!r}; supported families: {describe()}"
        )
    return family


def _rope(config: dict, family: Family) -> tuple[float, dict | None, float]:
    """(rope_theta, normalised rope_scaling or None, partial_rotary_factor), accepting both
    config generations.

    transformers < 5 writes `rope_theta` and `rope_scaling` at the top level; transformers 5
    writes one `rope_parameters` dict holding the theta, the type and its parameters.
    """
    params = config.get("rope_parameters") or {}
    if params and not isinstance(params, dict):
        raise CheckpointError(f"rope_parameters must be a dict, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise CheckpointError("per-layer-type rope_parameters are not supported")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = dict(config.get("rope_scaling") or params)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    default = family.partial_rotary_factor or 1.0
    partial = scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", default))
    partial = default if partial is None else float(partial)
    if partial != 1.0 and family.partial_rotary_factor is None:
        raise CheckpointError(
            f"partial_rotary_factor={partial} is not supported for {family.name} (only 1.0)"
        )
    if not 0.0 < partial <= 1.0:
        raise CheckpointError(f"partial_rotary_factor={partial} must be in (0, 1]")
    if theta is None or float(theta) <= 0:
        raise CheckpointError(f"rope_theta must be positive, got {theta!r}")
    theta = float(theta)
    if not theta.is_integer():
        # build_model hands megatron an integer rotary_base
        raise CheckpointError(f"rope_theta={theta} is not an integer; megatron needs an int base")
    if kind == "default":
        return theta, None, partial
    if kind == "linear" and family.attention == "gqa":
        if not scaling.get("factor"):
            raise CheckpointError("linear rope scaling lacks its factor")
        return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}, partial
    if kind == "llama3" and family.attention == "gqa":
        return theta, {"rope_type": "llama3", **_llama3_params(config, scaling)}, partial
    if kind == "yarn" and family.attention == "mla":
        return theta, hf_mla.yarn_params(config, scaling), partial
    supported = "'yarn'" if family.attention == "mla" else "'llama3' (with megatron's fixed "
    supported += "" if family.attention == "mla" else "parameters), 'linear'"
    raise CheckpointError(
        f"rope scaling type {kind!r} is not supported for {family.name}; supported: "
        f"{supported}, or none"
    )


def _llama3_params(config: dict, scaling: dict) -> dict:
    wanted = {
        "factor": scaling.get("factor"),
        "low_freq_factor": scaling.get("low_freq_factor"),
        "high_freq_factor": scaling.get("high_freq_factor"),
        # transformers' precedence: a top-level field, then the rope dict, then the maximum
        "original_max_position_embeddings": config.get(
            "original_max_position_embeddings",
            scaling.get("original_max_position_embeddings", config.get("max_position_embeddings")),
        ),
    }
    absent = [k for k, v in wanted.items() if v is None]
    if absent:
        raise CheckpointError(f"llama3 rope scaling lacks {', '.join(absent)}")
    present = {k: v for k, v in wanted.items() if v is not None}
    fixed = megatron_llama3_constants()
    differ = [
        f"{k}={present[k]} (megatron uses {fixed[k]:g})"
        for k in fixed
        if not math.isclose(float(present[k]), fixed[k])
    ]
    if differ:
        raise CheckpointError(
            "llama3 rope scaling parameters that megatron-core cannot reproduce: "
            + ", ".join(differ)
            + "; megatron's GPTModel only takes the factor and fixes the rest"
        )
    params = {k: float(v) for k, v in present.items()}
    params["original_max_position_embeddings"] = int(present["original_max_position_embeddings"])
    return params


def spec_from_hf_config(config: dict) -> ModelSpec:
    """The ModelSpec of a config.json (a dict) of a family in `shared.families.FAMILIES`:
    Llama / Qwen2 / Qwen3, Qwen3-MoE / Qwen2-MoE / Mixtral, DeepSeek-V3 (and Kimi-K2's
    `kimi_k2`, the same config) and GLM-4.5 (`glm4_moe`).

    Raises `CheckpointError` for anything megatron-core cannot reproduce exactly:
    other mixture-of-experts models, other architectures, sliding-window attention, output or MLP
    biases, activations other than SiLU, and unsupported RoPE variants.
    """
    reason = moe_reason(config)
    family = family_of(config.get("model_type"), config.get("architectures"))
    if reason and (family is None or not family.is_moe):
        raise CheckpointError(
            f"this mixture-of-experts model is not supported: {reason}; supported families: "
            f"{'/'.join(SUPPORTED_FAMILIES)}"
        )
    family = family or _family(config)
    moe = hf_moe.moe_fields(family, config) if family.is_moe else {}
    required: tuple[str, ...] = ("vocab_size", "hidden_size", "num_hidden_layers")
    required += ("num_attention_heads",) if moe else ("num_attention_heads", "intermediate_size")
    absent = [k for k in required if config.get(k) is None]
    if absent:
        raise CheckpointError(f"{family.name} config lacks required fields: {', '.join(absent)}")
    problems = _feature_problems(config, family)
    if problems:
        raise CheckpointError(f"unsupported {family.name} config: " + "; ".join(problems))
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    mla = hf_mla.mla_fields(config) if family.attention == "mla" else {}
    head_dim = config.get("head_dim") or family.head_dim
    if mla:
        head_dim = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    elif head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"hidden_size={hidden} is not divisible by heads={heads}")
        head_dim = hidden // heads
    # latent attention has no KV heads of its own: every head gets its keys from the latent
    kv_heads = heads if mla else int(config.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"num_attention_heads={heads} is not a multiple of kv heads={kv_heads}"
        )
    theta, scaling, partial = _rope(config, family)
    qkv_bias, qk_norm = family.qkv_bias, family.qk_norm
    if family.qkv_bias_field:
        qkv_bias = bool(config.get(family.qkv_bias_field, qkv_bias))
    if family.qk_norm_field:
        qk_norm = bool(config.get(family.qk_norm_field, qk_norm))
    return ModelSpec(
        family=family.name,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=int(config.get("intermediate_size") or moe["moe_ffn_hidden_size"]),
        head_dim=int(head_dim),
        rope_theta=theta,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(
            config.get("max_position_embeddings") or family.max_position_embeddings
        ),
        rope_scaling=scaling,
        rotary_percent=partial,
        **moe,
        **mla,
    )


def _feature_problems(config: dict, family: Family) -> list[str]:
    problems = []
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act != "silu":
        problems.append(f"hidden_act={act!r} (only 'silu' / SwiGLU)")
    if config.get("attention_bias") and family.qkv_bias_field != "attention_bias":
        problems.append("attention_bias=true (megatron cannot bias o_proj without the MLP)")
    if config.get("mlp_bias"):
        problems.append("mlp_bias=true")
    problems += quantization_problems(config)
    layers = int(config.get("num_hidden_layers") or 0)
    if config.get("use_sliding_window") and config.get("sliding_window"):
        first = int(config.get("max_window_layers", 0) or 0)
        if first < layers:
            problems.append(f"sliding-window attention on layers {first}..{layers - 1}")
    elif config.get("model_type") in ("llama", "mixtral") and config.get("sliding_window"):
        problems.append(f"sliding_window={config['sliding_window']}")
    odd = sorted({t for t in config.get("layer_types") or [] if t != "full_attention"})
    if odd:
        problems.append(f"layer_types {odd} (only full attention)")
    return problems


def validate_hf_config(config: dict, *, tp: int = 1, ep: int = 1) -> ModelSpec:
    """Check a config.json dict is servable at tensor-parallel size `tp` and expert-parallel
    size `ep`; return its spec.

    Raises `CheckpointError` naming the problem (architecture, RoPE, divisibility of heads,
    KV heads, FFN size or padded vocabulary by `tp`, experts by `ep`).
    """
    spec = spec_from_hf_config(config)
    check_parallel(spec, tp, ep=ep)
    return spec
