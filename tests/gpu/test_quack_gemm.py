"""The experts through quack-kernels' two GEMMs and the combine kernel (#50), on an sm90 GPU
where quack-kernels is installed (the `hopper` extra); skipped elsewhere.

`moe_gemm.routed_combined` must give each token's weighted sum over its k choices as close
to a float32 loop written here as the Triton path's scatter and sum is, with gate/up through
quack or through our Triton kernel (it depends on the width), at awkward shapes:
an expert with no tokens, one token, top-1, 256 experts, widths that are not a multiple of
the tiles, choices that went to another rank's experts.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from consumer.forward import moe_gemm, quack_gemm  # noqa: E402
from tests.gpu.test_expert_gemm import SHAPES  # noqa: E402  (the Triton kernels' awkward shapes)

CUDA = torch.device("cuda")

if not quack_gemm.available(CUDA, torch.bfloat16):
    pytest.skip("needs quack-kernels on an sm90 device", allow_module_level=True)


def _case(tokens, k, hidden, ffn, experts, empty, seed):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=CUDA, generator=gen).bfloat16()
    fc1 = (torch.randn(experts, 2 * ffn, hidden, device=CUDA, generator=gen) / 16).bfloat16()
    fc2 = (torch.randn(experts, hidden, ffn, device=CUDA, generator=gen) / 16).bfloat16()
    allowed = torch.tensor([e for e in range(experts) if e not in empty], device=CUDA)
    scores = torch.rand(tokens, allowed.numel(), device=CUDA, generator=gen)
    ids = allowed[scores.topk(min(k, allowed.numel()), dim=-1).indices]
    weights = torch.rand(ids.numel(), device=CUDA, generator=gen)
    return x, fc1, fc2, ids, weights


def _reference(x, fc1, fc2, ids, weights, local):
    """float32, one (token, choice) at a time per expert; choices outside `local` add 0."""
    k = ids.shape[1]
    out = torch.zeros(x.shape[0], fc2.shape[1], device=CUDA)
    for e in local:
        token, choice = (ids == e).nonzero(as_tuple=True)
        h = x[token].float() @ fc1[e].float().T
        gate, up = h.chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ fc2[e].float().T
        out.index_add_(0, token, y * weights[token * k + choice, None])
    return out


def _sorted(ids, local):
    flat = ids.reshape(-1)
    mine = torch.isin(flat, local).nonzero().squeeze(1)
    picks = mine[torch.argsort(flat[mine], stable=True)]
    counts = torch.bincount(flat[picks], minlength=int(local.max()) + 1)
    return picks, counts


@pytest.fixture(params=["quack", "triton"])
def gate_up(request, monkeypatch):
    """Every case with gate/up through quack (rows gathered first), then through our Triton
    kernel, whatever width `quack_gemm.UP_MIN_HIDDEN` names now."""
    monkeypatch.setattr(quack_gemm, "UP_MIN_HIDDEN", 0 if request.param == "quack" else 1 << 30)
    return request.param


@pytest.mark.parametrize("tokens,k,hidden,ffn,experts,empty", SHAPES)
def test_combined_is_as_close_to_float32_as_the_scatter_and_sum(
    tokens, k, hidden, ffn, experts, empty, gate_up
):
    x, fc1, fc2, ids, weights = _case(tokens, k, hidden, ffn, experts, empty, tokens + hidden)
    k = ids.shape[1]
    local = torch.arange(experts, device=CUDA)
    picks, counts = _sorted(ids, local)
    tokens_of = picks // k
    got = moe_gemm.routed_combined(x, tokens_of, picks, weights, counts, fc1, fc2, k)
    assert got is not None and got.shape == (tokens, hidden) and got.dtype == x.dtype
    full = torch.empty(tokens * k, hidden, device=CUDA, dtype=x.dtype)
    moe_gemm.routed_swiglu(x, tokens_of, picks, weights, counts, fc1, fc2, full, path="triton")
    triton = full.view(tokens, k, hidden).sum(1)
    want = _reference(x, fc1, fc2, ids, weights, range(experts))
    err, err_triton = ((t.float() - want).abs().max().item() for t in (got, triton))
    assert err <= 1.5 * err_triton + 1e-3 * want.abs().max().item(), (err, err_triton)


def test_choices_served_elsewhere_add_nothing(gate_up):
    """Expert parallelism: this rank holds experts 0-7 of 16; a token's choices of the others
    are absent from the rows, and its sum holds only its local choices."""
    x, fc1, fc2, ids, weights = _case(300, 4, 512, 256, 16, (), 7)
    local = torch.arange(8, device=CUDA)
    picks, counts = _sorted(ids, local)
    got = moe_gemm.routed_combined(x, picks // 4, picks, weights, counts, fc1[:8], fc2[:8], 4)
    want = _reference(x, fc1, fc2, ids, weights, range(8))
    scale = want.abs().max().item()
    assert got is not None and (got.float() - want).abs().max().item() <= 2e-2 * scale


def test_not_taken_for_widths_tma_cannot_step():
    """A width that is not a whole 16 bytes (hidden 100 in bf16) takes the Triton path."""
    x, fc1, fc2, ids, weights = _case(10, 2, 100, 64, 4, (), 3)
    picks, counts = _sorted(ids, torch.arange(4, device=CUDA))
    assert moe_gemm.routed_combined(x, picks // 2, picks, weights, counts, fc1, fc2, 2) is None
