"""Hugging Face safetensors checkpoints (Llama, Qwen2/2.5, Qwen3 dense; Qwen3-MoE, Qwen2-MoE and
Mixtral, whose expert tensors consumer/checkpoints/hf_moe.py maps) into a megatron GPTModel.

A checkpoint is a directory with `config.json` and one or more `*.safetensors` files (sharded
ones listed in `model.safetensors.index.json`). Loading is per rank: each tensor-parallel rank
opens the files itself and reads, through safetensors slices, only the rows or columns of its
own shard, so no rank ever holds the whole model. Only the small replicated tensors (norms)
are read whole.

Layout conversions, Hugging Face -> megatron-core (local layer spec):

- q/k/v projections fuse into `linear_qkv`, grouped per KV head: for query group g the rows
  are [q heads of g, k_g, v_g]; a TP rank owns a contiguous run of those rows, which is
  kv_heads / tp whole groups (tp must divide the KV heads; see validate.parallel_problems).
- gate/up projections fuse into `linear_fc1` as [gate shard; up shard] on every rank.
- o_proj / down_proj are row-parallel: a rank owns a block of their input columns.
- embedding and lm_head rows are padded to `spec.padded_vocab_size(tp)` with zero rows.
- RoPE: Hugging Face's rotate-half convention is megatron's non-interleaved RoPE, so q/k rows
  keep their order.
"""

from __future__ import annotations

import inspect
import json
import math
import mmap
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from consumer.checkpoints import hf_moe
from consumer.checkpoints.validate import (
    CheckpointError,
    check_parallel,
    inventory_problems,
    raise_problems,
)
from consumer.load_phases import phase
from consumer.model import ModelSpec, TeacherGPTModel, build_model, stage_layers
from consumer.parallel import ParallelLayout
from consumer.weight_copy import ParamWriter

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"

# Per family: the architecture class, whether q/k/v carry biases, whether q/k are RMS-normed
# per head, and the transformers defaults for fields a config.json may leave out.
_FAMILIES: dict[str, dict] = {
    "llama": {
        "architecture": "LlamaForCausalLM",
        "qkv_bias": False,
        "qk_norm": False,
        "head_dim": None,  # None: hidden_size // num_attention_heads
        "max_position_embeddings": 2048,
    },
    "qwen2": {
        "architecture": "Qwen2ForCausalLM",
        "qkv_bias": True,
        "qk_norm": False,
        "head_dim": None,
        "max_position_embeddings": 32768,
    },
    "qwen3": {
        "architecture": "Qwen3ForCausalLM",
        "qkv_bias": False,
        "qk_norm": True,
        "head_dim": 128,  # Qwen3Config's default, not hidden_size // heads
        "max_position_embeddings": 32768,
    },
    "qwen3_moe": {
        "architecture": "Qwen3MoeForCausalLM",
        "qkv_bias": False,
        "qk_norm": True,
        "head_dim": 128,
        "max_position_embeddings": 32768,
    },
    "qwen2_moe": {
        "architecture": "Qwen2MoeForCausalLM",
        "qkv_bias": True,  # Qwen2MoeConfig.qkv_bias's default; a config may say otherwise
        "qk_norm": False,
        "head_dim": None,
        "max_position_embeddings": 8192,
    },
    "mixtral": {
        "architecture": "MixtralForCausalLM",
        "qkv_bias": False,
        "qk_norm": False,
        "head_dim": None,
        "max_position_embeddings": 4096 * 32,
    },
}
SUPPORTED_FAMILIES = tuple(_FAMILIES)

# model_types that are mixture-of-experts (whatever else their config carries).
_MOE_MODEL_TYPES = {
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "deepseek_v2",
    "deepseek_v3",
    "dbrx",
    "olmoe",
    "granitemoe",
    "phimoe",
    "jetmoe",
    "llama4",
    "llama4_text",
    "gpt_oss",
}
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
    if model_type in _MOE_MODEL_TYPES or "moe" in model_type.lower():
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


def _family(config: dict) -> str:
    model_type = config.get("model_type")
    if model_type in _FAMILIES:
        return model_type
    by_arch = {f["architecture"]: name for name, f in _FAMILIES.items()}
    for arch in config.get("architectures") or []:
        if arch in by_arch and model_type is None:
            return by_arch[arch]
    raise CheckpointError(
        f"unsupported architecture: model_type={model_type!r}, "
        f"architectures={config.get('architectures')!r}; supported families: "
        + ", ".join(f"{name} ({f['architecture']})" for name, f in _FAMILIES.items())
    )


def _rope(config: dict) -> tuple[float, dict | None]:
    """(rope_theta, normalised rope_scaling or None), accepting both config generations.

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
    partial = scaling.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    if theta is None or float(theta) <= 0:
        raise CheckpointError(f"rope_theta must be positive, got {theta!r}")
    theta = float(theta)
    if not theta.is_integer():
        # build_model hands megatron an integer rotary_base
        raise CheckpointError(f"rope_theta={theta} is not an integer; megatron needs an int base")
    if kind == "default":
        return theta, None
    if kind == "linear":
        if not scaling.get("factor"):
            raise CheckpointError("linear rope scaling lacks its factor")
        return theta, {"rope_type": "linear", "factor": float(scaling["factor"])}
    if kind == "llama3":
        return theta, {"rope_type": "llama3", **_llama3_params(config, scaling)}
    raise CheckpointError(
        f"rope scaling type {kind!r} is not supported; supported: 'llama3' (with megatron's "
        "fixed parameters), 'linear', or none"
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
    """The ModelSpec of a Llama / Qwen2 / Qwen3 config.json, or of a Qwen3-MoE / Qwen2-MoE /
    Mixtral one (a dict).

    Raises `CheckpointError` for anything megatron-core cannot reproduce exactly:
    other mixture-of-experts models, other architectures, sliding-window attention, output or MLP
    biases, activations other than SiLU, and unsupported RoPE variants.
    """
    reason = moe_reason(config)
    try:
        family = _family(config)
    except CheckpointError:
        if not reason:
            raise
        family = ""
    if reason and family not in hf_moe.MOE_FAMILIES:
        raise CheckpointError(
            f"this mixture-of-experts model is not supported: {reason}; supported families: "
            f"{'/'.join(SUPPORTED_FAMILIES)}"
        )
    defaults = _FAMILIES[family]
    moe = hf_moe.moe_fields(family, config) if family in hf_moe.MOE_FAMILIES else {}
    required: tuple[str, ...] = ("vocab_size", "hidden_size", "num_hidden_layers")
    required += ("num_attention_heads",) if moe else ("num_attention_heads", "intermediate_size")
    absent = [k for k in required if config.get(k) is None]
    if absent:
        raise CheckpointError(f"{family} config lacks required fields: {', '.join(absent)}")
    problems = _feature_problems(config)
    if problems:
        raise CheckpointError(f"unsupported {family} config: " + "; ".join(problems))
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or defaults["head_dim"]
    if head_dim is None:
        if hidden % heads:
            raise CheckpointError(f"hidden_size={hidden} is not divisible by heads={heads}")
        head_dim = hidden // heads
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"num_attention_heads={heads} is not a multiple of kv heads={kv_heads}"
        )
    theta, scaling = _rope(config)
    return ModelSpec(
        family=family,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=int(config.get("intermediate_size") or moe["moe_ffn_hidden_size"]),
        head_dim=int(head_dim),
        rope_theta=theta,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(config.get("qkv_bias", defaults["qkv_bias"]))
        if family == "qwen2_moe"
        else defaults["qkv_bias"],
        qk_norm=defaults["qk_norm"],
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(
            config.get("max_position_embeddings") or defaults["max_position_embeddings"]
        ),
        rope_scaling=scaling,
        **moe,
    )


def _feature_problems(config: dict) -> list[str]:
    problems = []
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act != "silu":
        problems.append(f"hidden_act={act!r} (only 'silu' / SwiGLU)")
    if config.get("attention_bias"):
        problems.append("attention_bias=true (megatron cannot bias o_proj without the MLP)")
    if config.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if config.get("quantization_config"):
        problems.append("quantized weights (quantization_config)")
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


# --------------------------------------------------------------------------------------------
# tensor inventory


def hf_tensor_shapes(spec: ModelSpec, found: Iterable[str] = ()) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `spec` must hold, with its shape (for a MoE
    model, in the expert layout the tensor names `found` use)."""
    names = set(found)
    h, d, f, v = spec.hidden_size, spec.kv_channels, spec.ffn_hidden_size, spec.vocab_size
    q_rows, kv_rows = spec.num_attention_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_rows, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_rows, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_rows, h)
        if spec.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        if spec.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if spec.is_sparse_layer(i):
            shapes.update(hf_moe.sparse_layer_shapes(spec, hf_moe.expert_names(spec, i, names)))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _ignorable(spec: ModelSpec, found: dict[str, tuple[int, ...]]) -> list[str]:
    # Old Llama exports carry the (recomputed) RoPE buffer; tied checkpoints sometimes still
    # store the lm_head copy of the embedding, which transformers ignores as well.
    names = [n for n in found if n.endswith(".rotary_emb.inv_freq")]
    if spec.tie_embeddings and found.get("lm_head.weight") == (spec.vocab_size, spec.hidden_size):
        names.append("lm_head.weight")
    return names


class HfCheckpoint:
    """A Hugging Face safetensors directory: its config, tensor shapes, and sliced reads.

    Nothing but headers is read until `read` asks for (part of) a tensor.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"Hugging Face checkpoint directory not found: {self.path}")
        config_path = self.path / CONFIG_NAME
        if not config_path.is_file():
            raise CheckpointError(f"no {CONFIG_NAME} in {self.path}")
        self.config: dict = json.loads(config_path.read_text())
        self._handles: dict[Path, object] = {}
        self._maps: dict[Path, tuple[mmap.mmap, int, dict]] = {}
        self._file_of = self._locate_tensors()
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def _locate_tensors(self) -> dict[str, Path]:
        index_path = self.path / INDEX_NAME
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text()).get("weight_map") or {}
            files = {name: self.path / file for name, file in weight_map.items()}
            gone = sorted({p.name for p in files.values() if not p.is_file()})
            if gone:
                raise CheckpointError(f"{INDEX_NAME} in {self.path} lists absent files: {gone}")
            return files
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"no *.safetensors files in {self.path}")
        found: dict[str, Path] = {}
        for shard in shards:
            for name in self._open(shard).keys():  # noqa: SIM118 - safe_open is not a dict
                if name in found:
                    raise CheckpointError(
                        f"tensor {name} is stored twice: in {found[name].name} and {shard.name}"
                    )
                found[name] = shard
        return found

    def _open(self, file: Path):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor stored (from the file headers only)."""
        if self._shapes is None:
            shapes = {}
            for name, file in self._file_of.items():
                handle = self._open(file)
                if name not in set(handle.keys()):
                    raise CheckpointError(
                        f"{INDEX_NAME} maps {name} to {file.name}, which lacks it"
                    )
                shapes[name] = tuple(handle.get_slice(name).get_shape())
            self._shapes = shapes
        return self._shapes

    def read_slices(self, name: str, *slices: slice) -> torch.Tensor:
        """Tensor `name` sliced along its leading dimensions (e.g. experts, rows, columns)."""
        stored = self._stored(name)
        if stored is not None:
            return stored[slices]
        return self._open(self._file_of[name]).get_slice(name)[slices]

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Tensor `name`, or only `rows` (dim 0) and/or `cols` (dim 1) of it: a view of the
        file's memory map where it can be (copied once, straight into the parameter, by the
        loader), else a copy read by safetensors. Do not write into it."""
        view = self._stored(name)
        if view is None:
            view = self._open(self._file_of[name]).get_slice(name)
        if cols is not None:
            return view[rows or slice(None), cols]
        if rows is not None:
            return view[rows]
        return view[:]

    def _stored(self, name: str) -> torch.Tensor | None:
        """Tensor `name` as a view of its file's memory map (no copy: pages are read when the
        view is), or None for a dtype torch cannot view (safetensors then reads it)."""
        file = self._file_of[name]
        if file not in self._maps:
            self._maps[file] = _map_safetensors(file)
        mapped, base, header = self._maps[file]
        info = header.get(name)
        if not isinstance(info, dict) or info.get("dtype") not in _VIEW_DTYPES:
            return None
        dtype = _VIEW_DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        raw = torch.frombuffer(mapped, dtype=torch.uint8, offset=base + start, count=end - start)
        return raw.view(dtype).reshape(info["shape"])

    def close(self) -> None:
        """Drop the open file handles and maps (a map lives on while a view of it does)."""
        self._handles.clear()
        self._maps.clear()

    def __enter__(self) -> HfCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_VIEW_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _map_safetensors(file: Path) -> tuple[mmap.mmap, int, dict]:
    """A private (copy-on-write, so torch may view it) memory map of a safetensors file, where
    its data starts, and its header."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return mapped, 8 + size, header


def validate_hf_checkpoint(
    path: str | Path | HfCheckpoint, *, tp: int = 1, ep: int = 1
) -> ModelSpec:
    """Validate a checkpoint directory for serving at `tp` x `ep`: config, then every tensor's
    shape.

    Reads file headers only. Raises `CheckpointError` listing each missing, unexpected or
    misshapen tensor by name.
    """
    ckpt = path if isinstance(path, HfCheckpoint) else HfCheckpoint(path)
    spec = validate_hf_config(ckpt.config, tp=tp, ep=ep)
    found = ckpt.shapes
    expected = hf_tensor_shapes(spec, found)
    problems = inventory_problems(expected, found, ignorable=_ignorable(spec, found))
    raise_problems(f"checkpoint {ckpt.path} does not match its config.json", problems)
    return spec


# --------------------------------------------------------------------------------------------
# per-rank shards

Reader = Callable[[HfCheckpoint], torch.Tensor]


def _block(n: int, tp: int, rank: int) -> slice:
    size = n // tp
    return slice(rank * size, (rank + 1) * size)


def _qkv_segments(spec: ModelSpec, prefix: str, kind: str) -> list[tuple[str, int, int]]:
    """The fused QKV rows in megatron's order as (hf tensor, first row, end row) runs."""
    d = spec.kv_channels
    per_group = spec.num_attention_heads // spec.num_kv_heads
    segments = []
    for g in range(spec.num_kv_heads):
        segments.append((f"{prefix}q_proj.{kind}", g * per_group * d, (g + 1) * per_group * d))
        segments.append((f"{prefix}k_proj.{kind}", g * d, (g + 1) * d))
        segments.append((f"{prefix}v_proj.{kind}", g * d, (g + 1) * d))
    return segments


def _fused_qkv(spec: ModelSpec, prefix: str, kind: str, layout: ParallelLayout) -> Reader:
    segments = _qkv_segments(spec, prefix, kind)
    total = sum(end - start for _, start, end in segments)
    want = _block(total, layout.tp, layout.tp_rank)

    def read(ckpt: HfCheckpoint) -> torch.Tensor:
        parts, offset = [], 0
        for name, start, end in segments:
            # this run covers fused rows [offset, offset + end - start)
            lo = max(want.start, offset)
            hi = min(want.stop, offset + end - start)
            if lo < hi:
                parts.append(ckpt.read(name, rows=slice(start + lo - offset, start + hi - offset)))
            offset += end - start
        return torch.cat(parts)

    return read


def _vocab_rows(spec: ModelSpec, name: str, layout: ParallelLayout) -> Reader:
    padded = spec.padded_vocab_size(layout.tp)
    want = _block(padded, layout.tp, layout.tp_rank)

    def read(ckpt: HfCheckpoint) -> torch.Tensor:
        real = slice(want.start, min(want.stop, spec.vocab_size))
        rows = ckpt.read(name, rows=real) if real.start < real.stop else None
        dtype = rows.dtype if rows is not None else torch.float32
        out = torch.zeros(want.stop - want.start, spec.hidden_size, dtype=dtype)
        if rows is not None:
            out[: rows.shape[0]] = rows
        return out

    return read


def _whole(name: str) -> Reader:
    return lambda ckpt: ckpt.read(name)


def hf_shard_readers(
    spec: ModelSpec, layout: ParallelLayout, found: Iterable[str] = ()
) -> dict[str, Reader]:
    """For each megatron parameter name, how to read this rank's shard of it from Hugging Face
    (`found`: the checkpoint's tensor names, which say how a MoE model stores its experts)."""
    names = set(found)
    tp, rank = layout.tp, layout.tp_rank
    ffn = _block(spec.ffn_hidden_size, tp, rank)
    attn_cols = _block(spec.num_attention_heads * spec.kv_channels, tp, rank)
    readers: dict[str, Reader] = {}
    if layout.is_first_stage:
        embedding = _vocab_rows(spec, "model.embed_tokens.weight", layout)
        readers["embedding.word_embeddings.weight"] = embedding
    if layout.is_last_stage:
        readers["decoder.final_layernorm.weight"] = _whole("model.norm.weight")
        if not spec.tie_embeddings:
            readers["output_layer.weight"] = _vocab_rows(spec, "lm_head.weight", layout)
        elif not layout.is_first_stage:  # tied, on its own stage: read the embedding here
            readers["output_layer.weight"] = _vocab_rows(spec, "model.embed_tokens.weight", layout)
    # A pipeline stage reads only its layers; megatron numbers them from 0 within the stage.
    for local, i in enumerate(stage_layers(spec.num_layers, layout.pp, layout.pp_rank)):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{local}."
        attn = hf + "self_attn."
        readers[mg + "input_layernorm.weight"] = _whole(hf + "input_layernorm.weight")
        readers[mg + "self_attention.linear_qkv.weight"] = _fused_qkv(spec, attn, "weight", layout)
        if spec.qkv_bias:
            readers[mg + "self_attention.linear_qkv.bias"] = _fused_qkv(spec, attn, "bias", layout)
        if spec.qk_norm:
            readers[mg + "self_attention.q_layernorm.weight"] = _whole(attn + "q_norm.weight")
            readers[mg + "self_attention.k_layernorm.weight"] = _whole(attn + "k_norm.weight")
        readers[mg + "self_attention.linear_proj.weight"] = _cols(attn + "o_proj.weight", attn_cols)
        readers[mg + "pre_mlp_layernorm.weight"] = _whole(hf + "post_attention_layernorm.weight")
        if spec.is_sparse_layer(i):
            expert_names = hf_moe.expert_names(spec, i, names)
            readers.update(hf_moe.sparse_layer_readers(spec, expert_names, layout, mg + "mlp."))
            continue
        readers[mg + "mlp.linear_fc1.weight"] = _gate_up(hf + "mlp.", ffn)
        readers[mg + "mlp.linear_fc2.weight"] = _cols(hf + "mlp.down_proj.weight", ffn)
    return readers


def _cols(name: str, cols: slice) -> Reader:
    return lambda ckpt: ckpt.read(name, cols=cols)


def _gate_up(prefix: str, rows: slice) -> Reader:
    def read(ckpt: HfCheckpoint) -> torch.Tensor:
        gate = ckpt.read(prefix + "gate_proj.weight", rows=rows)
        up = ckpt.read(prefix + "up_proj.weight", rows=rows)
        return torch.cat([gate, up])

    return read


def load_hf_weights(
    model: TeacherGPTModel,
    spec: ModelSpec,
    checkpoint: str | Path | HfCheckpoint,
    layout: ParallelLayout,
) -> None:
    """Overwrite every parameter of this rank's `model` with its shard from `checkpoint`.

    `model` must have been built from `spec` at `layout`. Raises `CheckpointError` if a shard
    does not fit its parameter, and RuntimeError if a parameter would be left unloaded.
    """
    ckpt = checkpoint if isinstance(checkpoint, HfCheckpoint) else HfCheckpoint(checkpoint)
    readers = hf_shard_readers(spec, layout, ckpt.shapes)
    params = dict(model.named_parameters())
    unloaded = sorted(set(params) - set(readers))
    unknown = sorted(set(readers) - set(params))
    if unloaded or unknown:
        # the model was built from a different spec than the readers describe
        raise RuntimeError(f"parameter mismatch: no reader for {unloaded}, no parameter {unknown}")
    writer = ParamWriter(next(iter(params.values())).device)
    try:
        for name, read in readers.items():
            with phase("read"):
                shard = read(ckpt)
            param = params[name]
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{name}: rank {layout.tp_rank}'s shard has shape {list(shard.shape)}, "
                    f"the model expects {list(param.shape)}"
                )
            with phase("copy"):
                writer.write(param, shard)
    finally:
        with phase("copy"):
            writer.finish()


def load_hf_checkpoint(
    path: str | Path,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    validate: bool = True,
) -> tuple[TeacherGPTModel, ModelSpec]:
    """Validate, build and load this rank's shard of a Hugging Face checkpoint.

    Returns the model (eval mode, no grads) and its spec. With `validate` (the default) the
    config and every tensor's name and shape are checked first, from file headers only.
    """
    with HfCheckpoint(path) as ckpt:
        if validate:
            spec = validate_hf_checkpoint(ckpt, tp=layout.tp, ep=layout.ep)
        else:
            spec = spec_from_hf_config(ckpt.config)
        with phase("build"):
            model = build_model(
                spec, layout, params_dtype=params_dtype, device=device, init_weights=False
            )
        load_hf_weights(model, spec, ckpt, layout)
    model.teacherq_spec = spec
    return model, spec
