"""Build a megatron-core GPTModel for prefill-only teacher scoring.

`ModelSpec` is the architecture in plain numbers (what a Hugging Face config.json or a Megatron
checkpoint describes); `build_model` turns it into a `TeacherGPTModel` on this rank's shard of the
tensor-parallel layout. The model stops before the output layer: the teacher head
(`consumer/tp_ops/`) multiplies hidden states by the vocab-parallel output weight in row chunks,
so no [tokens, vocab] logits tensor is ever materialised.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn import functional as F

from consumer import kernels
from consumer.forward.attention import SdpaCoreAttention, TreeBounds
from consumer.forward.mla import HeadSplit, TeacherMLA, rope_table
from consumer.forward.moe import CHECKPOINT_ENTRIES, ExpertLayout, TeacherMoE
from consumer.forward.spec import TINY, TINY_SEED, VOCAB_PAD_MULTIPLE, ModelSpec
from consumer.parallel import ParallelLayout

__all__ = [
    "TINY",
    "TINY_SEED",
    "VOCAB_PAD_MULTIPLE",
    "ModelSpec",
    "TeacherGPTModel",
    "build_model",
    "stage_layers",
]


class TeacherGPTModel(GPTModel):
    """GPTModel whose forward returns final hidden states [s, b, h] instead of logits."""

    def _postprocess(self, hidden_states, *args, **kwargs):  # megatron hook, see module doc
        return hidden_states

    def _preprocess(self, *args, **kwargs):  # megatron hook: embeddings and the rotary table
        out = super()._preprocess(*args, **kwargs)
        params = kwargs.get("packed_seq_params")
        if isinstance(params, TreeBounds) and out[1] is not None:
            # Megatron would rotate row t of a thd segment by the angles of index t within it;
            # a response continuing a shared prompt needs its real positions instead. So the
            # rotation happens in SdpaCoreAttention, from the cos and sin of the angles at the
            # explicit position ids, gathered here once per forward from tables computed by the
            # model's own rotary module (scaling included); megatron gets no rotary embedding.
            positions = kwargs["position_ids"].reshape(-1)
            cos, sin = self.rope_tables(positions.device, params.max_seqlen_q)
            params.rope = (cos[positions], sin[positions])
            out = (out[0], None, *out[2:])
        return out

    def rope_tables(
        self, device: torch.device, positions: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary angles of positions 0 .. n - 1, [n, rot_dim / 2] fp32 each,
        n = max_sequence_length or, for longer inputs, the next power of two >= `positions`.

        Computed by the model's own rotary module (scaling included) and kept as non-persistent
        buffers, so they move with the model and keep one address until they must grow: a CUDA
        graph of the forward reads them there (megatron's own tables live in an LRU cache that
        may drop them). Whoever holds graphs compares the tables before and after a call that
        may grow them (see Scorer)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current one
            device = torch.device("cuda", torch.cuda.current_device())
        cos = getattr(self, "_rope_cos", None)
        if cos is None or cos.device != device or cos.shape[0] < positions:
            if self.config.rotary_interleaved:
                raise ValueError("interleaved rotary embeddings are not supported")
            n = max(self.max_sequence_length, 1 << max(positions - 1, 0).bit_length())
            if self.rope_table is not None:  # latent attention: YaRN and its mscale
                cos, sin = self.rope_table(n)
            else:
                emb = self.rotary_pos_emb(n)  # [n, 1, 1, rot], cat(angles, angles)
                angles = emb[:, 0, 0, : emb.shape[-1] // 2].float()
                cos, sin = angles.cos(), angles.sin()
            self.register_buffer("_rope_cos", cos.to(device).contiguous(), persistent=False)
            self.register_buffer("_rope_sin", sin.to(device).contiguous(), persistent=False)
        return self._rope_cos, self._rope_sin

    # cos and sin of n positions from the spec (latent attention); None: megatron's rotary module
    rope_table: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None

    stage_first_layer = 0  # global index of this pipeline stage's first layer
    stage_replica_shift = 0  # see _stage_checkpoint_offsets

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's sharded state dict; on a later pipeline stage, checkpoint keys that name
        a layer (`decoder.layers.<i>.`, per-layer keys) name its global index, and megatron's
        entries say which data-parallel replica holds them without counting stages."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not (self.stage_first_layer or self.stage_replica_shift):
            return out
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        head = f"{prefix}decoder.layers."
        for item in nested_values(out):
            key = getattr(item, "key", None)
            if not isinstance(key, str):
                continue
            if self.stage_first_layer and key.startswith(head):
                index, dot, rest = key[len(head) :].partition(".")
                if index.isdigit() and dot:
                    item.key = f"{head}{self.stage_first_layer + int(index)}.{rest}"
            if self.stage_replica_shift and key.rpartition(".mlp.")[2] not in CHECKPOINT_ENTRIES:
                rid = item.replica_id  # TeacherMoE's entries count replicas themselves
                shift = self.stage_replica_shift
                item.replica_id = (
                    (*rid[:-1], rid[-1] - shift) if isinstance(rid, tuple) else (rid - shift)
                )
        return out

    def output_weight_shard(self) -> torch.Tensor:
        """This rank's rows of the output projection, [padded_vocab / tp, hidden]."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight


class TeacherMLP(MLP):
    """megatron's gated MLP with SwiGLU as one fused kernel on CUDA (consumer/kernels/
    swiglu.py) instead of megatron's three strided elementwise passes; silu(gate) * up in
    PyTorch elsewhere. Forward only: a teacher never trains."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):  # megatron's signature
        if per_token_scale is not None:  # MoE experts only: megatron's own path
            return super().forward(hidden_states, per_token_scale, **kwargs)
        h, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            h = h + bias
        return self.linear_fc2(swiglu(h))


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of fc1's output [..., 2 * ffn] = [gate | up]."""
    fused = kernels.load(x.device)
    if fused is not None:
        return fused.swiglu(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """The layers (global indices) pipeline stage `pp_rank` of `pp` holds: consecutive slices,
    the first `num_layers % pp` stages one layer more than the others (32 layers on pp=3:
    11, 11, 10). Raises ValueError when a stage would hold none."""
    if pp > num_layers:
        raise ValueError(
            f"pipeline parallelism pp={pp} exceeds the model's {num_layers} layers; use pp <= "
            f"{num_layers} (TEACHERQ_PARALLEL__PP)"
        )
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def transformer_config(
    spec: ModelSpec,
    *,
    tp: int,
    params_dtype: torch.dtype,
    init_weights: bool = True,
    num_layers: int | None = None,
) -> TransformerConfig:
    """The megatron TransformerConfig for a spec, teacher-only (no dropout, no grads needed);
    `num_layers`: a pipeline stage's share of the layers (default: all of them)."""
    return TransformerConfig(
        num_layers=spec.num_layers if num_layers is None else num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=init_weights,
        persist_layer_norm=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def build_model(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = TINY_SEED,
    init_weights: bool = True,
    fp8_experts: bool = False,
) -> TeacherGPTModel:
    """Build this rank's shard of the model in eval mode with gradients off.

    Weights are random-initialised from `seed` (identically for any TP size, since megatron
    initialises the full master weight on CPU and slices it). Checkpoint loaders pass
    `init_weights=False`: the parameters are then zero-filled instead of drawn, which for a
    multi-billion-parameter model saves minutes of CPU time before every weight is overwritten.

    At pp > 1 the model holds only this stage's layers (`stage_layers`, numbered from 0 in it),
    the embedding on the first stage and the final norm and output weight on the last; random
    weights are then this stage's part of the whole model drawn as at pp = 1, so a seed gives
    one teacher whatever the layout.

    A bf16 MoE teacher on an sm90 device starts quack-kernels' import on a thread
    (`quack_gemm.preload`): its experts' GEMMs run there. `fp8_experts` says the load that
    follows holds the experts in FP8 (an FP8 checkpoint under FP8 compute: `hf.fp8_plan`),
    whose GEMMs are ours, so nothing is imported for them.
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if layout.pp > 1 and init_weights:
        whole_layout = dataclasses.replace(layout, pp=1, pp_rank=0)
        whole = build_model(spec, whole_layout, params_dtype=params_dtype, seed=seed)
        stage = build_model(spec, layout, params_dtype=params_dtype, init_weights=False)
        _copy_stage(whole, stage, stage_layers(spec.num_layers, layout.pp, layout.pp_rank))
        return stage.to(device=device)

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
    layers = stage_layers(spec.num_layers, layout.pp, layout.pp_rank)
    config = transformer_config(
        spec,
        tp=layout.tp,
        params_dtype=params_dtype,
        init_weights=init_weights,
        num_layers=len(layers),
    )
    if spec.is_moe:  # dense and sparse layers differ: checkpoint keys per layer, not stacked
        config.hetereogenous_dist_checkpoint = True  # (megatron's spelling)
        if params_dtype == torch.bfloat16 and not fp8_experts:
            from consumer.forward import quack_gemm

            quack_gemm.preload(torch.device(device))  # on CUDA: imported while weights load
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm)
    layer_spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    layer_spec.submodules.mlp.module = TeacherMLP
    if spec.is_mla:
        heads = HeadSplit(
            tp=layout.tp, rank=layout.tp_rank, group=layout.tp_group if layout.tp > 1 else None
        )
        layer_spec.submodules.self_attention = ModuleSpec(
            module=TeacherMLA, params={"spec": spec, "heads": heads}
        )
    block_spec = _moe_block_spec(spec, layout, layer_spec, layers) if spec.is_moe else layer_spec
    rope_kwargs = _rope_kwargs(spec)
    with torch.device("cpu"):
        model = TeacherGPTModel(
            config=config,
            transformer_layer_spec=block_spec,
            vocab_size=spec.padded_vocab_size(layout.tp),
            max_sequence_length=spec.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta),
            rotary_percent=1.0 if spec.is_mla else spec.rotary_percent,
            share_embeddings_and_output_weights=spec.tie_embeddings,
            pre_process=layout.is_first_stage,
            post_process=layout.is_last_stage,
            **rope_kwargs,
        )
    model.requires_grad_(False)
    if spec.is_mla:
        model.rope_table = functools.partial(rope_table, spec)
    # Megatron's torch norms keep fp32 weights whatever params_dtype says. Given bf16 inputs
    # and fp32 weights, torch.rms_norm falls back to its unfused form (an fp32 copy and four
    # more kernels per norm: 16 % of a 1.5B forward on an H200); in the inputs' dtype it runs
    # its fused kernel. Checkpoints store these weights in the model's dtype anyway.
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(dtype=params_dtype)
    if not init_weights:  # defined contents (zeros) for anything a loader leaves, e.g. padding
        if torch.device(device).type != "cpu" and next(model.buffers(), None) is None:
            # The host build's memory was never written: allocate on the device instead of
            # copying it there (seconds for a large teacher), and zero it there.
            model.to_empty(device=device)
        for p in model.parameters():
            p.zero_()
    if layout.pp > 1:
        _stage_checkpoint_offsets(
            model,
            layers,
            spec.num_layers,
            replica_shift=layout.pp_rank * layout.replica_size // layout.tp,
        )
    return model.to(device=device).eval()


@torch.no_grad()
def _copy_stage(whole: TeacherGPTModel, stage: TeacherGPTModel, layers: range) -> None:
    """Copy a stage's parameters out of the whole model (pp = 1, same TP shard)."""
    full = dict(whole.named_parameters())
    for name, param in stage.named_parameters():
        source = name
        if name.startswith("decoder.layers."):
            local, rest = name.removeprefix("decoder.layers.").split(".", 1)
            source = f"decoder.layers.{layers.start + int(local)}.{rest}"
        elif name == "output_layer.weight" and name not in full:  # tied: the embedding
            source = "embedding.word_embeddings.weight"
        param.copy_(full[source])


def _stage_checkpoint_offsets(
    model: TeacherGPTModel, layers: range, total: int, *, replica_shift: int
) -> None:
    """Make a stage's layers describe themselves in torch_dist checkpoints as layers
    `layers` of `total` (megatron sees each stage as a whole model, so it would say 0 .. n - 1
    of n): each layer's sharded state dict gets its place on the stacked layer axis, and the
    stage reads exactly its slice of every stacked tensor. Checkpoints keyed per layer
    (mixture-of-experts models) get the layer's global index in the key instead
    (`TeacherGPTModel.sharded_state_dict`).

    Saving: megatron numbers data-parallel replicas over the whole world, stages included
    (rank // tp), so a later stage's tensors would count as replicas of another's and never be
    written; `replica_shift` (this stage's share of that number) is taken off again."""
    model.stage_first_layer = layers.start
    model.stage_replica_shift = replica_shift
    for local, layer in enumerate(model.decoder.layers):
        method = layer.sharded_state_dict

        def shifted(prefix="", sharded_offsets=(), metadata=None, _method=method, _local=local):
            moved = tuple(
                (axis, layers.start + _local, total) if axis == 0 else (axis, at, size)
                for axis, at, size in sharded_offsets
            )
            return _method(prefix, moved, metadata)

        layer.sharded_state_dict = shifted


def _moe_block_spec(spec: ModelSpec, layout: ParallelLayout, layer_spec, indices: range):
    """Per-layer specs of the layers `indices`: the sparse ones get a TeacherMoE in their MLP
    slot."""
    experts = ExpertLayout(
        size=layout.replica_size,
        rank=layout.replica_rank,
        replica=layout.dp_rank,
        ep=layout.ep,
        group=layout.stage_group if layout.replica_size > 1 else None,
    )
    layers = []
    for i in indices:
        layer = copy.copy(layer_spec)
        if spec.is_sparse_layer(i):
            layer.submodules = copy.copy(layer_spec.submodules)
            layer.submodules.mlp = ModuleSpec(
                module=TeacherMoE, params={"spec": spec, "experts": experts}
            )
        layers.append(layer)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)


def _rope_kwargs(spec: ModelSpec) -> dict:
    scaling = spec.rope_scaling
    if (
        not scaling or spec.is_mla
    ):  # latent attention computes its own tables (consumer/forward/mla.py)
        return {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "llama3":
        return {"rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}
    if kind == "linear":
        return {"seq_len_interpolation_factor": float(scaling["factor"])}
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; supported: 'llama3', 'linear', or none"
    )
