"""Multi-head latent attention in Hugging Face checkpoints (DeepSeek-V3 and configs shaped like
it): config fields, YaRN parameters, tensor names and each rank's shard of them.

Per layer, under `model.layers.{i}.self_attn.`: `q_a_proj` [q_lora, h], `q_a_layernorm`
[q_lora], `q_b_proj` [H (nope + rope), q_lora] (or `q_proj` [H (nope + rope), h] without a q
LoRA rank), `kv_a_proj_with_mqa` [kv_lora + rope, h], `kv_a_layernorm` [kv_lora], `kv_b_proj`
[H (nope + v), kv_lora], `o_proj` [h, H v]. Rows of q_b_proj / kv_b_proj are head-major, so a
TP rank's heads are one contiguous block of rows (`consumer/forward/mla.py` holds them in that
order).
"""

from __future__ import annotations

from consumer.checkpoints.hf_files import Reader
from consumer.checkpoints.validate import CheckpointError
from consumer.forward.spec import ModelSpec
from consumer.parallel import ParallelLayout

# YaRN parameters carried over (with transformers' defaults where it has them; `factor` and
# `original_max_position_embeddings` are required)
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def mla_fields(config: dict) -> dict:
    """The ModelSpec fields of a latent-attention config (q_lora_rank ... rope_interleave),
    checked: every rank a positive integer (q_lora_rank may be null: no q LoRA)."""
    problems: list[str] = []

    def count(name: str, least: int = 1) -> int:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= least:
            return value
        problems.append(f"{name}={value!r} (must be an integer >= {least})")
        return least

    q_lora = 0 if config.get("q_lora_rank") is None else count("q_lora_rank")
    fields = {
        "q_lora_rank": q_lora,
        "kv_lora_rank": count("kv_lora_rank"),
        "qk_nope_head_dim": count("qk_nope_head_dim"),
        "qk_rope_head_dim": count("qk_rope_head_dim", 2),
        "v_head_dim": count("v_head_dim"),
        "rope_interleave": bool(config.get("rope_interleave", True)),
    }
    if not problems and fields["qk_rope_head_dim"] % 2:
        problems.append(f"qk_rope_head_dim={fields['qk_rope_head_dim']} (must be even)")
    if (
        not problems
        and fields["v_head_dim"] > fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
    ):
        problems.append(
            f"v_head_dim={fields['v_head_dim']} exceeds the q/k head size "
            f"qk_nope_head_dim + qk_rope_head_dim (values are padded to it)"
        )
    if config.get("attention_bias"):
        problems.append("attention_bias=true (latent attention without biases only)")
    if problems:
        raise CheckpointError("unsupported latent-attention config: " + "; ".join(problems))
    return fields


def yarn_params(config: dict, scaling: dict) -> dict:
    """The normalised YaRN rope_scaling of a latent-attention config: rope_type, factor,
    original_max_position_embeddings and whichever of beta_fast, beta_slow, mscale,
    mscale_all_dim, attention_factor, truncate it sets."""
    factor = scaling.get("factor")
    original = scaling.get(
        "original_max_position_embeddings", config.get("original_max_position_embeddings")
    )
    if factor is None or original is None:
        absent = [n for n, v in (("factor", factor), ("original_max_position_embeddings",
                                                       original)) if v is None]  # fmt: skip
        raise CheckpointError(f"yarn rope scaling lacks {', '.join(absent)}")
    out: dict = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
    }
    for key in _YARN_KEYS:
        if scaling.get(key) is not None:
            value = scaling[key]
            out[key] = bool(value) if key == "truncate" else float(value)
    return out


def attention_shapes(spec: ModelSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """Every latent-attention tensor of one layer (`prefix` = `model.layers.{i}.self_attn.`)."""
    h, heads, qk = spec.hidden_size, spec.num_attention_heads, spec.kv_channels
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.q_lora_rank:
        shapes[prefix + "q_a_proj.weight"] = (spec.q_lora_rank, h)
        shapes[prefix + "q_a_layernorm.weight"] = (spec.q_lora_rank,)
        shapes[prefix + "q_b_proj.weight"] = (heads * qk, spec.q_lora_rank)
    else:
        shapes[prefix + "q_proj.weight"] = (heads * qk, h)
    shapes[prefix + "kv_a_proj_with_mqa.weight"] = (spec.kv_lora_rank + spec.qk_rope_head_dim, h)
    shapes[prefix + "kv_a_layernorm.weight"] = (spec.kv_lora_rank,)
    shapes[prefix + "kv_b_proj.weight"] = (
        heads * (spec.qk_nope_head_dim + spec.v_head_dim),
        spec.kv_lora_rank,
    )
    shapes[prefix + "o_proj.weight"] = (h, heads * spec.v_head_dim)
    return shapes


def attention_readers(
    spec: ModelSpec, layout: ParallelLayout, hf: str, mg: str
) -> dict[str, Reader]:
    """For each parameter of the TeacherMLA at megatron prefix `mg`
    (`decoder.layers.i.self_attention.`), how to read this rank's shard from Hugging Face
    prefix `hf` (`model.layers.i.self_attn.`): its block of heads."""
    local = spec.num_attention_heads // layout.tp
    first = layout.tp_rank * local

    def head_rows(name: str, per_head: int) -> Reader:
        rows = slice(first * per_head, (first + local) * per_head)
        return lambda ckpt: ckpt.read(hf + name, rows=rows)

    def whole(name: str) -> Reader:
        return lambda ckpt: ckpt.read(hf + name)

    qk, v = spec.kv_channels, spec.v_head_dim
    readers: dict[str, Reader] = {}
    if spec.q_lora_rank:
        readers[mg + "linear_q_down_proj.weight"] = whole("q_a_proj.weight")
        readers[mg + "q_layernorm.weight"] = whole("q_a_layernorm.weight")
        readers[mg + "linear_q_up_proj.weight"] = head_rows("q_b_proj.weight", qk)
    else:
        readers[mg + "linear_q_proj.weight"] = head_rows("q_proj.weight", qk)
    readers[mg + "linear_kv_down_proj.weight"] = whole("kv_a_proj_with_mqa.weight")
    readers[mg + "kv_layernorm.weight"] = whole("kv_a_layernorm.weight")
    kv_up = head_rows("kv_b_proj.weight", spec.qk_nope_head_dim + v)
    readers[mg + "linear_kv_up_proj.weight"] = kv_up
    cols = slice(first * v, (first + local) * v)
    readers[mg + "linear_proj.weight"] = lambda ckpt: ckpt.read(hf + "o_proj.weight", cols=cols)
    return readers
