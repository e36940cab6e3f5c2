"""The packed causal attention kernel for latent attention (consumer/kernels/mla_attention.py)
compiled on CUDA, at DeepSeek-V3's shape (128 heads, q/k 192 = 128 + 64 dims, v 128).

- Packs with 1-token documents, a document past 4096 rows and lengths that are no multiple
  of the tiles match SDPA run per document in float32 (math kernel) on the same bf16/fp16
  inputs, and torch's varlen flash attention with v padded to 192 (the path this kernel
  replaces), at 128 heads and at an odd head count.
- Strided q, k, v (views of wider buffers, v of the padded one) give bit for bit the result
  of contiguous copies; float32 inputs (exact IEEE dots) match a float64 reference to 1e-4.
- A pack of more rows than 2**31 / (heads x 192) (int64 offsets) is right at both ends.
- Other tile shapes from the bench's sweep compile and agree (a shape that runs out of
  shared memory on this GPU is skipped).
- `precompile` leaves a later launch of the same variant nothing to compile.
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

from consumer.forward.attention import varlen_attention  # noqa: E402
from consumer.kernels import mla_attention as ma  # noqa: E402

CUDA = torch.device("cuda")
REPO = Path(__file__).resolve().parents[2]
D_QK, D_V = 192, 128


def _inputs(lengths: list[int], heads: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    rows = sum(lengths)
    q, k = (torch.randn(rows, heads, D_QK, generator=gen, device=CUDA).to(dtype) for _ in "qk")
    v = torch.randn(rows, heads, D_V, generator=gen, device=CUDA).to(dtype)
    return q, k, v


def _sdpa_reference(q, k, v, lengths, scale, docs=None) -> dict[int, torch.Tensor]:
    """{document index: float32 output [n, heads, d_v]} from SDPA's math kernel on the same
    inputs widened to float32, one document (and up to 32 heads) at a time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for i in docs if docs is not None else range(len(lengths)):
        s, n = starts[i], lengths[i]
        parts = []
        for h in range(0, q.shape[1], 32):
            qd, kd, vd = (t[s : s + n, h : h + 32].float().transpose(0, 1)[None] for t in (q, k, v))
            with sdpa_kernel(SDPBackend.MATH):
                o = torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, scale=scale
                )
            parts.append(o[0].transpose(0, 1))
        out[i] = torch.cat(parts, dim=1)
    return out


def _flash(q, k, v, lengths, scale) -> torch.Tensor | None:
    """torch's varlen flash attention with v padded to the q/k head size, as the consumer
    runs it today; None where this torch has none."""
    flash = varlen_attention()
    if flash is None:
        return None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    vp = torch.nn.functional.pad(v, (0, q.shape[-1] - v.shape[-1]))
    m = max(lengths)
    return flash(q, k, vp, cu.to(CUDA), cu.to(CUDA), m, m, scale=scale)[..., : v.shape[-1]]


@pytest.mark.parametrize(
    ("heads", "lengths", "dtype"),
    [
        pytest.param(128, [3000, 777, 1, 4100, 1, 513], torch.bfloat16, id="128-heads"),
        pytest.param(5, [1, 4097, 300, 1, 64, 129, 2048], torch.bfloat16, id="5-heads"),
        pytest.param(5, [777, 1, 3000, 1], torch.float16, id="5-heads-fp16"),
    ],
)
def test_matches_sdpa_per_document_and_the_padded_flash_path(heads, lengths, dtype) -> None:
    q, k, v = _inputs(lengths, heads, dtype, seed=heads + len(lengths))
    scale = D_QK**-0.5
    tiles = ma.plan(lengths, ma.HOPPER_CONFIG.block_m).to(CUDA)
    got = ma.mla_attention(q, k, v, tiles, scale=scale)
    assert got.shape == v.shape and got.dtype == dtype
    want = _sdpa_reference(q, k, v, lengths, scale)
    start = 0
    for i, n in enumerate(lengths):
        torch.testing.assert_close(
            got[start : start + n].float(), want[i], atol=1e-2, rtol=1e-2, msg=f"document {i}"
        )
        start += n
    flash = _flash(q, k, v, lengths, scale)
    if flash is not None:
        torch.testing.assert_close(got.float(), flash.float(), atol=2e-2, rtol=2e-2)


def test_strided_views_give_the_result_of_contiguous_copies() -> None:
    lengths, heads = [1, 700, 129, 2000], 5
    rows = sum(lengths)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    wide = torch.randn(rows, heads, 2 * D_QK + 16, generator=gen, device=CUDA).bfloat16()
    q, k = wide[..., 8 : 8 + D_QK], wide[..., D_QK + 16 :]
    v = torch.nn.functional.pad(
        torch.randn(rows, heads, D_V, generator=gen, device=CUDA).bfloat16(), (0, D_QK - D_V)
    )[..., :D_V]  # v padded for the flash path, read at its own width
    tiles = ma.plan(lengths, ma.HOPPER_CONFIG.block_m).to(CUDA)
    got = ma.mla_attention(q, k, v, tiles, scale=0.07)
    want = ma.mla_attention(q.contiguous(), k.contiguous(), v.contiguous(), tiles, scale=0.07)
    assert torch.equal(got, want)
    # heads-major memory, and out written into a view
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    out = torch.full((rows, heads, 2 * D_V), float("nan"), device=CUDA, dtype=torch.bfloat16)
    ma.mla_attention(qt, k, v, tiles, scale=0.07, out=out[..., :D_V])
    assert torch.equal(out[..., :D_V], want) and out[..., D_V:].isnan().all()


def test_float32_inputs_match_a_float64_reference_tightly() -> None:
    lengths, heads = [1, 100, 37, 64], 3
    q, k, v = _inputs(lengths, heads, torch.float32, seed=11)
    scale = D_QK**-0.5
    got = ma.mla_attention(q, k, v, ma.plan(lengths, ma.FP32_CONFIG.block_m).to(CUDA), scale=scale)
    start = 0
    for n in lengths:
        qd, kd, vd = (t[start : start + n].double().transpose(0, 1) for t in (q, k, v))
        scores = (qd @ kd.transpose(1, 2)) * scale
        later = torch.ones(n, n, dtype=torch.bool, device=CUDA).triu(1)
        want = (scores.masked_fill(later, float("-inf")).softmax(-1) @ vd).transpose(0, 1)
        torch.testing.assert_close(got[start : start + n].double(), want, atol=1e-4, rtol=1e-4)
        start += n


def test_a_pack_past_int32_offsets() -> None:
    heads = 128
    lengths = [4096] * 22 + [1, 3000]  # 93 k rows: row x heads x 192 passes 2**31
    assert sum(lengths) * heads * D_QK > 2**31
    q, k, v = _inputs(lengths, heads, torch.bfloat16, seed=3)
    tiles = ma.plan(lengths, ma.HOPPER_CONFIG.block_m).to(CUDA)
    got = ma.mla_attention(q, k, v, tiles, scale=D_QK**-0.5)
    last = len(lengths) - 1
    want = _sdpa_reference(q, k, v, lengths, D_QK**-0.5, docs=[0, last - 1, last])
    ends = {0: 0, last - 1: sum(lengths[:-2]), last: sum(lengths[:-1])}
    for i, start in ends.items():
        n = lengths[i]
        torch.testing.assert_close(
            got[start : start + n].float(), want[i], atol=1e-2, rtol=1e-2, msg=f"document {i}"
        )


@pytest.mark.parametrize(
    "config",
    [
        ma.Config(block_m=64, block_n=32, warps=4, stages=2),
        ma.Config(block_m=64, block_n=64, warps=4, stages=3, head_group=3),
        ma.Config(block_m=128, block_n=128, warps=8, stages=2),
        ma.Config(block_m=128, block_n=32, warps=8, stages=4, head_group=2),
        ma.Config(block_m=128, block_n=64, warps=4, stages=1),
    ],
    ids=lambda c: f"{c.block_m}x{c.block_n}-w{c.warps}-s{c.stages}-g{c.head_group}",
)
def test_other_tile_shapes_agree(config: ma.Config) -> None:
    from triton.runtime.errors import OutOfResources

    lengths, heads = [1, 700, 129, 64, 1500], 8
    q, k, v = _inputs(lengths, heads, torch.bfloat16, seed=5)
    scale = D_QK**-0.5
    want = ma.mla_attention(q, k, v, ma.plan(lengths, 128).to(CUDA), scale=scale)
    try:
        got = ma.mla_attention(
            q, k, v, ma.plan(lengths, config.block_m).to(CUDA), scale=scale, config=config
        )
    except OutOfResources as exc:
        pytest.skip(f"{config} does not fit this GPU: {exc}")
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


COMPILE = """
import torch
from consumer.kernels import mla_attention as ma
ma.precompile(heads=128, qk_dim=192, v_dim=128, dtype=torch.bfloat16)
"""
LAUNCH = """
import torch
from consumer.kernels import mla_attention as ma
lengths = [300, 1, 77]
q, k = (torch.randn(378, 128, 192, device="cuda", dtype=torch.bfloat16) for _ in "qk")
v = torch.randn(378, 128, 128, device="cuda", dtype=torch.bfloat16)
ma.mla_attention(q, k, v, ma.plan(lengths, ma.HOPPER_CONFIG.block_m).cuda(), scale=0.07)
torch.cuda.synchronize()
"""


def test_a_launch_after_precompile_compiles_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "triton"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    compiled: set[str] = set()
    for code in (COMPILE, LAUNCH):
        if code is LAUNCH:
            compiled = {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    assert compiled, "the compile-only call wrote nothing"
    assert {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()} == compiled


def test_the_attention_module_takes_the_kernel_for_latent_attention(monkeypatch) -> None:
    """`SdpaCoreAttention` with a value width narrower than q/k (latent attention, v padded
    for the flash call) runs a pack of plain documents through this kernel, its tiles planned
    once for every layer; with the kernel off (it raised once) the flash call serves, and the
    two agree."""
    from types import SimpleNamespace

    from consumer.forward import attention

    lengths = [700, 1, 1500, 90]
    q, k, v = _inputs(lengths, 8, torch.bfloat16, seed=11)
    v_padded = torch.nn.functional.pad(v, (0, D_QK - D_V))
    core = attention.SdpaCoreAttention(config=SimpleNamespace(), softmax_scale=0.07, value_dim=D_V)
    bounds = attention.TreeBounds.documents(lengths)
    got = core.attend_rotated(q, k, v_padded, bounds)
    assert bounds.mla_tiles is not None and bounds.mla_tiles.is_cuda  # planned for the rest
    direct = ma.mla_attention(q, k, v, bounds.mla_tiles, scale=0.07)
    assert torch.equal(got, direct.reshape(sum(lengths), -1))
    monkeypatch.setattr(attention, "_LATENT_FAILED", ["off"])
    flash = core.attend_rotated(q, k, v_padded, attention.TreeBounds.documents(lengths))
    flash = flash.view(sum(lengths), 8, D_QK)[..., :D_V].reshape(sum(lengths), -1)
    torch.testing.assert_close(got.float(), flash.float(), atol=2e-2, rtol=2e-2)
