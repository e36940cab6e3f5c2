"""The one place where teacherq adapts megatron-core to a machine without CUDA.

megatron-core assumes a CUDA device in a few spots that a prefill-only teacher never needs on
the CPU. `apply()` patches exactly those spots, and only when CUDA is absent, so GPU runs use
megatron-core untouched. Every patch names the upstream function it replaces and why.
"""

from __future__ import annotations

import torch

_applied = False


def apply() -> bool:
    """Patch megatron-core for CPU-only runs; a no-op with CUDA. Returns True if patched."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    _patch_rotary_embedding()
    _patch_rng_tracker()
    _patch_fp32_optimizer_step()
    _applied = True
    return True


def _patch_rotary_embedding() -> None:
    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() on first use
    # (megatron/core/models/common/embeddings/rotary_pos_embedding.py); on CPU it stays put.
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )
        return emb[:, None, None, :]

    rope.RotaryEmbedding.get_emb = get_emb


def _patch_rng_tracker() -> None:
    # megatron's CudaRNGStatesTracker.fork() swaps CUDA RNG states around dropout; on CPU there
    # are none, and a teacher runs in eval mode with no dropout, so forking is a no-op.
    import contextlib

    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        yield

    mrandom.CudaRNGStatesTracker.fork = fork


def _patch_fp32_optimizer_step() -> None:
    # A trainer's megatron optimizer (get_megatron_optimizer -> ChainedOptimizer around an
    # FP32Optimizer) touches CUDA in three spots on the fp32 path; on CPU each runs on the host:
    # - FP32Optimizer.__init__ keeps its unit loss scale in torch.tensor(..., device='cuda');
    # - get_grad_norm_fp32 (clip_grads.py), called by every ChainedOptimizer.step, makes its
    #   overflow buffer and norm on 'cuda';
    # - clip_grad_by_total_norm_fp32 (clip_grads.py) asserts torch.cuda.FloatTensor grads and
    #   scales them with a 'cuda' overflow buffer.
    # optimizer.py and layer_wise_optimizer.py import the two functions by name, so their module
    # globals are replaced too. fp16/bf16 (Float16OptimizerWithFloat16Params) stay CUDA-only.
    from megatron.core.optimizer import clip_grads, layer_wise_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    moptimizer.FP32Optimizer.__init__ = _fp32_optimizer_init
    for module in (clip_grads, moptimizer, layer_wise_optimizer):
        module.get_grad_norm_fp32 = _get_grad_norm_fp32
    for module in (clip_grads, moptimizer):
        module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32


def _fp32_optimizer_init(self, optimizer, config, init_state_fn) -> None:
    """FP32Optimizer.__init__ with its unit loss scale on the host."""
    from megatron.core.optimizer import optimizer as moptimizer

    if moptimizer.has_config_logger_enabled(config):
        moptimizer.log_config_to_disk(config, locals(), prefix=type(self).__name__)
    moptimizer.MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
    self._scale = torch.ones(1, dtype=torch.float)
    self.is_stub_optimizer = optimizer is None


def _get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """clip_grads.get_grad_norm_fp32 with its buffers on the host."""
    import math

    import torch.distributed as dist
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    dp_group = None
    for grad in grads_for_norm:
        dp_group = get_data_parallel_group_if_dtensor(grad, dp_group)
    grads = [to_local_if_dtensor(grad).detach().float() for grad in grads_for_norm]
    norm_type = float(norm_type)
    total = torch.zeros(1, dtype=torch.float)
    if norm_type == math.inf:
        op = dist.ReduceOp.MAX
        for grad in grads:
            total = torch.maximum(total, grad.abs().max())
    else:
        op = dist.ReduceOp.SUM
        for grad in grads:
            total += torch.linalg.vector_norm(grad, norm_type) ** norm_type
    if dp_group is not None:
        dist.all_reduce(total, op=op, group=dp_group)
    dist.all_reduce(total, op=op, group=grad_stats_parallel_group)
    if norm_type == math.inf:
        return total.item()
    return total.item() ** (1.0 / norm_type)


def _clip_grad_by_total_norm_fp32(
    parameters, max_norm, total_norm, use_decoupled_grad: bool = False
) -> None:
    """clip_grads.clip_grad_by_total_norm_fp32 for host tensors."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    grad_attr = "decoupled_grad" if use_decoupled_grad else "grad"
    for param in parameters:
        grad = getattr(param, grad_attr, None)
        if grad is not None:
            to_local_if_dtensor(grad).detach().mul_(clip_coeff)
