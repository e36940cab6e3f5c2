"""Teacher checkpoints: Hugging Face safetensors and Megatron torch_dist, loaded per TP rank.

Entry points: `load_hf_checkpoint` / `load_megatron_checkpoint` build this rank's shard of a
`TeacherGPTModel` from a checkpoint (validated first); `save_megatron_checkpoint` writes one
that reloads at any tensor-parallel size. Every refusal is a `CheckpointError`.

Names are imported on first use, so `consumer.checkpoints.synthetic` (transformers only) does
not pull in megatron-core.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "HfCheckpoint": "hf_files",
    "hf_tensor_shapes": "hf",
    "load_hf_checkpoint": "hf",
    "load_hf_weights": "hf",
    "spec_from_hf_config": "hf_config",
    "validate_hf_checkpoint": "hf",
    "validate_hf_config": "hf_config",
    "load_megatron_checkpoint": "megatron_dist",
    "load_megatron_weights": "megatron_dist",
    "read_megatron_spec": "megatron_dist",
    "resolve_megatron_checkpoint": "megatron_dist",
    "save_megatron_checkpoint": "megatron_dist",
    "spec_from_megatron_args": "megatron_dist",
    "load_teacher": "teacher",
    "checkpoint_kind": "teacher",
    "check_teacher": "teacher",
    "model_version": "teacher",
    "CheckpointError": "validate",
    "check_parallel": "validate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
