"""The experts through quack-kernels' two GEMMs and the combine kernel (#50), on an sm90 GPU
where quack-kernels is installed (the `hopper` extra); skipped elsewhere.

`moe_gemm.routed_combined` must give each token's weighted sum over its k choices as close
to a float32 loop written here as the Triton path's scatter and sum is, with gate/up through
quack or through our Triton kernel (it depends on the width), at awkward shapes:
an expert with no tokens, one token, top-1, 256 experts, widths that are not a multiple of
the tiles, choices that went to another rank's experts. And what the precompile workers
compile for quack must be what the probe and the experts then load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from consumer.forward import moe_gemm, quack_gemm  # noqa: E402
from tests.gpu.test_expert_gemm import SHAPES  # noqa: E402  (the Triton kernels' awkward shapes)

CUDA = torch.device("cuda")

if not quack_gemm.available(CUDA, torch.bfloat16, 256):
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


ROOT = Path(__file__).resolve().parents[2]

PRECOMPILE = """
import sys, torch
from consumer.forward import quack_gemm
for params in quack_gemm.precompile_plan(int(sys.argv[1])):
    quack_gemm.precompile(**params, dtype=torch.bfloat16)
from cuda.bindings import driver  # (the CuTe DSL's dependency)
driver.cuInit(0)
_, device = driver.cuDeviceGet(0)
_, _, active = driver.cuDevicePrimaryCtxGetState(device)
print("context", int(active))
"""

SERVE = """
import sys, torch
from quack.gemm import _compile_gemm
from quack.gemm_runtime.host import _compile_gemm_epi
from consumer.forward import quack_gemm
cuda, hidden = torch.device("cuda"), int(sys.argv[1])
assert quack_gemm.available(cuda, torch.bfloat16, hidden)  # the probe's two GEMMs
x = torch.randn(24, hidden, device=cuda).bfloat16()
fc1 = (torch.randn(4, 2 * 128, hidden, device=cuda) / 64).bfloat16()
fc2 = (torch.randn(4, hidden, 128, device=cuda) / 16).bfloat16()
starts = quack_gemm.offsets(torch.tensor([10, 0, 30, 8], device=cuda))
tokens = torch.randint(0, 24, (48,), device=cuda)
y = quack_gemm.down(quack_gemm.gate_up(x, tokens, fc1, starts), fc2, starts)
assert torch.isfinite(y.float()).all()
torch.cuda.synchronize()
print("compiled", _compile_gemm.cache_info().misses + _compile_gemm_epi.cache_info().misses)
"""


@pytest.mark.parametrize("hidden", [7168, 4096])
def test_precompiled_gemms_are_the_ones_the_probe_and_experts_load(tmp_path, hidden):
    """A precompile worker's compiles for DeepSeek-V3's width, and for GLM-4.5-Air's (down on
    quack's default tile there), on meta tensors, stopped where quack would compile
    (`quack_gemm.precompile`), are what `available`'s probe and the experts' GEMMs then load,
    in another process: they compile nothing more and add no kernel file. The worker leaves
    the device without a CUDA context."""
    env = {**os.environ, "QUACK_CACHE_DIR": str(tmp_path)}
    for name in ("QUACK_ARCH", "CUTE_DSL_ARCH"):
        env.pop(name, None)

    def run(script: str) -> str:
        done = subprocess.run([sys.executable, "-c", script, str(hidden)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-1]

    context = run(PRECOMPILE)
    made = sorted(tmp_path.rglob("*.o"))
    assert len(made) == len(quack_gemm.precompile_plan(hidden)) == 2
    assert run(SERVE) == "0"
    assert sorted(tmp_path.rglob("*.o")) == made
    assert context == "0", "the precompile worker created a CUDA context"


PRELOAD = """
import dataclasses, sys, torch
from consumer.forward import quack_gemm
from consumer.forward.model import build_model
from consumer.forward.spec import TINY
from consumer.parallel import init_parallel
assert "quack.gemm_interface" not in sys.modules
spec = dataclasses.replace(TINY, family="qwen3_moe", hidden_size=128, num_experts=4,
                           moe_top_k=2, moe_ffn_hidden_size=64)
build_model(spec, init_parallel(tp=1, pp=1), params_dtype=torch.bfloat16,
            device=torch.device("cuda"), init_weights=False)
assert quack_gemm.preload.cache_info().currsize == 1, "the build started no import"
thread = quack_gemm.preload(torch.device("cuda"))  # the build's own thread
assert thread is not None
thread.join(240)
print("imported", int("quack.gemm_interface" in sys.modules))
"""


def test_a_bf16_moe_build_imports_quack_while_the_weights_load():
    """Building a bf16 MoE teacher on the device starts quack's import on a thread (so that
    the warm-up's first forward does not wait for it), once per process."""
    done = subprocess.run([sys.executable, "-c", PRELOAD], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1"
