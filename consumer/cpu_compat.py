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
    def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):  # noqa: ARG001 - upstream signature
        yield

    mrandom.CudaRNGStatesTracker.fork = fork
