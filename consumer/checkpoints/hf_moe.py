"""Mixture-of-experts Hugging Face checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral): config fields,
tensor names and each rank's expert shards.

Two storage layouts are read, whichever the checkpoint holds:

- per expert, as on the Hub and as transformers 5 saves them: `mlp.experts.{e}.gate_proj /
  up_proj / down_proj.weight` (Qwen), `block_sparse_moe.experts.{e}.w1 / w3 / w2.weight`
  (Mixtral: w1 gate, w3 up, w2 down), router `mlp.gate.weight` / `block_sparse_moe.gate.weight`;
- fused, as transformers 5 holds them in memory: `mlp.experts.gate_up_proj` [E, 2f, h] ([gate;
  up] per expert) and `mlp.experts.down_proj` [E, h, f], router `mlp.gate.weight`.

A rank reads only its experts, and of those only its slice of the FFN (`consumer.moe`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from consumer.checkpoints.validate import CheckpointError

if TYPE_CHECKING:
    from consumer.checkpoints.hf import HfCheckpoint
    from consumer.model import ModelSpec
    from consumer.parallel import ParallelLayout

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def moe_fields(family: str, config: dict) -> dict:
    """The ModelSpec fields of a MoE config (num_experts ... moe_dense_layers), checked."""
    problems: list[str] = []

    def count(name: str, value: object, least: int = 1) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= least:
            return value
        problems.append(f"{name}={value!r} (must be an integer >= {least})")
        return least

    ffn_field = "intermediate_size" if family == "mixtral" else "moe_intermediate_size"
    experts = count("num_experts", config.get("num_experts") or config.get("num_local_experts"))
    top_k = count("num_experts_per_tok", config.get("num_experts_per_tok"))
    ffn = count(ffn_field, config.get(ffn_field))
    if not problems and top_k > experts:
        problems.append(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    shared = 0
    if family == "qwen2_moe":
        shared = count(
            "shared_expert_intermediate_size", config.get("shared_expert_intermediate_size"), 0
        )
    layers = int(config.get("num_hidden_layers") or 0)
    dense: list[int] = []
    if family != "mixtral":
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
        problems.append(
            f"intermediate_size={config.get('intermediate_size')!r}: layers {dense} are dense "
            "(mlp_only_layers / decoder_sparse_step) and need it"
        )
    if problems:
        raise CheckpointError(f"unsupported {family} config: " + "; ".join(problems))
    return {
        "num_experts": experts,
        "moe_top_k": top_k,
        "moe_ffn_hidden_size": ffn,
        "moe_norm_topk": family == "mixtral" or bool(config.get("norm_topk_prob", False)),
        "moe_shared_ffn_hidden_size": shared,
        "moe_dense_layers": tuple(dense),
    }


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
    if spec.family == "mixtral" and base + "mlp.experts.0.gate_proj.weight" not in found:
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
    s = spec.moe_shared_ffn_hidden_size
    if spec.family == "qwen2_moe":
        p = names.prefix + "shared_expert."
        shapes[p + "gate_proj.weight"] = (s, h)
        shapes[p + "up_proj.weight"] = (s, h)
        shapes[p + "down_proj.weight"] = (h, s)
        shapes[names.prefix + "shared_expert_gate.weight"] = (1, h)
    return shapes


Reader = Callable[["HfCheckpoint"], torch.Tensor]


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

    def fc1(ckpt: HfCheckpoint) -> torch.Tensor:
        if names.fused:
            name = names.prefix + "experts.gate_up_proj"
            experts = slice(first, first + local)
            gate = ckpt.read_slices(name, experts, cols)
            up = ckpt.read_slices(name, experts, slice(f + cols.start, f + cols.stop))
            return torch.stack([gate, up], dim=1)
        parts = []
        for e in range(first, first + local):
            gate = ckpt.read(names.expert(e, names.gate), rows=cols)
            up = ckpt.read(names.expert(e, names.up), rows=cols)
            parts.append(torch.stack([gate, up]))
        return torch.stack(parts)

    def fc2(ckpt: HfCheckpoint) -> torch.Tensor:
        if names.fused:
            name = names.prefix + "experts.down_proj"
            return ckpt.read_slices(name, slice(first, first + local), slice(None), cols)
        down = [
            ckpt.read(names.expert(e, names.down), cols=cols) for e in range(first, first + local)
        ]
        return torch.stack(down)

    readers: dict[str, Reader] = {
        mg + "router.weight": lambda ckpt: ckpt.read(names.router()),
        mg + "experts_fc1": fc1,
        mg + "experts_fc2": fc2,
    }
    if spec.moe_shared_ffn_hidden_size:
        p = names.prefix + "shared_expert."
        rows = _block(spec.moe_shared_ffn_hidden_size, size, rank)

        def shared_fc1(ckpt: HfCheckpoint) -> torch.Tensor:
            gate = ckpt.read(p + "gate_proj.weight", rows=rows)
            return torch.stack([gate, ckpt.read(p + "up_proj.weight", rows=rows)])

        readers[mg + "shared_fc1"] = shared_fc1
        readers[mg + "shared_fc2"] = lambda ckpt: ckpt.read(p + "down_proj.weight", cols=rows)
        gate_name = names.prefix + "shared_expert_gate.weight"
        readers[mg + "shared_gate"] = lambda ckpt: ckpt.read(gate_name)
    return readers
