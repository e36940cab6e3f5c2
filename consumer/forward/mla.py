"""Multi-head latent attention (DeepSeek-V3), in the self-attention slot of megatron's layer.

Per token x [h], with H heads of q/k dims nope + rope and value dims v:

- q = q_up(rms_norm(q_down(x))) [H, nope + rope] (or q_proj(x) without a q LoRA rank);
- one latent c, k_pe = kv_down(x) [kv_lora_rank], [rope]; k_nope, v = kv_up(rms_norm(c))
  [H, nope], [H, v]: the rotated key part k_pe is one head shared by all heads;
- the rotated dims of q and k_pe turn by the token's position (YaRN-scaled angles and the
  `mscale` factor on cos and sin where the config scales its RoPE), and the softmax scale is
  (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN.

DeepSeek checkpoints store the rotated dims as interleaved pairs (`rope_interleave`); they are
de-interleaved here (evens, then odds) and then rotated in the rotate-half layout, which is what
transformers computes. Queries and keys enter core attention as [rope dims | nope dims] (the
order of dims inside a head does not change q . k), so `SdpaCoreAttention` rotates the first
`rope` dims from the packed batch's own position tables and runs the same packed varlen path as
every other family; values are zero-padded to the q/k head size for it and cut back after. On
CUDA one kernel (consumer/kernels/mla_rope.py) does the de-interleave, the rotation, the
concatenations and the padding in one pass, and attention runs on its output directly.

Tensor parallelism splits the heads as megatron does: q_up / q_proj and kv_up by rows (whole
heads), the output projection by columns, and one all-reduce over the TP group sums the partial
outputs; the down-projections and latent norms are whole on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from consumer import kernels
from consumer.forward.attention import SdpaCoreAttention, TreeBounds
from consumer.forward.spec import ModelSpec

# transformers builds the latent norms (q_a_layernorm, kv_a_layernorm) with its RMSNorm's
# default epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class HeadSplit:
    """How a TP group shares the heads: `tp` ranks, this one `rank`, `group` (None for one)."""

    tp: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rot / 2] fp32, the factor cos and sin are multiplied by) of the
    spec's rotary dims: plain RoPE, or YaRN (frequencies blended between the original and the
    interpolated ones over the dims between beta_fast and beta_slow rotations)."""
    dim, base = spec.rotary_dim, float(spec.rope_theta)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos_freqs = base**exponents
    scaling = spec.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0 / pos_freqs, 1.0
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention = scaling.get("attention_factor")
    if attention is None:
        if mscale and mscale_all:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention = yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_at(rotations: float) -> float:  # the dim that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_at(beta_fast), dim_at(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def rope_table(spec: ModelSpec, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, rot / 2] fp32 of positions 0 .. positions - 1, scaled by the
    YaRN attention factor where there is one (what `TeacherGPTModel.rope_tables` serves)."""
    inv_freq, factor = rope_inv_freq(spec)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos() * factor, angles.sin() * factor


def softmax_scale(spec: ModelSpec) -> float:
    """The attention logits' scale: (q/k head dim)^-0.5, times mscale(factor,
    mscale_all_dim)^2 when the RoPE is scaled and the config sets mscale_all_dim."""
    scale = spec.kv_channels**-0.5
    scaling = spec.rope_scaling or {}
    if scaling.get("rope_type") not in (None, "default") and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (a0 b0 a1 b1 ...)] -> [..., (a0 a1 ... b0 b1 ...)]."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class TeacherMLA(nn.Module):
    """Latent attention of one layer, this rank's heads. Parameters (megatron's MLA names):
    `linear_q_down_proj` [q_lora, h], `q_layernorm` [q_lora], `linear_q_up_proj`
    [H_local (nope + rope), q_lora] (or `linear_q_proj` [H_local (nope + rope), h]),
    `linear_kv_down_proj` [kv_lora + rope, h], `kv_layernorm` [kv_lora], `linear_kv_up_proj`
    [H_local (nope + v), kv_lora], `linear_proj` [h, H_local v]."""

    def __init__(
        self, config, layer_number: int = 1, *, spec: ModelSpec, heads: HeadSplit, **_unused
    ) -> None:  # megatron's builder passes config and layer_number
        super().__init__()
        self.config = config
        self.split = heads
        self.heads = spec.num_attention_heads // heads.tp
        self.nope, self.rope, self.v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.interleaved = spec.rope_interleave
        h, dtype, qk = spec.hidden_size, config.params_dtype, spec.kv_channels

        def linear(n_in: int, n_out: int) -> nn.Linear:
            # no init of its own: torch's default draw (0.9 s a DeepSeek-V3 layer on this
            # 2-core host) would be overwritten below or by the checkpoint
            return nn.utils.skip_init(nn.Linear, n_in, n_out, bias=False, dtype=dtype)

        self.q_lora = spec.q_lora_rank > 0
        if self.q_lora:
            self.linear_q_down_proj = linear(h, spec.q_lora_rank)
            self.q_layernorm = nn.RMSNorm(spec.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
            self.linear_q_up_proj = linear(spec.q_lora_rank, self.heads * qk)
        else:
            self.linear_q_proj = linear(h, self.heads * qk)
        self.kv_lora = spec.kv_lora_rank
        self.linear_kv_down_proj = linear(h, spec.kv_lora_rank + self.rope)
        self.kv_layernorm = nn.RMSNorm(spec.kv_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
        self.linear_kv_up_proj = linear(spec.kv_lora_rank, self.heads * (self.nope + self.v))
        self.linear_proj = linear(self.heads * self.v, h)
        self.core_attention = SdpaCoreAttention(
            config=config, softmax_scale=softmax_scale(spec), value_dim=self.v
        )
        std = float(getattr(config, "init_method_std", 0.02))
        if config.perform_initialization:
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if "layernorm" in name:
                        p.fill_(1.0)
                    else:
                        p.normal_(0.0, std)
        # Else left as allocated: build_model zeroes every parameter of a model it builds for
        # a checkpoint, where the model is placed (zeroing here wrote every page on the host).

    def forward(self, hidden_states: torch.Tensor, *args, packed_seq_params=None, **kwargs):
        """megatron's attention call: hidden states [t, 1, h] of a packed batch -> ([t, 1, h],
        None)."""
        if not isinstance(packed_seq_params, TreeBounds):
            raise ValueError("latent attention runs on packed batches (TreeBounds) only")
        x = hidden_states.squeeze(1)
        t, heads = x.shape[0], self.heads
        if self.q_lora:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        else:
            q = self.linear_q_proj(x)
        q_nope, q_pe = q.view(t, heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_pe = self.linear_kv_down_proj(x).split([self.kv_lora, self.rope], -1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent)).view(t, heads, self.nope + self.v)
        fused = kernels.load(x.device)
        rope = packed_seq_params.rope
        if fused is not None and rope is not None and self.v <= self.nope + self.rope:
            # rotated, concatenated and padded for the flash kernel in one pass
            query, key, value = fused.mla_qkv(
                q.view(t, heads, self.nope + self.rope), kv, k_pe, *rope,
                nope=self.nope, interleaved=self.interleaved,
            )  # fmt: skip
            out = self.core_attention.attend_rotated(query, key, value, packed_seq_params)
            return self._project(out, t)
        k_nope, value = kv.split([self.nope, self.v], -1)
        if self.interleaved:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        query = torch.cat((q_pe, q_nope), dim=-1)
        key = torch.cat((k_pe[:, None, :].expand(t, heads, self.rope), k_nope), dim=-1)
        pad = query.shape[-1] - self.v
        if pad > 0:  # one head size for q, k and v: the varlen kernel takes no other
            value = F.pad(value, (0, pad))
        out = self.core_attention(query, key, value, None, packed_seq_params=packed_seq_params)
        return self._project(out, t)

    def _project(self, out: torch.Tensor, t: int):
        """The output projection of attention's [t, heads x padded head] output (the value
        dims of each head), summed over the TP group: megatron's ([t, 1, h], None)."""
        out = out.view(t, self.heads, -1)[..., : self.v].reshape(t, self.heads * self.v)
        out = self.linear_proj(out)
        if self.split.group is not None:
            dist.all_reduce(out, group=self.split.group)
        return out[:, None, :], None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron dist-checkpointing entries: the head-split projections as this rank's block
        of their global tensor, the down-projections and latent norms as replicated copies."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        split_axes = {
            "linear_q_up_proj.weight": 0,
            "linear_q_proj.weight": 0,
            "linear_kv_up_proj.weight": 0,
            "linear_proj.weight": 1,
        }
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, split_axes, sharded_offsets)
