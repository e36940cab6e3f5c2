"""The arguments of a head call (`HeadCall`), checked on the host before any collective
starts.

Shape legend (suffixes on tensor names):
    T  rows (scored positions) of the batch
    W  target ids per row (may be 0)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from consumer.head_common import SENTINEL_ID, VocabShard
from consumer.tp_ops.layout import HeadCall

__all__ = ["check_inputs", "group_layout"]


def group_layout(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) of this process in `tp_group`; (0, 1) for None (TP = 1)."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def check_inputs(call: HeadCall, *, rows: int, width: int, device: torch.device) -> tuple[int, int]:
    """Raise ValueError naming the first field of `call` that is inconsistent with the others
    or with the logits (`rows` x `width` on `device`); see `HeadCall` for what each must be.
    Returns this rank's (rank, size) in the call's group."""
    rank, tp_size = group_layout(call.tp_group)
    _check_shard(call.shard, width=width, rank=rank, tp_size=tp_size)
    _check_counts(call)
    _check_inv_temperature(call.inv_temperature_T, rows=rows, device=device)
    if call.target_ids_TW is not None:
        _check_targets(call.target_ids_TW, rows=rows, device=device, vocab=call.shard.vocab_size)
    if call.sample_n:
        for name, ten in (("seed_T", call.seed_T), ("position_T", call.position_T)):
            if ten is None:
                raise ValueError(f"{name} is required when sample_n > 0")
            if ten.dtype != torch.int64 or tuple(ten.shape) != (rows,):
                raise ValueError(
                    f"{name} must be an int64 tensor of shape [{rows}], got {ten.dtype} "
                    f"{tuple(ten.shape)}"
                )
            _check_device(name, ten, device)
    return rank, tp_size


def _check_shard(shard: VocabShard, *, width: int, rank: int, tp_size: int) -> None:
    if width != shard.size:
        raise ValueError(f"logits width {width} != shard.size {shard.size}")
    if shard.start != rank * shard.size or shard.vocab_size > shard.size * tp_size:
        raise ValueError(
            f"{shard} is not the shard of TP rank {rank} of {tp_size}: shards must be equal "
            "contiguous slices in rank order (build them with vocab_shard)"
        )
    if shard.size * tp_size >= SENTINEL_ID:
        raise ValueError("padded vocabulary does not fit the 31-bit id exchange")


def _check_counts(call: HeadCall) -> None:
    for name in ("top_k", "sample_n"):
        value = getattr(call, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if name == "top_k" and value > call.shard.vocab_size:
            raise ValueError(f"top_k {value} exceeds the vocabulary size {call.shard.vocab_size}")


def _check_inv_temperature(
    inv_temperature_T: torch.Tensor, *, rows: int, device: torch.device
) -> None:
    if not inv_temperature_T.is_floating_point() or tuple(inv_temperature_T.shape) != (rows,):
        raise ValueError(
            f"inv_temperature_T must be a float tensor of shape [{rows}], got "
            f"{inv_temperature_T.dtype} {tuple(inv_temperature_T.shape)}"
        )
    _check_device("inv_temperature_T", inv_temperature_T, device)
    inv32 = inv_temperature_T.float()
    if rows and not bool((torch.isfinite(inv32) & (inv32 > 0)).all()):
        raise ValueError(
            "inv_temperature_T must hold finite values > 0, i.e. temperatures that are finite "
            "and > 0 (use validate_temperature)"
        )


def _check_targets(
    target_ids_TW: torch.Tensor, *, rows: int, device: torch.device, vocab: int
) -> None:
    if target_ids_TW.dtype != torch.int64 or target_ids_TW.dim() != 2:
        raise ValueError(
            f"target_ids_TW must be an int64 [T, W] tensor, got {target_ids_TW.dtype} "
            f"{tuple(target_ids_TW.shape)}"
        )
    if target_ids_TW.shape[0] != rows:
        raise ValueError(f"target_ids_TW has {target_ids_TW.shape[0]} rows, logits {rows}")
    _check_device("target_ids_TW", target_ids_TW, device)
    if target_ids_TW.numel():
        lo, hi = int(target_ids_TW.min()), int(target_ids_TW.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"target ids must lie in [0, vocab_size={vocab}), got values in [{lo}, {hi}]"
            )


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device and t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}, logits on {device} (or pass it on the CPU)")
