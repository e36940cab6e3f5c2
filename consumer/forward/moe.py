"""The mixture-of-experts FFN of a teacher (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3,
GLM-4.5), in the MLP slot of megatron-core's transformer layer for the sparse layers.

Routing follows the Hugging Face models exactly, as the family table (`shared/families.py`)
names it:

- "softmax" (Qwen-MoE, Mixtral): a softmax over all experts in float32, the top-k,
  renormalised iff the family says so (Mixtral always, Qwen by `norm_topk_prob`), the weights
  cast to the activations' dtype (Mixtral keeps them float32);
- "sigmoid_grouped" (DeepSeekMoE: DeepSeek-V3, GLM-4.5): float32 router on float32 activations
  (on CUDA one bf16 GEMM against three bf16 parts of the weight, accumulated in float32:
  `split_router_logits`), sigmoid scores; the choice adds
  `e_score_correction_bias` to the scores, keeps the `topk_group` groups (of `n_group`) whose
  two best biased scores sum highest and takes the top-k of those groups' experts; the
  weights are the unbiased scores of the chosen experts, renormalised iff `norm_topk_prob`,
  times `routed_scaling_factor`, kept float32.

Every routed token is computed (no capacity, no token dropping) and there is no auxiliary loss:
a teacher scores each token as the reference model does. Qwen2-MoE adds a shared expert whose
output is scaled by sigmoid(shared_expert_gate(x)); DeepSeekMoE adds its shared experts
ungated.

Expert parallelism needs no token exchange: every rank of a replica holds every token of the
batch (the leader broadcasts it, attention outputs are all-reduced), so each rank computes its
own experts — its slice of their FFN when the experts are also tensor-parallel — for the tokens
routed to them, and one all-reduce over the replica sums the partial outputs. The shared
expert's FFN is split over the same ranks and joins that all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist
from torch.nn import functional as F

from consumer.forward.moe_gemm import routed_combined, routed_swiglu, swiglu
from consumer.forward.spec import ModelSpec

log = structlog.get_logger("teacherq.consumer")
_SPLIT_FAILED: list[str] = []  # set where `split_router_logits` raised: float32 from then on

# The names TeacherMoE.sharded_state_dict gives its entries (under the layer's `mlp.`).
CHECKPOINT_ENTRIES = (
    "router.weight",
    "router_bias",
    "experts_fc1",
    "experts_fc2",
    "shared_fc1",
    "shared_fc2",
    "shared_gate",
)


@dataclass(frozen=True)
class ExpertLayout:
    """How a replica's `size` ranks share the experts: `ep` ways by expert, each expert's FFN
    over `size // ep` ranks; `group` (None for one rank) sums the partial outputs."""

    size: int = 1
    rank: int = 0
    ep: int = 1
    group: dist.ProcessGroup | None = None
    replica: int = 0  # the data-parallel replica: only replica 0 saves a checkpoint's tensors

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size: ranks sharing one expert's FFN."""
        return self.size // self.ep

    @property
    def ep_rank(self) -> int:
        """Which block of experts this rank holds."""
        return self.rank // self.etp

    @property
    def etp_rank(self) -> int:
        """Which slice of its experts' FFN this rank holds."""
        return self.rank % self.etp


def float_routing_weights(spec: ModelSpec) -> bool:
    """Whether the routing weights the experts' outputs are scaled by stay float32 (DeepSeekMoE's
    sigmoid routing, Mixtral), else are cast to the activations' dtype (Qwen)."""
    family = spec.family_record
    return family is not None and (
        family.routing == "sigmoid_grouped" or family.float_router_weights
    )


def float_router(spec: ModelSpec) -> bool:
    """Whether the family's reference runs its router in float32 (DeepSeekMoE: float32 copies
    of the activations and a float32 weight), else in the activations' dtype."""
    family = spec.family_record
    return family is not None and family.float_router


def renormalises(spec: ModelSpec) -> bool:
    """Whether the top-k routing weights are renormalised to sum to one."""
    family = spec.family_record
    return spec.moe_norm_topk or (family is not None and family.always_renormalise)


def bf16_parts(weight: torch.Tensor) -> torch.Tensor:
    """[3, *weight.shape] bf16 whose float32 sum is `weight` (float32) exactly: its bf16
    rounding, the rounding of what is left, and the rest (8 + 8 + 8 significant bits of its
    24; each difference is exact in float32)."""
    hi = weight.to(torch.bfloat16)
    rest = weight - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.stack((hi, mid, lo))


def split_router_logits(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """x [T, h] (bf16, CUDA) @ weight^T in float32 from `bf16_parts(weight)` flattened to
    [3E, h]: one bf16 GEMM on the tensor cores, accumulated and returned in float32, where a
    float32 GEMM has none (3.7x faster at DeepSeek-V3's shape on an H200). Each product of
    x's values with a part's is exact in float32; the sums are the tensor cores', which on
    Hopper keep fewer bits than IEEE float32 adds: 5e-5 from float64 on logits of scale 1
    where the float32 GEMM gives 9e-6 (docs/benchmarks.md), far below what one bf16 rounding
    of an input moves a logit by (the bf16-rounded weight alone: 8e-3)."""
    logits = torch.mm(x, parts.T, out_dtype=torch.float32)  # [T, 3E]
    return logits.view(x.shape[0], 3, -1).sum(dim=1)


class TeacherMoE(torch.nn.Module):
    """Router, this rank's experts (their FFN slice) and its slice of the shared expert.

    Parameters: `router.weight` [E, h] (whole on every rank; float32 for DeepSeekMoE, with its
    `router_bias` [E], the e_score_correction_bias), `experts_fc1` [E_local, 2, f_l, h]
    (gate and up of each local expert's slice), `experts_fc2` [E_local, h, f_l], and for a shared
    expert `shared_fc1` [2, s_l, h], `shared_fc2` [h, s_l], and when gated `shared_gate` [1, h]
    (Qwen2-MoE). Each is a block
    of one global tensor ([E, 2, f, h], ...), which is how `sharded_state_dict` describes them to
    megatron's dist checkpointing: a torch_dist checkpoint reloads at any tp x ep.
    """

    def __init__(self, config, spec: ModelSpec, experts: ExpertLayout) -> None:
        super().__init__()
        self.config = config
        self.layout = experts
        family = spec.family_record
        self.top_k = spec.moe_top_k
        self.renormalise = renormalises(spec)
        self.routing = family.routing if family is not None else "softmax"
        self.float_weights = float_routing_weights(spec)
        self.float_router = float_router(spec)
        self.groups, self.topk_groups = spec.moe_groups, spec.moe_topk_groups
        self.routed_scale = spec.moe_routed_scale
        h, dtype = spec.hidden_size, config.params_dtype
        self.num_local = spec.num_experts // experts.ep
        self.first_expert = experts.ep_rank * self.num_local
        f = spec.moe_ffn_hidden_size // experts.etp
        router_dtype = torch.float32 if self.float_router else dtype
        self.router = torch.nn.utils.skip_init(  # initialised below or loaded, not drawn twice
            torch.nn.Linear, h, spec.num_experts, bias=False, dtype=router_dtype
        )
        if self.routing == "sigmoid_grouped":
            bias = torch.empty(spec.num_experts, dtype=torch.float32)
            self.router_bias = torch.nn.Parameter(bias)
        self.experts_fc1 = torch.nn.Parameter(torch.empty(self.num_local, 2, f, h, dtype=dtype))
        self.experts_fc2 = torch.nn.Parameter(torch.empty(self.num_local, h, f, dtype=dtype))
        # FP8 checkpoints: the experts' float32 block scales (fc1's [E_local, 2 f_l/128, h/128],
        # fc2's [E_local, h/128, f_l/128]) when their weights are held in float8_e4m3fn
        self.register_buffer("experts_fc1_scale", None, persistent=False)
        self.register_buffer("experts_fc2_scale", None, persistent=False)
        self.shared = spec.moe_shared_ffn_hidden_size > 0
        self.shared_gated = self.shared and (family is None or family.shared_expert == "gated")
        if self.shared:
            s = spec.moe_shared_ffn_hidden_size // experts.size
            self.shared_fc1 = torch.nn.Parameter(torch.empty(2, s, h, dtype=dtype))
            self.shared_fc2 = torch.nn.Parameter(torch.empty(h, s, dtype=dtype))
        if self.shared_gated:
            self.shared_gate = torch.nn.Parameter(torch.empty(1, h, dtype=dtype))
        std = float(getattr(config, "init_method_std", 0.02))
        if config.perform_initialization:
            with torch.no_grad():
                for p in self.parameters():
                    p.normal_(0.0, std)
        # Else left as allocated: build_model zeroes every parameter of a model it builds for
        # a checkpoint, on the device (zeroing here wrote every expert page on the host first).

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of tokens x [T, h]. The weights are in x's dtype
        (Qwen), or float32 (Mixtral, DeepSeekMoE): each family's reference keeps its own."""
        if self.routing == "sigmoid_grouped":
            return self._route_grouped(x)
        logits = F.linear(x, self.router.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float_weights else weights.to(x.dtype)), ids

    def _float_router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The router's float32 logits, as DeepSeekMoE's reference computes them (float32
        copies of x and the weight); for bf16 x on CUDA through `split_router_logits`. The
        parts are made each call (a few small kernels): a reload, a broadcast or an in-place
        update may write the weight without any trace a cache could check."""
        weight = self.router.weight
        if x.is_cuda and x.dtype == torch.bfloat16 and not _SPLIT_FAILED:
            try:
                return split_router_logits(x, bf16_parts(weight.float()).flatten(0, 1))
            except torch.OutOfMemoryError:
                raise  # the float32 GEMM would need more memory still, and it may pass
            except (RuntimeError, TypeError) as exc:  # a torch without mm's out_dtype
                _SPLIT_FAILED.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                log.warning("moe.router_split_off", error=_SPLIT_FAILED[0])
        return F.linear(x.float(), weight.float())

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self._float_router_logits(x))
        choice = scores + self.router_bias
        if self.topk_groups < self.groups:  # keep the groups whose two best scores sum highest
            by_group = choice.view(x.shape[0], self.groups, -1)
            best = by_group.topk(2, dim=-1).values.sum(dim=-1)
            kept = best.topk(self.topk_groups, dim=-1, sorted=False).indices
            mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
            choice = by_group.masked_fill(~mask[..., None], float("-inf")).flatten(1)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scale, ids

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.layout.ep == 1:
            local = flat
            picks = torch.argsort(flat, stable=True)
        else:
            # only this rank's rows (a host sync for their count): carrying every routed row
            # through the gather and SwiGLU would move ep times the bytes the GEMMs need
            mine = (flat >= self.first_expert) & (flat < self.first_expert + self.num_local)
            where = mine.nonzero().squeeze(1)
            order = torch.argsort(flat[where], stable=True)
            picks = where[order]
            local = flat - self.first_expert
        expert = local[picks]
        # rows per local expert without a host sync (bincount on CUDA reads the ids' max back)
        counts = torch.zeros(self.num_local, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, expert, torch.ones_like(expert))
        tokens = torch.div(picks, self.top_k, rounding_mode="floor")
        fc1 = self.experts_fc1.flatten(1, 2)  # [E_local, 2 f_l, h]: [gate; up] rows
        if self.expert_scale("fc1") is None:
            combined = routed_combined(
                x, tokens, picks, weights.reshape(-1), counts, fc1, self.experts_fc2, self.top_k
            )
            if combined is not None:  # quack's GEMMs and the combine kernel
                return combined
        # each routed row lands at its [token, choice] row, then a sum over each token's k
        # choices: deterministic (an index_add_ of the k rows would race on CUDA atomics)
        full = (
            x.new_zeros(flat.shape[0], x.shape[-1])
            if self.layout.ep > 1
            else x.new_empty(flat.shape[0], x.shape[-1])
        )
        routed_swiglu(
            x,
            tokens,
            picks,
            weights.reshape(-1),
            counts,
            fc1,
            self.experts_fc2,
            full,
            fc1_scale=self.expert_scale("fc1"),
            fc2_scale=self.expert_scale("fc2"),
        )
        return full.view(x.shape[0], self.top_k, x.shape[-1]).sum(dim=1)

    def expert_scale(self, which: str) -> torch.Tensor | None:
        """The block scales of the experts' `which` ("fc1", "fc2") weights when they are held
        in FP8, else None."""
        scale = getattr(self, f"experts_{which}_scale")
        return scale if isinstance(scale, torch.Tensor) else None

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):  # megatron's MLP call
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        out = self._routed(x, weights, ids)
        if self.shared:
            up = F.linear(x, self.shared_fc1.flatten(0, 1))
            if self.shared_gated:
                shared = F.linear(swiglu(up), self.shared_fc2)
                out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            else:  # added to the routed sum by the GEMM itself, not in a pass of its own
                out.addmm_(swiglu(up), self.shared_fc2.T)
        if self.layout.group is not None:
            dist.all_reduce(out, group=self.layout.group)
        return out.reshape(shape), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron dist-checkpointing entries: each parameter as this rank's block of its global
        tensor; whole copies (router, shared gate) are saved by one rank of one replica."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        lay = self.layout
        prepend = len(sharded_offsets)  # axes megatron stacks layers on, if it does
        by_expert = (0, lay.ep_rank, lay.ep)
        out = {}

        def add(name: str, tensor: torch.Tensor, *offsets, copy: bool = False) -> None:
            mine = [(axis + prepend, rank, parts) for axis, rank, parts in offsets]
            out[prefix + name] = ShardedTensor.from_rank_offsets(
                prefix + name,
                tensor,
                *sharded_offsets,
                *mine,
                replica_id=(0, lay.rank if copy else 0, lay.replica),
                prepend_axis_num=prepend,
            )

        add("router.weight", self.router.weight, copy=True)
        if self.routing == "sigmoid_grouped":
            add("router_bias", self.router_bias, copy=True)
        add("experts_fc1", self.experts_fc1, by_expert, (2, lay.etp_rank, lay.etp))
        add("experts_fc2", self.experts_fc2, by_expert, (2, lay.etp_rank, lay.etp))
        if self.shared:
            add("shared_fc1", self.shared_fc1, (1, lay.rank, lay.size))
            add("shared_fc2", self.shared_fc2, (1, lay.rank, lay.size))
        if self.shared_gated:
            add("shared_gate", self.shared_gate, copy=True)
        return out
