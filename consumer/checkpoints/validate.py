"""Checks shared by every checkpoint format: the error type, parallel sizes, tensor inventories.

Format-specific checks (what a Hugging Face config may contain, where a Megatron checkpoint
lies) live next to their loaders; this module holds what they have in common, so that every
refusal reaches the operator as one `CheckpointError` that names each problem it found.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from consumer.forward.spec import ModelSpec
from shared.errors import InvalidCheckpoint

# Long inventories are cut here: the first few problems tell the operator what is wrong, and
# a full list of a 1000-tensor mismatch helps nobody.
MAX_LISTED_PROBLEMS = 20


class CheckpointError(InvalidCheckpoint):
    """A checkpoint cannot be served as it is; the message names every problem found."""


def parallel_problems(spec: ModelSpec, tp: int, ep: int = 1) -> list[str]:
    """Why `spec` cannot be split over `tp` tensor-parallel ranks and `ep` expert-parallel ones
    (empty when it can)."""
    if tp < 1:
        return [f"tensor-parallel size must be >= 1, got {tp}"]
    if ep < 1:
        return [f"expert-parallel size must be >= 1, got ep={ep}"]
    problems = moe_problems(spec, tp, ep)
    heads, kv = spec.num_attention_heads, spec.num_kv_heads
    if heads % tp:
        what = "latent attention splits whole heads" if spec.is_mla else "whole heads per rank"
        problems.append(f"num_attention_heads={heads} is not divisible by tp={tp} ({what})")
    if spec.rotary_dim % 2 or spec.rotary_dim < 2:
        problems.append(
            f"rotary dims {spec.rotary_dim} (head_dim x partial_rotary_factor) must be even"
        )
    if spec.is_mla:
        pass  # latent attention: each head's keys come from the latent, no KV heads to split
    elif kv < tp:
        # megatron-core would replicate each KV head over tp/kv ranks, gathering the whole fused
        # QKV output on every rank; that path allocates on CUDA unconditionally (so it cannot
        # run, or be tested, on the CPU) and costs a gather per layer: refuse it.
        problems.append(
            f"num_key_value_heads={kv} is smaller than tp={tp}; KV-head replication is not "
            f"supported, use tp <= {kv} (a divisor of {kv})"
        )
    elif kv % tp:
        problems.append(f"num_key_value_heads={kv} is not divisible by tp={tp}")
    dense_layers = not spec.is_moe or bool(spec.moe_dense_layers)
    if dense_layers and spec.ffn_hidden_size % tp:
        problems.append(
            f"intermediate (ffn) size {spec.ffn_hidden_size} is not divisible by tp={tp}"
        )
    padded = spec.padded_vocab_size(tp)
    if padded % tp:
        problems.append(f"padded vocabulary {padded} is not divisible by tp={tp}")
    return problems


def moe_problems(spec: ModelSpec, tp: int, ep: int) -> list[str]:
    """Why the experts of `spec` cannot be laid out at `tp` x `ep` (a replica of max(tp, ep)
    ranks, experts split ep ways, each expert's FFN max(tp, ep) / ep ways)."""
    if not spec.is_moe:
        if ep > 1:
            return [f"parallel.ep={ep} needs a mixture-of-experts model; this one is dense"]
        return []
    problems = []
    if max(tp, ep) % min(tp, ep):
        problems.append(f"ep={ep} and tp={tp}: the smaller must divide the larger")
        return problems
    width = max(tp, ep)
    etp = width // ep
    if spec.num_experts % ep:
        problems.append(f"num_experts={spec.num_experts} is not divisible by ep={ep}")
    if spec.moe_ffn_hidden_size % etp:
        problems.append(
            f"expert FFN size (moe_intermediate_size) {spec.moe_ffn_hidden_size} is not "
            f"divisible by the expert tensor-parallel size max(tp, ep) / ep = {etp}"
        )
    if not 1 <= spec.moe_top_k <= spec.num_experts:
        problems.append(
            f"router top-k num_experts_per_tok={spec.moe_top_k} must be in 1..num_experts="
            f"{spec.num_experts}"
        )
    shared = spec.moe_shared_ffn_hidden_size
    if shared % width:
        family = spec.family_record
        field = (
            f"n_shared_experts x moe_intermediate_size = {shared}"
            if family is not None and family.shared_expert == "plain"
            else f"shared_expert_intermediate_size={shared}"
        )
        problems.append(f"{field} is not divisible by the replica's max(tp, ep) = {width} ranks")
    return problems


def check_parallel(spec: ModelSpec, tp: int, *, ep: int = 1) -> None:
    """Raise `CheckpointError` unless `spec` splits evenly over `tp` tensor-parallel ranks
    (and its experts over `ep` expert-parallel ones)."""
    problems = parallel_problems(spec, tp, ep)
    if problems:
        where = f"tp={tp}" if ep == 1 else f"tp={tp} x ep={ep}"
        raise CheckpointError(f"model cannot be split over {where}: " + "; ".join(problems))


def inventory_problems(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    *,
    ignorable: Iterable[str] = (),
) -> list[str]:
    """Every difference between the tensors a model needs and those a checkpoint holds.

    `ignorable` names tensors a checkpoint may carry without harm (e.g. a tied lm_head copy);
    they are neither required nor reported as unexpected.
    """
    skip = set(ignorable)
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"missing: {name} (expected {_fmt(shape)})")
        elif tuple(found[name]) != tuple(shape):
            problems.append(f"{name}: expected {_fmt(shape)}, found {_fmt(found[name])}")
    for name in found:
        if name not in expected and name not in skip:
            problems.append(f"unexpected: {name} {_fmt(found[name])}")
    return problems


def raise_problems(headline: str, problems: list[str]) -> None:
    """Raise one `CheckpointError` listing `problems` under `headline` (no-op when empty)."""
    if not problems:
        return
    listed = problems[:MAX_LISTED_PROBLEMS]
    more = len(problems) - len(listed)
    tail = f"\n  ... and {more} more" if more else ""
    raise CheckpointError(
        f"{headline} ({len(problems)} problems):\n  " + "\n  ".join(listed) + tail
    )


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"
