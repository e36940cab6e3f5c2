"""FP8 compute for an FP8 checkpoint's routed experts: each `TeacherMoE` keeps this rank's
experts in float8_e4m3fn with their 128 x 128 block scales (`experts_fc1_scale`,
`experts_fc2_scale`), and `consumer.forward.moe_gemm.routed_swiglu` multiplies them in FP8
(activations quantized per token and 128-channel group at run time) instead of holding a
dequantized copy.

The shards come from the same readers as the dequantizing load (`hf_moe.sparse_layer_readers`,
per-expert or fused storage alike), run against the checkpoint views of `hf_fp8_linears`
whose reads return the stored FP8 slice or the scale blocks of that slice: expert parallelism
(which experts a rank holds) and expert tensor parallelism (which slice of their FFN) are
exactly the dequantized load's, and fc1's [gate; up] scales are stacked as its rows are.

A layer's experts convert only when every expert tensor is quantized in 128 x 128 blocks, this
rank's slice of each is whole blocks (the hidden size and the per-rank FFN width multiples of
128) and, on CUDA, the fused FP8 expert kernel runs for the model's dtype (elsewhere the
emulated float32 path of `routed_swiglu` would dequantize every expert on every forward). A
layer that does not convert loads dequantized as before; `attach_fp8_experts` says why. Shared
experts are not converted.
"""

from __future__ import annotations

import torch

from consumer.checkpoints.hf_files import HfCheckpoint
from consumer.checkpoints.hf_fp8 import Fp8Format
from consumer.checkpoints.hf_fp8_linears import NotConvertible, StoredView
from consumer.checkpoints.validate import CheckpointError
from consumer.forward import fp8_gemm, moe_gemm
from consumer.forward.load_phases import phase
from consumer.forward.moe import TeacherMoE

WHICH = ("fc1", "fc2")  # TeacherMoE's experts_{which} and experts_{which}_scale


def experts_problem(moe: TeacherMoE, fmt: Fp8Format) -> str | None:
    """Why `moe`'s experts cannot be held in FP8 for a checkpoint in `fmt` (None when they
    can, as far as shapes and the device tell; the checkpoint's tensors are checked as they
    are read)."""
    block = fp8_gemm.GROUP
    if (fmt.block_rows, fmt.block_cols) != (block, block):
        return f"weight_block_size [{fmt.block_rows}, {fmt.block_cols}]: FP8 experts take 128x128"
    _, h, f = moe.experts_fc2.shape
    if f % block:
        return (
            f"each rank's expert FFN slice is {f} wide (moe_intermediate_size / expert "
            f"tensor-parallel size), not a multiple of {block}"
        )
    if h % block:
        return f"hidden_size {h} is not a multiple of {block}"
    device, dtype = moe.experts_fc2.device, moe.config.params_dtype
    if device.type == "cuda" and not moe_gemm.fused_available(device, dtype, fp8=True):
        return (
            f"no fused FP8 expert kernel for {str(dtype).removeprefix('torch.')} on {device} "
            "(needs sm90+ and bfloat16)"
        )
    return None


def attach_fp8_experts(
    model: torch.nn.Module, ckpt: HfCheckpoint, readers: dict
) -> tuple[list[str], str | None]:
    """Give every `TeacherMoE` of `model` whose experts can be held in FP8 its FP8 expert
    shards and block scales from `ckpt` (via `readers`, `hf.hf_shard_readers`' map). Returns
    the names of the parameters now held in FP8 (load nothing else into them) and, when some
    layer's experts stay dequantized, why (the first reason found).

    Raises `CheckpointError` when a layer already holding FP8 experts (a load in place) cannot
    take this checkpoint's in FP8: its dequantized values would be rounded into FP8 tensors
    under stale scales."""
    fmt = ckpt.fp8
    if fmt is None:
        return [], None
    views = (StoredView(ckpt, "weight"), StoredView(ckpt, "scale"))
    converted: list[str] = []
    why: str | None = None
    for prefix, moe in model.named_modules():
        if not isinstance(moe, TeacherMoE):
            continue
        names = [f"{prefix}.experts_{which}" for which in WHICH]
        problem = experts_problem(moe, fmt)
        shards: list[tuple[torch.Tensor, torch.Tensor]] = []
        if problem is None:
            try:
                with phase("read"):
                    shards = [(readers[n](views[0]), readers[n](views[1])) for n in names]
            except NotConvertible as exc:
                problem = f"{exc} is not stored in whole FP8 blocks with a scale"
        if problem is None:
            problem = _shape_problem(moe, shards)
        if problem is not None:
            if moe.expert_scale("fc1") is not None:
                raise CheckpointError(
                    f"{prefix}: holds FP8 experts, but this checkpoint's cannot load in FP8 "
                    f"({problem}); load it anew, or serve with model.fp8=dequantize"
                )
            why = why or problem
            continue
        (fc1, fc1_scale), (fc2, fc2_scale) = shards
        with phase("copy"):
            hold_fp8_experts(moe, fc1, fc1_scale.flatten(1, 2), fc2, fc2_scale)
        converted += names
    return converted, why


def _shape_problem(moe: TeacherMoE, shards: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why the read FP8 shards do not fit `moe`'s experts (None when they do)."""
    block = fp8_gemm.GROUP
    for which, (weight, scale) in zip(WHICH, shards, strict=True):
        want = tuple(getattr(moe, f"experts_{which}").shape)
        want_scale = (*want[:-2], want[-2] // block, want[-1] // block)
        if weight.dtype != torch.float8_e4m3fn:
            return f"experts_{which} stored as {weight.dtype}, not float8_e4m3fn"
        if tuple(weight.shape) != want or tuple(scale.shape) != want_scale:
            return (
                f"experts_{which}: read {list(weight.shape)} with scales {list(scale.shape)}, "
                f"the layer holds {list(want)}"
            )
    return None


def hold_fp8_experts(
    moe: TeacherMoE,
    fc1: torch.Tensor,
    fc1_scale: torch.Tensor,
    fc2: torch.Tensor,
    fc2_scale: torch.Tensor,
) -> None:
    """Hold FP8 experts in `moe`: fc1 [E_local, 2, f_l, h] and fc2 [E_local, h, f_l] in
    float8_e4m3fn, fc1_scale [E_local, 2 f_l / 128, h / 128] ([gate; up] row blocks) and
    fc2_scale [E_local, h / 128, f_l / 128] in float32. A layer already holding FP8 experts
    of these shapes gets the values copied into its tensors (a weight update in place: what
    was recorded on those tensors stays valid)."""
    device = moe.experts_fc1.device
    new = {"fc1": (fc1, fc1_scale), "fc2": (fc2, fc2_scale)}
    if all(_holds(moe, which, weight, scale) for which, (weight, scale) in new.items()):
        with torch.no_grad():
            for which, (weight, scale) in new.items():
                getattr(moe, f"experts_{which}").copy_(weight)
                getattr(moe, f"experts_{which}_scale").copy_(scale)
        return
    for which, (weight, scale) in new.items():
        param = torch.nn.Parameter(weight.to(device).contiguous(), requires_grad=False)
        setattr(moe, f"experts_{which}", param)
        setattr(moe, f"experts_{which}_scale", scale.to(device, torch.float32).contiguous())


def _holds(moe: TeacherMoE, which: str, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `moe` already holds FP8 experts `which` of `weight`'s and `scale`'s shapes."""
    held, held_scale = getattr(moe, f"experts_{which}"), moe.expert_scale(which)
    return (
        held_scale is not None
        and held_scale.shape == scale.shape
        and held.shape == weight.shape
        and held.dtype == weight.dtype
    )
