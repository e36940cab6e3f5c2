"""FP8 compute for an FP8 checkpoint's tensor-parallel linears: each quantized megatron
`ColumnParallelLinear` / `RowParallelLinear` keeps this rank's FP8 weight shard and its block
scales, and multiplies through `consumer.forward.fp8_gemm` (activations quantized per token and
128-channel group at run time) instead of holding a dequantized copy.

The shards come from the same readers as the dequantizing load (`hf.hf_shard_readers`): they
run against a view of the checkpoint whose reads return the stored FP8 slice, then against one
whose reads return the scale blocks of that slice, so a fused parameter (QKV, gate/up) gets
its scales fused the same way. A parameter is converted only when every tensor it is read from
is quantized and every slice is whole blocks; anything else (embeddings, norms, latent
attention's own linears) loads dequantized as before. MoE experts are `hf_fp8_experts`' work.
"""

from __future__ import annotations

import functools
import math

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from consumer.checkpoints import hf_fp8
from consumer.checkpoints.hf_files import HfCheckpoint
from consumer.forward import fp8_gemm


class NotConvertible(Exception):
    """A parameter read from an unquantized tensor, or through a slice that cuts blocks (the
    message: that tensor's name)."""


class StoredView(HfCheckpoint):
    """The checkpoint, with reads returning the stored FP8 slice (`what="weight"`) or the
    scale blocks that slice covers (`what="scale"`). Any reader of `hf.hf_shard_readers`
    run against it gives a parameter's FP8 shard, or its scales fused and sliced the same way
    (`hf_fp8_experts` reads the experts through it too); a read it cannot serve raises
    `NotConvertible`."""

    def __init__(self, ckpt: HfCheckpoint, what: str) -> None:  # shares ckpt's open files
        self.__dict__.update(ckpt.__dict__)
        self._what = what

    def read_slices(self, name: str, *slices: slice) -> torch.Tensor:
        """The stored FP8 values, or the scale blocks, of `name` at `slices`."""
        scale, fmt = self.scales.get(name), self.fp8
        if scale is None or fmt is None:
            raise NotConvertible(name)
        view = self._open(self._file_of[name]).get_slice(name)
        shape = view.get_shape()
        ranges = hf_fp8.slice_ranges(shape, slices)
        if self._what == "weight":
            return view[tuple(slice(a, b) for a, b in ranges)]
        out = [slice(a, b) for a, b in ranges[:-2]]
        blocks = (fmt.block_rows, fmt.block_cols)
        for (a, b), n, block in zip(ranges[-2:], shape[-2:], blocks, strict=True):
            if a % block or (b % block and b != n):
                raise NotConvertible(name)
            out.append(slice(a // block, math.ceil(b / block)))
        return self._open(self._file_of[scale]).get_slice(scale)[tuple(out)]


def _fp8_forward_impl(module, path: str, input, weight, bias=None, **_unused):
    # megatron's _forward_impl contract: this rank's matmul only; its TP communication
    # (copy to the region before, all-reduce after) stays in the module's forward.
    y = fp8_gemm.fp8_block_linear(
        input,
        weight,
        module.weight_scale_inv,
        out_dtype=input.dtype,
        path=path,
        block=module.fp8_block,
    )
    return y if bias is None else y + bias


def attach_fp8_linears(
    model: torch.nn.Module, ckpt: HfCheckpoint, readers: dict, *, path: str = "auto"
) -> list[str]:
    """Give every convertible linear of `model` its FP8 shard and scales from `ckpt` (via
    `readers`, `hf.hf_shard_readers`' map) and the FP8 forward (`path`: `fp8_gemm`'s).
    Returns the names of the parameters now held in FP8 (load nothing else into them)."""
    fmt = ckpt.fp8
    if fmt is None:
        return []
    modules = dict(model.named_modules())
    stored, scales = StoredView(ckpt, "weight"), StoredView(ckpt, "scale")
    converted = []
    for name, read in readers.items():
        module = modules.get(name.removesuffix(".weight"))
        if not name.endswith(".weight") or not isinstance(
            module, (ColumnParallelLinear, RowParallelLinear)
        ):
            continue
        if module.weight.shape[1] % fp8_gemm.GROUP:
            continue  # activations are quantized in 128-channel groups
        try:
            weight, scale = read(stored), read(scales)
        except NotConvertible:
            continue
        n, k = module.weight.shape
        if tuple(weight.shape) != (n, k) or tuple(scale.shape) != hf_fp8.scale_shape((n, k), fmt):
            continue  # the readers padded or reshaped it (not a plain linear shard)
        make_fp8_linear(module, weight, scale, (fmt.block_rows, fmt.block_cols), path=path)
        converted.append(name)
    return converted


def make_fp8_linear(
    module: ColumnParallelLinear | RowParallelLinear,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    *,
    path: str = "auto",
) -> None:
    """Hold `weight` (float8_e4m3fn, this rank's [N, K] shard) and its block scales in the
    module, and multiply through the FP8 GEMM from now on. A module already in FP8 with the
    same shapes and block gets the new values copied into its tensors (a weight update in
    place: CUDA graphs recorded on those tensors stay valid)."""
    device = module.weight.device
    held = getattr(module, "weight_scale_inv", None)
    if (
        held is not None
        and getattr(module, "fp8_block", None) == block
        and module.weight.dtype == weight.dtype
        and module.weight.shape == weight.shape
        and held.shape == scale_inv.shape
    ):
        with torch.no_grad():
            module.weight.copy_(weight)
            held.copy_(scale_inv)
        return
    module.weight = torch.nn.Parameter(weight.to(device), requires_grad=False)
    module.register_buffer("weight_scale_inv", scale_inv.to(device, torch.float32))
    module.fp8_block = block
    module._forward_impl = functools.partial(_fp8_forward_impl, module, path)
