"""Megatron torch_dist checkpoints: save, find and load at any tensor-parallel size.

The on-disk layout is the one Megatron-LM trainers write::

    ROOT/latest_checkpointed_iteration.txt   "123" or "release"
    ROOT/iter_0000123/                       a dist_checkpointing torch_dist directory
        metadata.json  .metadata  __*_*.distcp  common.pt
        teacherq_spec.json                   written by teacherq: the ModelSpec

Tensors are saved from the model's `sharded_state_dict`, so dist_checkpointing reshards them
on load: each rank reads only the pieces its shard overlaps. The vocabulary is padded per TP
size; megatron marks embedding and output weights `allow_shape_mismatch`, so a checkpoint saved
at one TP size loads at another (rows beyond the stored ones stay zero, as padding should).

The ModelSpec comes from `teacherq_spec.json` when present, else from the `args` a Megatron-LM
trainer stores in common.pt (the unpadded vocabulary size may have to be given then).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from consumer.checkpoints.hf_config import megatron_llama3_constants
from consumer.checkpoints.validate import CheckpointError, check_parallel, raise_problems
from consumer.forward.model import ModelSpec, TeacherGPTModel, build_model
from consumer.parallel import ParallelLayout

TRACKER_NAME = "latest_checkpointed_iteration.txt"
SPEC_NAME = "teacherq_spec.json"
RELEASE = "release"
_SPEC_FORMAT = "teacherq.model_spec"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# Megatron-LM's checkpoint_version for dist checkpoints; readers of common.pt look for it.
_CHECKPOINT_VERSION = 3.0
# Module prefixes whose classes may be unpickled from a trainer's common.pt `args`.
_TRUSTED_PICKLE_MODULES = ("argparse.", "megatron.", "torch.", "collections.", "pathlib.")
_MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def step_dir_name(step: int | str) -> str:
    """Directory name of a checkpoint step: `iter_0000123`, or `release`."""
    if step == RELEASE:
        return RELEASE
    try:
        number = int(step)
    except (TypeError, ValueError):
        raise CheckpointError(
            f"checkpoint step must be an integer or 'release', got {step!r}"
        ) from None
    if number < 0:
        raise CheckpointError(f"checkpoint step must be >= 0, got {number}")
    return f"iter_{number:07d}"


# --------------------------------------------------------------------------------------------
# resolving a path to one checkpoint directory


def _is_dist_checkpoint(path: Path) -> bool:
    return (path / "metadata.json").is_file()


def _available_steps(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if p.is_dir() and _ITER_RE.match(p.name)]
    names.sort(key=lambda n: int(n[5:]))
    if (root / RELEASE).is_dir():
        names.append(RELEASE)
    return names


def _require_checkpoint(candidate: Path, looked_for: str) -> Path:
    if _is_dist_checkpoint(candidate):
        _check_backend(candidate)
        return candidate
    if candidate.is_dir() and any(candidate.glob("mp_rank_*")):
        raise CheckpointError(
            f"{candidate} is a legacy (per-rank torch.save) Megatron checkpoint; only torch_dist "
            "checkpoints are supported (convert it with Megatron-LM's checkpoint converter)"
        )
    available = _available_steps(candidate.parent)
    raise CheckpointError(
        f"no Megatron torch_dist checkpoint for {looked_for}: looked for "
        f"{candidate / 'metadata.json'}; steps present in {candidate.parent}: "
        f"{available or 'none'}"
    )


def _check_backend(ckpt_dir: Path) -> None:
    try:
        backend = json.loads((ckpt_dir / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unreadable {ckpt_dir / 'metadata.json'}: {exc}") from exc
    if backend != "torch_dist":
        raise CheckpointError(
            f"{ckpt_dir} uses the {backend!r} dist-checkpoint backend; only 'torch_dist' is "
            "supported"
        )


def resolve_megatron_checkpoint(path: str | Path, *, step: int | str | None = None) -> Path:
    """The checkpoint directory (`iter_NNNNNNN` or `release`) that `path` and `step` name.

    `path` is either a checkpoint root (with `latest_checkpointed_iteration.txt` and step
    directories) or one step directory itself. `step` (an integer or 'release') picks a step
    under a root instead of the tracker's; given with a step directory it must agree with it.
    Raises `CheckpointError` naming what was looked for and where.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"Megatron checkpoint path does not exist: {root}")
    if _is_dist_checkpoint(root):
        if step is not None and root.name != step_dir_name(step):
            raise CheckpointError(
                f"{root} is the checkpoint directory {root.name!r}, but step {step!r} "
                f"({step_dir_name(step)}) was asked for"
            )
        _check_backend(root)
        return root
    if step is not None:
        return _require_checkpoint(root / step_dir_name(step), f"step {step!r}")
    tracker = root / TRACKER_NAME
    if not tracker.is_file():
        raise CheckpointError(
            f"{root} is neither a torch_dist checkpoint directory (no metadata.json) nor a "
            f"checkpoint root (no {TRACKER_NAME}); steps present: "
            f"{_available_steps(root) or 'none'} (pass a step to pick one)"
        )
    text = tracker.read_text().strip()
    if text != RELEASE and not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r}, expected an integer or 'release'")
    step_name = step_dir_name(text if text == RELEASE else int(text))
    return _require_checkpoint(root / step_name, f"{TRACKER_NAME} = {text!r}")


# --------------------------------------------------------------------------------------------
# the ModelSpec of a checkpoint


def _spec_to_json(spec: ModelSpec) -> str:
    return json.dumps({"format": _SPEC_FORMAT, "version": 1, "spec": dataclasses.asdict(spec)})


def _spec_from_json(path: Path) -> ModelSpec:
    data = json.loads(path.read_text())
    if data.get("format") != _SPEC_FORMAT or "spec" not in data:
        raise CheckpointError(f"{path} is not a teacherq model spec")
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(data["spec"]) - fields)
    if unknown:
        raise CheckpointError(f"{path} has unknown spec fields {unknown}")
    fields_ = dict(data["spec"])
    fields_["moe_dense_layers"] = tuple(fields_.get("moe_dense_layers") or ())
    return ModelSpec(**fields_)


def read_common_args(ckpt_dir: str | Path) -> dict | None:
    """The `args` a Megatron-LM trainer stored in common.pt, as a dict (None if absent).

    Unpickles with `weights_only=True`, allowing only classes from argparse, megatron and
    torch (the types trainers put in their args); anything else is refused.
    """
    common = Path(ckpt_dir) / "common.pt"
    if not common.is_file():
        return None
    needed = torch.serialization.get_unsafe_globals_in_checkpoint(str(common))
    untrusted = [n for n in needed if not n.startswith(_TRUSTED_PICKLE_MODULES)]
    if untrusted:
        raise CheckpointError(
            f"{common} pickles classes outside argparse/megatron/torch ({untrusted}); "
            f"write {SPEC_NAME} next to it instead of relying on its args"
        )
    allowed = [_import_global(name) for name in needed]
    with torch.serialization.safe_globals(allowed):
        state = torch.load(str(common), map_location="cpu", weights_only=True)
    args = state.get("args") if isinstance(state, dict) else None
    if args is None:
        return None
    return dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args)


def _import_global(qualified: str):
    module, _, name = qualified.rpartition(".")
    obj = importlib.import_module(module)
    return getattr(obj, name)


def spec_from_megatron_args(args: dict, *, vocab_size: int | None = None) -> ModelSpec:
    """The ModelSpec of a Megatron-LM trainer's `args` (a dict of its command-line options).

    `vocab_size` is the tokenizer's (unpadded) vocabulary; trainers store it only when
    `--vocab-size` was passed, so it must be given otherwise. Raises `CheckpointError` for
    models this consumer cannot build (MoE, non-RoPE, LayerNorm, non-SwiGLU, linear biases).
    """

    def get(name, default=None):
        value = args.get(name, default)
        return default if value is None else value

    problems = []
    if get("num_experts"):
        problems.append(
            f"mixture-of-experts trainer args (num_experts={args['num_experts']}): only MoE "
            "checkpoints teacherq writes (with teacherq_spec.json) load"
        )
    if get("position_embedding_type", "rope") != "rope":
        problems.append(f"position_embedding_type={args['position_embedding_type']!r}")
    if get("normalization", "RMSNorm") != "RMSNorm":
        problems.append(f"normalization={args['normalization']!r}")
    if not get("swiglu", False):
        problems.append("no SwiGLU (swiglu=False)")
    if get("add_bias_linear", False):
        problems.append("add_bias_linear=True")
    if get("apply_layernorm_1p", False):
        problems.append("apply_layernorm_1p=True")
    if float(get("rotary_percent", 1.0)) != 1.0:
        problems.append(f"rotary_percent={args['rotary_percent']}")
    if get("rotary_interleaved", False):
        problems.append("rotary_interleaved=True")
    if get("multi_latent_attention", False):
        problems.append("multi_latent_attention=True")
    if problems:
        raise CheckpointError("unsupported Megatron-LM model: " + "; ".join(problems))
    vocab = vocab_size or get("vocab_size")
    if not vocab:
        raise CheckpointError(
            "the checkpoint's args do not record the unpadded vocabulary size (vocab_size); pass "
            f"vocab_size= or write {SPEC_NAME} next to the checkpoint"
        )
    required = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")
    absent = [k for k in required if not get(k)]
    if absent:
        raise CheckpointError(f"the checkpoint's args lack {', '.join(absent)}")
    heads = int(args["num_attention_heads"])
    kv = int(get("num_query_groups", heads)) if get("group_query_attention", False) else heads
    scaling = None
    if get("use_rope_scaling", False):
        constants = megatron_llama3_constants()
        scaling = {
            "rope_type": "llama3",
            "factor": float(get("rope_scaling_factor", 8.0)),
            **constants,
            "original_max_position_embeddings": int(constants["original_max_position_embeddings"]),
        }
    elif get("rotary_seq_len_interpolation_factor"):
        scaling = {
            "rope_type": "linear",
            "factor": float(args["rotary_seq_len_interpolation_factor"]),
        }
    return ModelSpec(
        family="megatron",
        vocab_size=int(vocab),
        hidden_size=int(args["hidden_size"]),
        num_layers=int(args["num_layers"]),
        num_attention_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=int(args["ffn_hidden_size"]),
        head_dim=int(get("kv_channels", int(args["hidden_size"]) // heads)),
        rope_theta=float(get("rotary_base", 10000)),
        norm_eps=float(get("norm_epsilon", 1e-5)),
        qkv_bias=bool(get("add_qkv_bias", False)),
        qk_norm=bool(get("qk_layernorm", False)),
        tie_embeddings=not get("untie_embeddings_and_output_weights", False),
        max_position_embeddings=int(get("max_position_embeddings", 4096)),
        rope_scaling=scaling,
    )


def read_megatron_spec(ckpt_dir: str | Path, *, vocab_size: int | None = None) -> ModelSpec:
    """The ModelSpec of a checkpoint directory: its teacherq_spec.json, else its trainer args."""
    ckpt_dir = Path(ckpt_dir)
    spec_file = ckpt_dir / SPEC_NAME
    if spec_file.is_file():
        spec = _spec_from_json(spec_file)
        if vocab_size is not None and vocab_size != spec.vocab_size:
            raise CheckpointError(
                f"vocab_size={vocab_size} was given but {spec_file} says {spec.vocab_size}"
            )
        return spec
    args = read_common_args(ckpt_dir)
    if args is None:
        raise CheckpointError(
            f"cannot tell the model architecture of {ckpt_dir}: no {SPEC_NAME} and no trainer "
            "args in common.pt"
        )
    return spec_from_megatron_args(args, vocab_size=vocab_size)


# --------------------------------------------------------------------------------------------
# saving


def _save_strategy():
    """The sharded save strategy: megatron's default with CUDA, a synchronous one without.

    megatron-core 0.16's torch_dist saver (TorchDistSaveShardedStrategy.async_save, run
    synchronously by `save`) calls torch.cuda.synchronize() while preloading tensors and
    broadcasts its failure flag from a CUDA tensor when finalizing. Without CUDA the same
    translated state dict is written with torch.distributed.checkpoint's own synchronous save
    (same planner, same file format), which needs only the gloo group.
    """
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    if torch.cuda.is_available():
        return None  # megatron's default

    class HostTorchDistSaveStrategy(mtorch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = mtorch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            torch.distributed.checkpoint.save(
                mtorch.mcore_to_pyt_state_dict(state, False),
                storage_writer=torch.distributed.checkpoint.FileSystemWriter(
                    checkpoint_dir, thread_count=self.thread_count
                ),
                planner=mtorch.MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica,
                    flatten_state_dict=False,
                ),
            )

    return HostTorchDistSaveStrategy("torch_dist", 1)


def save_megatron_checkpoint(
    model: TeacherGPTModel,
    path: str | Path,
    *,
    spec: ModelSpec | None = None,
    iteration: int | None = None,
) -> Path:
    """Save `model` (all ranks call this) as a torch_dist checkpoint under root `path`.

    Writes `iter_NNNNNNN/` (or `release/` when `iteration` is None), the tracker file and
    `teacherq_spec.json`. `spec` defaults to the one a teacherq loader attached to the model.
    Returns the checkpoint directory.
    """
    from megatron.core import dist_checkpointing

    spec = spec or getattr(model, "teacherq_spec", None)
    if spec is None:
        raise ValueError("save_megatron_checkpoint needs the model's spec (pass spec=)")
    _refuse_fp8(model, "save")
    root = Path(path)
    ckpt_dir = root / step_dir_name(RELEASE if iteration is None else iteration)
    rank = dist.get_rank()
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {
        "model": model.sharded_state_dict(),
        "iteration": 0 if iteration is None else int(iteration),
        "checkpoint_version": _CHECKPOINT_VERSION,
    }
    dist_checkpointing.save(state, str(ckpt_dir), sharded_strategy=_save_strategy())
    if rank == 0:
        (ckpt_dir / SPEC_NAME).write_text(_spec_to_json(spec))
        # the tracker is what readers follow, so it moves only once the step is complete
        tmp = root / (TRACKER_NAME + ".tmp")
        tmp.write_text(RELEASE if iteration is None else str(int(iteration)))
        tmp.replace(root / TRACKER_NAME)
    dist.barrier()
    return ckpt_dir


def _refuse_fp8(model: torch.nn.Module, what: str) -> None:
    """Refuse a torch_dist save or load of a model holding FP8 weights (an FP8 checkpoint's
    linears or MoE experts under `model.fp8=auto`): their entries carry the FP8 values without
    the block scales, so a save would write weights no loader can read right, and a load
    would round higher-precision values into FP8 under stale scales."""
    held = [n for n, p in model.named_parameters() if p.dtype in _FP8_DTYPES]
    if held:
        raise CheckpointError(
            f"cannot {what} a torch_dist checkpoint: the model holds {len(held)} FP8 weights "
            f"with block scales (e.g. {held[0]}); load the teacher with model.fp8=dequantize"
        )


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------------------------
# loading


def _tensor_entries(model: TeacherGPTModel) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    # _extra_state objects hold nothing a teacher needs (TE's fp8 metadata at most), and
    # checkpoints from other layer specs name them differently: load tensors only.
    return {
        k: v
        for k, v in model.sharded_state_dict().items()
        if isinstance(v, ShardedTensor | ShardedTensorFactory)
    }


def _expected_global_shapes(model: TeacherGPTModel) -> dict[str, tuple[tuple[int, ...], bool]]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    entries = _tensor_entries(model)
    apply_factories(entries)
    shapes = {}
    stack = list(entries.values())
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, ShardedTensor):
            shapes[item.key] = (tuple(item.global_shape), item.allow_shape_mismatch)
    return shapes


def megatron_checkpoint_problems(model: TeacherGPTModel, ckpt_dir: str | Path) -> list[str]:
    """Tensors `model` needs that the checkpoint lacks or stores with another shape."""
    from megatron.core import dist_checkpointing

    stored = {
        k: tuple(v.global_shape)
        for k, v in dist_checkpointing.load_tensors_metadata(str(ckpt_dir)).items()
    }
    problems = []
    expected = _expected_global_shapes(model)
    for key, (shape, flexible) in sorted(expected.items()):
        if key not in stored:
            problems.append(f"missing: {key} (expected {list(shape)})")
        elif flexible:
            # padded vocabulary rows may differ; every other dimension must not
            if stored[key][1:] != shape[1:]:
                problems.append(
                    f"{key}: expected [*, {list(shape[1:])}], found {list(stored[key])}"
                )
        elif stored[key] != shape:
            problems.append(f"{key}: expected {list(shape)}, found {list(stored[key])}")
    # A pipeline stage holds only some of the checkpoint: what it lacks is another stage's.
    whole = model.pre_process and model.post_process
    for key in sorted(stored) if whole else ():
        if key.startswith(_MODEL_KEY_PREFIXES) and key not in expected:
            problems.append(f"unexpected: {key} {list(stored[key])}")
    return problems


def load_megatron_weights(model: TeacherGPTModel, ckpt_dir: str | Path) -> None:
    """Load this rank's shard of every parameter of `model` from a torch_dist checkpoint.

    All ranks of the model call this together. Raises `CheckpointError` if the checkpoint
    lacks a tensor or stores one with a shape the model cannot take.
    """
    _refuse_fp8(model, "load into")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class TensorsOnly(TorchCommonLoadStrategy):
        # the common state (trainer args, RNG and optimizer metadata) is not needed to restore
        # weights, and unpickling a trainer's common.pt can fail on classes it refers to
        def load_common(self, checkpoint_dir):
            return {}

    raise_problems(
        f"checkpoint {ckpt_dir} does not match the model",
        megatron_checkpoint_problems(model, ckpt_dir),
    )
    # megatron sees the stages of a pipeline as data-parallel replicas of one model (see
    # consumer/parallel.py), so its check that every shard is read once by a main replica
    # would count a later stage's layers as copies; the stage's own tensors were checked above.
    whole = model.pre_process and model.post_process
    loaded = dist_checkpointing.load(
        {"model": _tensor_entries(model)},
        str(ckpt_dir),
        common_strategy=TensorsOnly(),
        validate_access_integrity=whole,
    )
    result = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"load left {missing} unset and found {result.unexpected_keys}")


def load_megatron_checkpoint(
    path: str | Path,
    layout: ParallelLayout,
    *,
    step: int | str | None = None,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    vocab_size: int | None = None,
) -> tuple[TeacherGPTModel, ModelSpec]:
    """Resolve, build and load a torch_dist checkpoint at this layout's TP size (any size).

    All ranks call this together. Returns the model (eval mode, no grads) and its spec.
    """
    ckpt_dir = resolve_megatron_checkpoint(path, step=step)
    spec = read_megatron_spec(ckpt_dir, vocab_size=vocab_size)
    check_parallel(spec, layout.tp, ep=layout.ep)
    model = build_model(spec, layout, params_dtype=params_dtype, device=device, init_weights=False)
    load_megatron_weights(model, ckpt_dir)
    model.teacherq_spec = spec
    return model, spec
