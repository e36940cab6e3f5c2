"""Mixture-of-experts Hugging Face checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3,
GLM-4.5): config fields, tensor names and each rank's expert shards.

Two storage layouts are read, whichever the checkpoint holds:

- per expert, as on the Hub and as transformers 5 saves them: `mlp.experts.{e}.gate_proj /
  up_proj / down_proj.weight` (Qwen), `block_sparse_moe.experts.{e}.w1 / w3 / w2.weight`
  (Mixtral: w1 gate, w3 up, w2 down), router `mlp.gate.weight` / `block_sparse_moe.gate.weight`;
- fused, as transformers 5 holds them in memory: `mlp.experts.gate_up_proj` [E, 2f, h] ([gate;
  up] per expert) and `mlp.experts.down_proj` [E, h, f], router `mlp.gate.weight`.

DeepSeekMoE (DeepSeek-V3, GLM-4.5) adds the router's `mlp.gate.e_score_correction_bias` [E]
and ungated shared experts `mlp.shared_experts.gate_proj / up_proj / down_proj.weight`
(`n_shared_experts` x `moe_intermediate_size` wide); Qwen2-MoE's gated shared expert is
`mlp.shared_expert.*` with `mlp.shared_expert_gate.weight` [1, h].

A rank reads only its experts, and of those only its slice of the FFN (`consumer.forward.moe`).
For an FP8 checkpoint whose experts run in FP8, the same readers give `hf_fp8_experts` the
stored FP8 slices and their scale blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from consumer.checkpoints import hf_files
from consumer.checkpoints.hf_files import HfCheckpoint, Reader, Shard
from consumer.checkpoints.validate import CheckpointError
from consumer.forward.spec import ModelSpec
from consumer.parallel import ParallelLayout
from shared.families import Family


def moe_fields(family: Family, config: dict) -> dict:
    """The ModelSpec fields of a MoE config (num_experts ... moe_routed_scale), checked."""
    problems: list[str] = []

    def count(name: str, value: object, least: int = 1) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= least:
            return value
        problems.append(f"{name}={value!r} (must be an integer >= {least})")
        return least

    ffn_field = family.expert_ffn_field
    named = [config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
             if config.get(k) is not None]  # fmt: skip
    experts = count("num_experts", named[0] if named else None)
    top_k = count("num_experts_per_tok", config.get("num_experts_per_tok"))
    ffn = count(ffn_field, config.get(ffn_field))
    if not problems and top_k > experts:
        problems.append(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    shared = 0
    if family.shared_expert == "gated":
        shared = count(
            "shared_expert_intermediate_size", config.get("shared_expert_intermediate_size"), 0
        )
    elif family.shared_expert == "plain":
        shared = count("n_shared_experts", config.get("n_shared_experts", 0), 0) * ffn
    grouped = _grouped_routing(family, config, experts, top_k, problems)
    layers = int(config.get("num_hidden_layers") or 0)
    dense: list[int] = []
    if family.dense_layers == "first_k":
        first = config.get("first_k_dense_replace", 0)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            problems.append(f"first_k_dense_replace={first!r} (must be an integer >= 0)")
            first = 0
        dense = list(range(min(first, layers)))
    elif family.dense_layers == "qwen":
        step = config.get("decoder_sparse_step", 1)
        only = config.get("mlp_only_layers") or []
        if not isinstance(step, int) or step < 1:
            problems.append(f"decoder_sparse_step={step!r} (must be a positive integer)")
            step = 1
        if not isinstance(only, list) or any(not isinstance(i, int) for i in only):
            problems.append(f"mlp_only_layers={only!r} (must be a list of layer indices)")
            only = []
        dense = [i for i in range(layers) if i in only or (i + 1) % step]
    if dense and not config.get("intermediate_size"):
        names = "first_k_dense_replace" if family.dense_layers == "first_k" else (
            "mlp_only_layers / decoder_sparse_step")  # fmt: skip
        problems.append(
            f"intermediate_size={config.get('intermediate_size')!r}: layers {dense} are dense "
            f"({names}) and need it"
        )
    if problems:
        raise CheckpointError(f"unsupported {family.name} config: " + "; ".join(problems))
    return {
        "num_experts": experts,
        "moe_top_k": top_k,
        "moe_ffn_hidden_size": ffn,
        "moe_norm_topk": family.always_renormalise or bool(config.get("norm_topk_prob", False)),
        "moe_shared_ffn_hidden_size": shared,
        "moe_dense_layers": tuple(dense),
        **grouped,
    }


def _grouped_routing(
    family: Family, config: dict, experts: int, top_k: int, problems: list[str]
) -> dict:
    """DeepSeekMoE's group-limited routing fields (n_group, topk_group, routed_scaling_factor),
    checked against the experts: groups divide them, each kept group offers its two best."""
    if family.routing != "sigmoid_grouped":
        return {}
    # DeepSeek's own config files name the scoring and the top-k method; V2's are refused
    for name, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if config.get(name) not in (None, want):
            problems.append(f"{name}={config[name]!r} (only {want!r}, DeepSeek-V3's routing)")
    groups = config.get("n_group") or 1
    kept = config.get("topk_group") or 1
    scale = config.get("routed_scaling_factor", 1.0)
    for name, value in (("n_group", groups), ("topk_group", kept)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{name}={value!r} (must be an integer >= 1)")
            return {}
    if experts % groups:
        problems.append(f"n_routed_experts={experts} is not divisible by n_group={groups}")
    elif kept > groups:
        problems.append(f"topk_group={kept} exceeds n_group={groups}")
    elif kept < groups and experts // groups < 2:
        problems.append(
            f"n_group={groups} leaves {experts // groups} expert per group; group scores sum "
            "each group's two best"
        )
    elif top_k > kept * (experts // groups):
        problems.append(
            f"num_experts_per_tok={top_k} exceeds the {kept * (experts // groups)} experts of "
            f"topk_group={kept} groups"
        )
    if not isinstance(scale, int | float) or isinstance(scale, bool) or scale <= 0:
        problems.append(f"routed_scaling_factor={scale!r} (must be a positive number)")
        scale = 1.0
    return {"moe_groups": groups, "moe_topk_groups": kept, "moe_routed_scale": float(scale)}


@dataclass(frozen=True)
class ExpertNames:
    """Where one sparse layer's tensors lie in a checkpoint."""

    prefix: str  # e.g. "model.layers.3.mlp."
    fused: bool
    gate: str = "gate_proj"  # per-expert names (Mixtral: w1, w3, w2)
    up: str = "up_proj"
    down: str = "down_proj"

    def router(self) -> str:
        return self.prefix + "gate.weight"

    def expert(self, e: int, which: str) -> str:
        return f"{self.prefix}experts.{e}.{which}.weight"


def expert_names(spec: ModelSpec, layer: int, found: set[str] | dict) -> ExpertNames:
    """The naming a checkpoint uses for sparse layer `layer` (fused or per expert)."""
    base = f"model.layers.{layer}."
    if base + "mlp.experts.gate_up_proj" in found:
        return ExpertNames(base + "mlp.", fused=True)
    family = spec.family_record
    mixtral = family is not None and family.expert_naming == "mixtral"
    if mixtral and base + "mlp.experts.0.gate_proj.weight" not in found:
        return ExpertNames(base + "block_sparse_moe.", fused=False, gate="w1", up="w3", down="w2")
    return ExpertNames(base + "mlp.", fused=False)


def sparse_layer_shapes(spec: ModelSpec, names: ExpertNames) -> dict[str, tuple[int, ...]]:
    """Every tensor of one sparse layer's FFN with its shape."""
    h, f, e = spec.hidden_size, spec.moe_ffn_hidden_size, spec.num_experts
    shapes: dict[str, tuple[int, ...]] = {names.router(): (e, h)}
    if names.fused:
        shapes[names.prefix + "experts.gate_up_proj"] = (e, 2 * f, h)
        shapes[names.prefix + "experts.down_proj"] = (e, h, f)
    else:
        for i in range(e):
            shapes[names.expert(i, names.gate)] = (f, h)
            shapes[names.expert(i, names.up)] = (f, h)
            shapes[names.expert(i, names.down)] = (h, f)
    family = spec.family_record
    if family is not None and family.routing == "sigmoid_grouped":
        shapes[names.prefix + "gate.e_score_correction_bias"] = (e,)
    s = spec.moe_shared_ffn_hidden_size
    shared = family.shared_expert if family is not None else "none"
    if shared == "gated" or (shared == "plain" and s):
        p = names.prefix + _SHARED_PREFIX[shared]
        shapes[p + "gate_proj.weight"] = (s, h)
        shapes[p + "up_proj.weight"] = (s, h)
        shapes[p + "down_proj.weight"] = (h, s)
    if shared == "gated":
        shapes[names.prefix + "shared_expert_gate.weight"] = (1, h)
    return shapes


# where each kind of shared expert lies under a sparse layer's `mlp.`
_SHARED_PREFIX = {"gated": "shared_expert.", "plain": "shared_experts."}


def _block(n: int, parts: int, index: int) -> slice:
    size = n // parts
    return slice(index * size, (index + 1) * size)


def sparse_layer_readers(
    spec: ModelSpec, names: ExpertNames, layout: ParallelLayout, mg: str
) -> dict[str, Reader]:
    """For each parameter of the TeacherMoE at megatron prefix `mg` (`decoder.layers.i.mlp.`),
    how to read this rank's shard of it."""
    size, rank, ep = layout.replica_size, layout.replica_rank, layout.ep
    etp = size // ep
    local = spec.num_experts // ep
    first = (rank // etp) * local
    f = spec.moe_ffn_hidden_size
    cols = _block(f, etp, rank % etp)

    def fc1(ckpt: HfCheckpoint) -> Shard:
        if names.fused:
            name = names.prefix + "experts.gate_up_proj"
            experts = slice(first, first + local)
            gate = ckpt.read_slices(name, experts, cols)
            up = ckpt.read_slices(name, experts, slice(f + cols.start, f + cols.stop))
            return hf_files.stack([gate, up], dim=1)
        parts = []
        for e in range(first, first + local):
            gate = ckpt.read(names.expert(e, names.gate), rows=cols)
            up = ckpt.read(names.expert(e, names.up), rows=cols)
            parts.append(hf_files.stack([gate, up]))
        return hf_files.stack(parts)

    def fc2(ckpt: HfCheckpoint) -> Shard:
        if names.fused:
            name = names.prefix + "experts.down_proj"
            return ckpt.read_slices(name, slice(first, first + local), slice(None), cols)
        down = [
            ckpt.read(names.expert(e, names.down), cols=cols) for e in range(first, first + local)
        ]
        return hf_files.stack(down)

    readers: dict[str, Reader] = {
        mg + "router.weight": lambda ckpt: ckpt.read(names.router()),
        mg + "experts_fc1": fc1,
        mg + "experts_fc2": fc2,
    }
    family = spec.family_record
    if family is not None and family.routing == "sigmoid_grouped":
        bias = names.prefix + "gate.e_score_correction_bias"
        readers[mg + "router_bias"] = lambda ckpt: ckpt.read(bias)
    shared = family.shared_expert if family is not None else "none"
    if spec.moe_shared_ffn_hidden_size and shared in _SHARED_PREFIX:
        p = names.prefix + _SHARED_PREFIX[shared]
        rows = _block(spec.moe_shared_ffn_hidden_size, size, rank)

        def shared_fc1(ckpt: HfCheckpoint) -> Shard:
            gate = ckpt.read(p + "gate_proj.weight", rows=rows)
            return hf_files.stack([gate, ckpt.read(p + "up_proj.weight", rows=rows)])

        readers[mg + "shared_fc1"] = shared_fc1
        readers[mg + "shared_fc2"] = lambda ckpt: ckpt.read(p + "down_proj.weight", cols=rows)
    if spec.moe_shared_ffn_hidden_size and shared == "gated":
        gate_name = names.prefix + "shared_expert_gate.weight"
        readers[mg + "shared_gate"] = lambda ckpt: ckpt.read(gate_name)
    return readers
