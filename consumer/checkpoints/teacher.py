"""`load_teacher`: whatever TEACHERQ_MODEL__PATH names, loaded, with a model version."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from consumer.checkpoints.validate import CheckpointError
from consumer.forward.model import ModelSpec, TeacherGPTModel
from consumer.parallel import ParallelLayout


def checkpoint_kind(path: str | Path) -> str:
    """'hf' for a Hugging Face directory (config.json), 'megatron' for a torch_dist one."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"model path {str(p)!r} does not exist")
    if (p / "config.json").is_file():
        return "hf"
    megatron_marks = ("latest_checkpointed_iteration.txt", ".metadata", "teacherq_spec.json")
    if any((p / m).exists() for m in megatron_marks) or p.name.startswith(("iter_", "release")):
        return "megatron"
    if any(c.name.startswith("iter_") or c.name == "release" for c in p.iterdir()):
        return "megatron"
    raise CheckpointError(
        f"{p}: not a checkpoint: looked for config.json (Hugging Face) and "
        "latest_checkpointed_iteration.txt, iter_NNNNNNN/ or release/ (Megatron torch_dist)"
    )


def model_version(path: str | Path) -> str:
    """`<name>@<fingerprint>`: the fingerprint hashes file names, sizes and mtimes (cheap, and
    it changes whenever a checkpoint directory is rewritten)."""
    p = Path(path).resolve()
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(p)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return f"{p.name}@{h.hexdigest()[:12]}"


def load_teacher(
    path: str | Path,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype,
    device: torch.device | str,
    fp8: str = "auto",
) -> tuple[TeacherGPTModel, ModelSpec, str]:
    """Load a Hugging Face or Megatron checkpoint on this rank; returns model, spec, version
    (`fp8`: the `model.fp8` setting, for an FP8 block-quantized Hugging Face checkpoint)."""
    kind = checkpoint_kind(path)
    if kind == "hf":
        from consumer.checkpoints.hf import load_hf_checkpoint

        model, spec = load_hf_checkpoint(
            path, layout, params_dtype=params_dtype, device=device, fp8=fp8
        )
        version_dir = Path(path)
    else:
        from consumer.checkpoints.megatron_dist import (
            load_megatron_checkpoint,
            resolve_megatron_checkpoint,
        )

        version_dir = resolve_megatron_checkpoint(path)
        model, spec = load_megatron_checkpoint(
            version_dir, layout, params_dtype=params_dtype, device=device
        )
    return model, spec, model_version(version_dir)


def check_teacher(path: str | Path, *, tp: int, ep: int = 1) -> ModelSpec:
    """Everything `load_teacher` would refuse, found without loading a tensor: the format, the
    config (family, features, split over `tp` x `ep`) and, for Hugging Face, every tensor's shape
    from the file headers. Raises `CheckpointError` naming the problems; returns the spec."""
    from consumer.checkpoints.validate import check_parallel

    if checkpoint_kind(path) == "hf":
        from consumer.checkpoints.hf import validate_hf_checkpoint

        return validate_hf_checkpoint(path, tp=tp, ep=ep)
    from consumer.checkpoints.megatron_dist import read_megatron_spec, resolve_megatron_checkpoint

    spec = read_megatron_spec(resolve_megatron_checkpoint(path))
    check_parallel(spec, tp, ep=ep)
    return spec
