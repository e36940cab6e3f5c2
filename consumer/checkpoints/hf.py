"""Hugging Face safetensors checkpoints of the families in `shared/families.py` (Llama, Qwen2/2.5,
Qwen3 dense; Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 and GLM-4.5, whose expert tensors
consumer/checkpoints/hf_moe.py maps and whose latent attention hf_mla.py maps) into a megatron
GPTModel.

A checkpoint is a directory with `config.json` (turned into a `ModelSpec` by `hf_config.py`)
and one or more `*.safetensors` files (sharded ones listed in `model.safetensors.index.json`,
read through `hf_files.py`). Loading is per rank: each tensor-parallel rank
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
  keep their order (GLM-4.5's partial rotary turns the first dims of each head, as megatron's
  `rotary_percent` does).
- FP8 block-quantized checkpoints (`quantization_config`, `hf_fp8.py`) are dequantized as
  each rank reads its slice (inside `HfCheckpoint.read`), so the readers here are the same.
  Where FP8 GEMMs run, the same readers give the linears (`hf_fp8_linears.py`) and the MoE
  experts (`hf_fp8_experts.py`) their stored FP8 shards and block scales instead.
- Published DeepSeek-V3 / GLM-4.5 checkpoints carry multi-token-prediction layers after the
  model's own (`model.layers.{num_hidden_layers}.*`): skipped, and named in the log.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import structlog
import torch

from consumer.checkpoints import direct_read, hf_files, hf_fp8, hf_mla, hf_moe
from consumer.checkpoints.direct_read import DirectStage
from consumer.checkpoints.hf_config import (
    SUPPORTED_FAMILIES,
    moe_reason,
    spec_from_hf_config,
    validate_hf_config,
)
from consumer.checkpoints.hf_files import HfCheckpoint, Reader, Shard
from consumer.checkpoints.parallel_read import THREADS as READ_THREADS
from consumer.checkpoints.parallel_read import read_ahead, read_plan
from consumer.checkpoints.validate import CheckpointError, inventory_problems, raise_problems
from consumer.forward.load_phases import phase
from consumer.forward.model import ModelSpec, TeacherGPTModel, build_model, stage_layers
from consumer.forward.weight_copy import ParamWriter
from consumer.parallel import ParallelLayout

__all__ = [
    "SUPPORTED_FAMILIES",
    "HfCheckpoint",
    "hf_shard_readers",
    "hf_tensor_shapes",
    "load_hf_checkpoint",
    "load_hf_weights",
    "moe_reason",
    "spec_from_hf_config",
    "validate_hf_checkpoint",
    "validate_hf_config",
]

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------------------------
# tensor inventory


def hf_tensor_shapes(spec: ModelSpec, found: Iterable[str] = ()) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `spec` must hold, with its shape (for a MoE
    model, in the expert layout the tensor names `found` use)."""
    names = set(found)
    h, f, v = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if spec.is_mla:
            shapes.update(hf_mla.attention_shapes(spec, p + "self_attn."))
        else:
            shapes.update(_gqa_shapes(spec, p + "self_attn."))
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


def _gqa_shapes(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    """Grouped-query attention's tensors of one layer (`p` = `model.layers.{i}.self_attn.`)."""
    h, d = spec.hidden_size, spec.kv_channels
    q_rows, kv_rows = spec.num_attention_heads * d, spec.num_kv_heads * d
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
    shapes: dict[str, tuple[int, ...]] = {f"{p}{n}.weight": (r, h) for n, r in rows.items()}
    shapes[p + "o_proj.weight"] = (h, q_rows)
    if spec.qkv_bias:
        shapes.update({f"{p}{n}.bias": (r,) for n, r in rows.items()})
    if spec.qk_norm:
        shapes.update({p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)})
    return shapes


def _ignorable(spec: ModelSpec, found: dict[str, tuple[int, ...]]) -> list[str]:
    # Old Llama exports carry the (recomputed) RoPE buffer; tied checkpoints sometimes still
    # store the lm_head copy of the embedding, which transformers ignores as well.
    names = [n for n in found if n.endswith(".rotary_emb.inv_freq")]
    if spec.tie_embeddings and found.get("lm_head.weight") == (spec.vocab_size, spec.hidden_size):
        names.append("lm_head.weight")
    return names + nextn_layers(spec, found)


def nextn_layers(spec: ModelSpec, found: Iterable[str]) -> list[str]:
    """Tensors of the multi-token-prediction layers that published DeepSeek-V3 / GLM-4.5
    checkpoints carry after the model's own (`model.layers.{num_hidden_layers}.` on): not part
    of the forward, so never read."""
    family = spec.family_record
    if family is None or not family.nextn_layers:
        return []
    out = []
    for name in found:
        head, _, rest = name.partition("model.layers.")
        index = rest.partition(".")[0]
        if not head and index.isdigit() and int(index) >= spec.num_layers:
            out.append(name)
    return out


def validate_hf_checkpoint(
    path: str | Path | HfCheckpoint, *, tp: int = 1, ep: int = 1
) -> ModelSpec:
    """Validate a checkpoint directory for serving at `tp` x `ep`: config, then every tensor's
    shape (an FP8 checkpoint's: every scale's too, and a split keeping whole scale blocks).

    Reads file headers only. Raises `CheckpointError` listing each missing, unexpected or
    misshapen tensor by name.
    """
    ckpt = path if isinstance(path, HfCheckpoint) else HfCheckpoint(path)
    spec = validate_hf_config(ckpt.config, tp=tp, ep=ep)
    found = ckpt.shapes
    expected = hf_tensor_shapes(spec, found)
    problems = []
    if ckpt.fp8 is not None:
        fmt = ckpt.fp8
        for weight, scale in ckpt.scales.items():
            if weight in expected:
                expected[scale] = hf_fp8.scale_shape(expected[weight], fmt)
        unscaled = [n for n, t in ckpt.dtypes.items() if t in hf_fp8.FP8_DTYPES]
        problems += [f"{n}: stored in FP8 without its {hf_fp8.scale_name(n)}"
                     for n in sorted(set(unscaled) - set(ckpt.scales))]  # fmt: skip
        split = hf_fp8.split_problems(spec, fmt, ckpt.scales, tp=tp, ep=ep)
        raise_problems(f"FP8 checkpoint {ckpt.path}: choose parallel.tp / parallel.ep so each "
                       "rank owns whole scale blocks", split)  # fmt: skip
    problems += inventory_problems(expected, found, ignorable=_ignorable(spec, found))
    raise_problems(f"checkpoint {ckpt.path} does not match its config.json", problems)
    return spec


# --------------------------------------------------------------------------------------------
# per-rank shards


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

    def read(ckpt: HfCheckpoint) -> Shard:
        parts, offset = [], 0
        for name, start, end in segments:
            # this run covers fused rows [offset, offset + end - start)
            lo = max(want.start, offset)
            hi = min(want.stop, offset + end - start)
            if lo < hi:
                parts.append(ckpt.read(name, rows=slice(start + lo - offset, start + hi - offset)))
            offset += end - start
        return hf_files.cat(parts)

    return read


def _vocab_rows(spec: ModelSpec, name: str, layout: ParallelLayout) -> Reader:
    padded = spec.padded_vocab_size(layout.tp)
    want = _block(padded, layout.tp, layout.tp_rank)

    def read(ckpt: HfCheckpoint) -> Shard:
        real = slice(want.start, min(want.stop, spec.vocab_size))
        size = want.stop - want.start
        if real.start >= real.stop:  # a shard of padding rows only
            return torch.zeros(size, spec.hidden_size)
        rows = ckpt.read(name, rows=real)
        if rows.shape[0] == size:
            return rows
        pad = torch.zeros(size - rows.shape[0], spec.hidden_size, dtype=rows.dtype,
                          device=rows.device)  # fmt: skip
        return hf_files.cat([rows, pad])

    return read


def _whole(name: str) -> Reader:
    return lambda ckpt: ckpt.read(name)


def hf_shard_readers(
    spec: ModelSpec, layout: ParallelLayout, found: Iterable[str] = ()
) -> dict[str, Reader]:
    """For each megatron parameter name, how to read this rank's shard of it from Hugging Face
    (`found`: the checkpoint's tensor names, which say how a MoE model stores its experts)."""
    names = set(found)
    ffn = _block(spec.ffn_hidden_size, layout.tp, layout.tp_rank)
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
        attn, mg_attn = hf + "self_attn.", mg + "self_attention."
        readers[mg + "input_layernorm.weight"] = _whole(hf + "input_layernorm.weight")
        if spec.is_mla:
            readers.update(hf_mla.attention_readers(spec, layout, attn, mg_attn))
        else:
            readers.update(_gqa_readers(spec, layout, attn, mg_attn))
        readers[mg + "pre_mlp_layernorm.weight"] = _whole(hf + "post_attention_layernorm.weight")
        if spec.is_sparse_layer(i):
            expert_names = hf_moe.expert_names(spec, i, names)
            readers.update(hf_moe.sparse_layer_readers(spec, expert_names, layout, mg + "mlp."))
            continue
        readers[mg + "mlp.linear_fc1.weight"] = _gate_up(hf + "mlp.", ffn)
        readers[mg + "mlp.linear_fc2.weight"] = _cols(hf + "mlp.down_proj.weight", ffn)
    return readers


def _gqa_readers(spec: ModelSpec, layout: ParallelLayout, attn: str, mg: str) -> dict[str, Reader]:
    """megatron's SelfAttention at prefix `mg` from Hugging Face prefix `attn`."""
    cols = _block(spec.num_attention_heads * spec.kv_channels, layout.tp, layout.tp_rank)
    readers = {
        mg + "linear_qkv.weight": _fused_qkv(spec, attn, "weight", layout),
        mg + "linear_proj.weight": _cols(attn + "o_proj.weight", cols),
    }
    if spec.qkv_bias:
        readers[mg + "linear_qkv.bias"] = _fused_qkv(spec, attn, "bias", layout)
    if spec.qk_norm:
        readers[mg + "q_layernorm.weight"] = _whole(attn + "q_norm.weight")
        readers[mg + "k_layernorm.weight"] = _whole(attn + "k_norm.weight")
    return readers


def _cols(name: str, cols: slice) -> Reader:
    return lambda ckpt: ckpt.read(name, cols=cols)


def _gate_up(prefix: str, rows: slice) -> Reader:
    def read(ckpt: HfCheckpoint) -> Shard:
        gate = ckpt.read(prefix + "gate_proj.weight", rows=rows)
        up = ckpt.read(prefix + "up_proj.weight", rows=rows)
        return hf_files.cat([gate, up])

    return read


def load_hf_weights(
    model: TeacherGPTModel,
    spec: ModelSpec,
    checkpoint: str | Path | HfCheckpoint,
    layout: ParallelLayout,
    *,
    fp8: str = "auto",
    read_threads: int = READ_THREADS,
    read_direct: bool | None = None,
) -> None:
    """Overwrite every parameter of this rank's `model` with its shard from `checkpoint`.

    `model` must have been built from `spec` at `layout`; an FP8 checkpoint is dequantized
    to the model's dtype, or its linears and experts held in FP8 where FP8 GEMMs run (`fp8`:
    the `model.fp8` setting). `read_threads` threads read the shards' bytes from disk ahead
    of the copy (`parallel_read`; 0: the copy's page faults read them); `read_direct`: they
    read the bytes into staging buffers instead, past the page cache (`direct_read`; None:
    where `direct_read.choose` says, for a cold checkpoint). Raises
    `CheckpointError` if a shard does not fit its parameter, and RuntimeError if a parameter
    would be left unloaded.
    """
    ckpt = checkpoint if isinstance(checkpoint, HfCheckpoint) else HfCheckpoint(checkpoint)
    readers = hf_shard_readers(spec, layout, ckpt.shapes)
    skipped = nextn_layers(spec, ckpt.shapes)
    if skipped:
        layers = sorted({int(n.split(".")[2]) for n in skipped})
        log.info("checkpoint.nextn_layers_skipped", layers=layers, tensors=len(skipped),
                 reason="multi-token-prediction layers are not part of the forward")  # fmt: skip
    in_fp8 = _fp8_linears(model, ckpt, readers, fp8)
    model.teacherq_fp8_plan = fp8_plan(ckpt, next(model.parameters()).device, fp8)
    params = dict(model.named_parameters())
    unloaded = sorted(set(params) - set(readers))
    unknown = sorted(set(readers) - set(params))
    if unloaded or unknown:
        # the model was built from a different spec than the readers describe
        raise RuntimeError(f"parameter mismatch: no reader for {unloaded}, no parameter {unknown}")
    loads = [(name, read) for name, read in readers.items() if name not in in_fp8]
    device = next(iter(params.values())).device
    plan = read_plan(ckpt, [read for _, read in loads]) if read_threads > 0 else []
    if read_direct is None:
        read_direct = direct_read.choose(plan, device)
    stage = (
        DirectStage(ckpt, plan, pinned=device.type == "cuda", threads=read_threads)
        if read_direct and read_threads > 0
        else None
    )
    ahead = (stage or read_ahead(ckpt, plan, threads=read_threads)).start()
    writer = ParamWriter(device, progress=ahead.progress)  # the read-ahead follows the copy
    try:
        for i, (name, read) in enumerate(loads):
            with phase("read"), hf_files.joined_lazily():
                shard = read(stage.view(i) if stage else ckpt)  # parts joined on the device
            param = params[name]
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{name}: rank {layout.tp_rank}'s shard has shape {list(shard.shape)}, "
                    f"the model expects {list(param.shape)}"
                )
            with phase("copy"):
                writer.write(param, shard)  # the map's pages are read here
            del shard  # (a view of a staging buffer, which `advance` hands back)
            ahead.advance(i)
    finally:
        ahead.close()
        with phase("copy"):
            writer.finish()
    log.debug("checkpoint.read_ahead", threads=ahead.threads, bytes=ahead.bytes_read)


def fp8_plan(ckpt: HfCheckpoint, device: torch.device, fp8: str) -> tuple | None:
    """Which linears and MoE experts a load of `ckpt` on `device` under `model.fp8` = `fp8`
    holds in FP8: None when none do (no FP8 checkpoint, or it is dequantized), else its block
    size and quantized tensors. Two checkpoints of one shape and one plan convert the same
    linears and experts, so one can be loaded in place of the other (`Reloader`); a different
    plan rebuilds."""
    if ckpt.fp8 is None or hf_fp8.fp8_compute_problem(fp8, device, ckpt.fp8) is not None:
        return None
    return (ckpt.fp8.block_rows, ckpt.fp8.block_cols, frozenset(ckpt.scales))


def _fp8_linears(model: TeacherGPTModel, ckpt: HfCheckpoint, readers: dict, fp8: str) -> set:
    """With an FP8 checkpoint where FP8 GEMMs run, give the linears and the MoE experts their
    FP8 shards (the names returned; those already in FP8 are overwritten where they are); log
    what stays dequantized and why."""
    if ckpt.fp8 is None:
        return set()
    first = next(model.parameters())
    why = hf_fp8.fp8_compute_problem(fp8, first.device, ckpt.fp8)
    converted: list[str] = []
    if why is None:
        from consumer.checkpoints.hf_fp8_experts import attach_fp8_experts
        from consumer.checkpoints.hf_fp8_linears import attach_fp8_linears

        converted = attach_fp8_linears(model, ckpt, readers)
        experts, experts_why = attach_fp8_experts(model, ckpt, readers)
        log.info(
            "checkpoint.fp8_compute",
            fp8_linears=len(converted),
            fp8_expert_layers=len(experts) // 2,
            other_quantized_tensors="dequantized (shared experts, latent attention)",
        )
        if experts_why is not None:
            log.info("checkpoint.fp8_experts_dequantized", reason=experts_why)
        converted += experts
    else:
        log.info("checkpoint.fp8_dequantized", quantized_tensors=len(ckpt.scales),
                 block=[ckpt.fp8.block_rows, ckpt.fp8.block_cols],
                 dtype=str(first.dtype).removeprefix("torch."), reason=why)  # fmt: skip
    return set(converted)


def build_hf_shell(
    path: str | Path,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype,
    device: torch.device,
    fp8: str = "auto",
) -> tuple[TeacherGPTModel, ModelSpec] | None:
    """This rank's model of the Hugging Face checkpoint at `path`, validated and built with
    every parameter zero, to be warmed up while the checkpoint's bytes are still coming from
    disk and then loaded in place (`load_hf_weights`). None where the load would change the
    model rather than its values (linears or experts held in FP8: `fp8_plan`)."""
    with HfCheckpoint(path) as ckpt:
        spec = validate_hf_checkpoint(ckpt, tp=layout.tp, ep=layout.ep)
        if fp8_plan(ckpt, device, fp8) is not None:
            return None
    with phase("build"):
        model = build_model(
            spec, layout, params_dtype=params_dtype, device=device, init_weights=False
        )
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()  # finite values for the warm-up (uninitialized memory may not be)
    model.teacherq_spec = spec
    model.teacherq_fp8_plan = None
    return model, spec


def load_hf_checkpoint(
    path: str | Path,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    validate: bool = True,
    fp8: str = "auto",
) -> tuple[TeacherGPTModel, ModelSpec]:
    """Validate, build and load this rank's shard of a Hugging Face checkpoint.

    Returns the model (eval mode, no grads) and its spec. With `validate` (the default) the
    config and every tensor's name and shape are checked first, from file headers only.
    `fp8`: the `model.fp8` setting, for FP8 block-quantized checkpoints.
    """
    with HfCheckpoint(path) as ckpt:
        if validate:
            spec = validate_hf_checkpoint(ckpt, tp=layout.tp, ep=layout.ep)
        else:
            spec = spec_from_hf_config(ckpt.config)
        # experts held in FP8 run our GEMMs: quack's import is not started for them (a layer
        # whose experts stay dequantized, `attach_fp8_experts`, imports it at its first forward)
        in_fp8 = fp8_plan(ckpt, torch.device(device), fp8) is not None
        with phase("build"):
            model = build_model(
                spec, layout, params_dtype=params_dtype, device=device, init_weights=False,
                fp8_experts=in_fp8,
            )  # fmt: skip
        load_hf_weights(model, spec, ckpt, layout, fp8=fp8)
    model.teacherq_spec = spec
    return model, spec
