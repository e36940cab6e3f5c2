"""What the GPU benches share (bench/gpu_e2e.py and bench/gpu_moe.py both import it, and
neither imports the other; bench/cold_start.py takes `versions`): the H200's peak, the outputs
a "full" pass asks for, the mixture-of-experts shapes and their active FLOPs, Hugging Face's
padded batches, the software versions a figure is recorded with, and the PYTHONPATH of the
consumers they start.

No torch at import time: bench/gpu_e2e.py's parent process does not need it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PEAK_FLOPS = 790e12  # bf16 dense FLOP/s measured on an H200
TOP_K, SAMPLES = 64, 8  # a "full" pass: top-64, 8 samples (and the entropy)

# Shapes from the public config.json files (transformers' field names); weights are random.
SHAPES: dict[str, dict] = {
    # Qwen/Qwen3-30B-A3B: 48 layers, 128 experts of 768, top-8 renormalised (~61 GB bf16)
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 6144, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 32768,
    },
    # deepseek-ai/DeepSeek-V3: MLA (q 1536, kv 512, 128 + 64 q/k dims, 128 v dims, 128 heads),
    # 256 routed experts of 2048 in 8 groups (4 kept), 8 active, 1 shared, 3 dense first layers,
    # YaRN x40; 61 layers (~1.3 TB bf16): cut with --layers (default 5: 3 dense + 2 sparse)
    "deepseek-v3": {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
        "max_position_embeddings": 163840,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                            "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    # zai-org/GLM-4.5-Air: 46 layers, 96 heads of 128 (8 KV), partial rotary 0.5, q/k/v
    # biases, 128 experts of 1408, 8 active, 1 shared, 1 dense first layer (~220 GB bf16)
    "glm-4.5-air": {
        "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
        "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
        "first_k_dense_replace": 1, "attention_bias": True, "use_qk_norm": False,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                            "partial_rotary_factor": 0.5},
    },
}  # fmt: skip
DEFAULT_LAYERS = {"qwen3-30b-a3b": None, "deepseek-v3": 5, "glm-4.5-air": 8}
# --tiny: the same structure, a few MB (CPU check of the plumbing)
TINY_SIZES = {
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "num_experts": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "q_lora_rank": 24,
    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "max_position_embeddings": 256,
}  # fmt: skip
_TINY_ROPE = {"factor": 4.0, "original_max_position_embeddings": 64}


def shape(
    name: str, *, tiny: bool = False, layers: int | None = None, dense: int | None = None
) -> dict:
    """The config.json fields of shape `name`, cut to `layers` (default: DEFAULT_LAYERS[name];
    `tiny`: the same structure in a few MB, all its layers); `dense`: how many of the first
    layers are dense (default the shape's own `first_k_dense_replace`)."""
    cfg = {k: v for k, v in SHAPES[name].items() if k != "rope_parameters"}
    rope = dict(SHAPES[name]["rope_parameters"])
    if tiny:
        cfg.update({k: v for k, v in TINY_SIZES.items() if k in cfg or k == "head_dim"})
        if cfg["model_type"] == "deepseek_v3":
            cfg["num_key_value_heads"] = cfg["num_attention_heads"]
            cfg.pop("head_dim")
        if rope["rope_type"] == "yarn":
            rope.update(_TINY_ROPE)
    layers = layers or (None if tiny else DEFAULT_LAYERS[name])
    if layers:
        cfg["num_hidden_layers"] = layers
    if dense is not None:
        cfg["first_k_dense_replace"] = dense
    cfg["rope_parameters"] = rope
    return cfg


def transformers_config(cfg: dict, **overrides):
    """transformers' config object of a config.json's fields (`overrides` replace fields)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in {**cfg, **overrides}.items() if k != "model_type"}
    return AutoConfig.for_model(cfg["model_type"], **fields)


def frontier(
    name: str, *, tiny: bool = False, layers: int | None = None, dense: int | None = None
) -> dict:
    """A DeepSeek-V3 or GLM-4.5-Air shape (`shape`) as its config.json's fields, cut to
    `layers` (default DEFAULT_LAYERS: 5 layers of DeepSeek-V3, 8 of GLM-4.5-Air; `tiny`: a few
    MB of the same build)."""
    cfg = shape(name, tiny=tiny, layers=layers, dense=dense)
    cfg["architectures"] = [
        {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}[
            cfg["model_type"]
        ]
    ]
    cfg["tie_word_embeddings"] = False
    if tiny:  # the workloads' documents reach 4096 tokens
        cfg["max_position_embeddings"] = 8192
    return cfg


# The frontier cuts the end-to-end and cold-start benches serve (`frontier`'s arguments)
FRONTIER = {
    "deepseek-v3": {"name": "deepseek-v3"},
    "glm-4.5-air": {"name": "glm-4.5-air"},
    # 3 dense + 4 sparse layers (~95 GB bf16): the sparse layers' share closer to the model's
    "deepseek-v3-7l": {"name": "deepseek-v3", "layers": 7},
    # 1 dense + 3 sparse layers (~72 GB bf16): more sparse than dense, as the real model's
    # 3 + 58 is, so the expert layer sets the pace
    "deepseek-v3-sparse": {"name": "deepseek-v3", "layers": 4, "dense": 1},
    # 1 dense + 2 sparse layers (~50 GB bf16): still more sparse than dense, and one model
    # with a 16k-token forward fits an H100's 78 GiB (the cut above peaks at 84-90 GiB)
    "deepseek-v3-2s": {"name": "deepseek-v3", "layers": 3, "dense": 1},
    "glm-4.5-air-10l": {"name": "glm-4.5-air", "layers": 10},  # 1 dense + 9 sparse
    # 1 dense + 1 sparse layer (~27 GB bf16): every kind of DeepSeek-V3 layer at its real
    # width in the fewest bytes (cold starts: what a start compiles, not what it reads)
    "deepseek-v3-1s": {"name": "deepseek-v3", "layers": 2, "dense": 1},
    "tiny-deepseek": {"name": "deepseek-v3", "tiny": True},
}


def active_flops(spec, lengths: list[int]) -> float:
    """FLOPs of one forward with the output layer, counting only the experts a token uses
    (routed and shared) and, per document, causal attention's two s^2 products."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    if spec.is_mla:
        q = (h * spec.q_lora_rank + spec.q_lora_rank * heads * spec.kv_channels
             if spec.q_lora_rank else h * heads * spec.kv_channels)  # fmt: skip
        kv = h * (spec.kv_lora_rank + spec.qk_rope_head_dim)
        kv += spec.kv_lora_rank * heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        attn = q + kv + heads * spec.v_head_dim * h
        quad_per_s2 = heads * (spec.kv_channels + spec.v_head_dim)
    else:
        d, kvh = spec.kv_channels, spec.num_kv_heads
        attn = h * heads * d * 2 + h * kvh * d * 2
        quad_per_s2 = 2 * heads * d
    sparse = (h * spec.num_experts + spec.moe_top_k * 3 * h * spec.moe_ffn_hidden_size
              + 3 * h * spec.moe_shared_ffn_hidden_size)  # fmt: skip
    dense = 3 * h * spec.ffn_hidden_size
    mlp = sum(sparse if spec.is_sparse_layer(i) else dense for i in range(spec.num_layers))
    per_token = spec.num_layers * attn + mlp + spec.vocab_size * h
    quad = sum(s * s for s in lengths) * quad_per_s2 * spec.num_layers
    return 2.0 * per_token * sum(lengths) + quad


def padded_batches(docs: list, budget: int) -> list[list]:
    """HF's batches: documents sorted by length, as many per batch as fit `budget` tokens
    with every row padded to the batch's longest (a longer document alone)."""
    order = sorted(docs, key=len)
    batches: list[list] = []
    for d in order:
        if batches and (len(batches[-1]) + 1) * len(d) <= budget:
            batches[-1].append(d)
        else:
            batches.append([d])
    return batches


def padded_tensors(batch: list, device):
    """HF's input for one padded batch: (ids, attention mask) [B, longest], right-padded."""
    import torch

    width = max(len(d) for d in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, d in enumerate(batch):
        ids[i, : len(d)] = torch.as_tensor(d)
        mask[i, : len(d)] = 1
    return ids.to(device), mask.to(device)


def versions() -> dict:
    """The software and the device a figure was measured with (torch imported here)."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton", "megatron.core", "quack", "cutlass"):
        try:
            mod = __import__(name, fromlist=["__version__"])
            out[name] = getattr(mod, "__version__", "?")
        except ImportError:
            out[name] = None
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
    return out


def child_env(settings) -> dict[str, str]:
    """The environment of a process a bench starts for `settings` (a consumer, a bake): this
    one's, the settings as TEACHERQ_* variables, and `child_pythonpath`."""
    from shared.settings import to_env

    return {**os.environ, **to_env(settings), "PYTHONPATH": child_pythonpath()}


def child_pythonpath() -> str:
    """PYTHONPATH for a process a bench starts (a consumer): this checkout first, then the
    caller's own path, which may hold the dependencies (a `pip install --target` folder on a
    GPU host without network)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
