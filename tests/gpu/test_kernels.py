"""consumer.kernels (the fused Triton head) against the PyTorch reference path (consumer.tp_ops).

Samples must be bit-identical to the reference (same ids, same keys, same tempered logits),
on CUDA and on CPU; top-k ids identical; every value equal to fp32 rounding (sums run in
another order). Vocabulary of the Qwen2.5-7B size, so the kernels loop over ~150 blocks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

# E402: these imports follow the skips above (rowstats needs Triton).
from consumer import kernels, tp_ops  # noqa: E402 - after the skips
from consumer.kernels import rowstats  # noqa: E402 - after the skips
from consumer.tp_ops.local import local_samples  # noqa: E402 - after the skips
from tests.helpers import chunked, head  # noqa: E402 - after the skips

VOCAB, PADDED = 151936, 152064
CUDA = torch.device("cuda")
# fp32 log-probs near -12, summed in another order: a few ulps.
TOL = {"atol": 5e-5, "rtol": 1e-5}


def _logits(rows: int, *, dtype: torch.dtype, seed: int, width: int = PADDED) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=gen) * 3.0
    logits[1, 100:5000] = float("-inf")  # masked tokens
    logits[2, 1234] = 60.0  # one dominant token
    logits[3] = torch.randn(width, generator=gen) * 0.05  # nearly flat: many bf16 ties
    logits[4, 2000:2100] = 12.0 + torch.randn(100, generator=gen)  # the top ids in one place
    return logits.to(dtype)


def _row_args(rows: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 1)
    temps = [(0.3, 0.7, 1.0, 1.5, 4.0)[i % 5] for i in range(rows)]
    seed_T = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    return {
        "inv": tp_ops.validate_temperature(temperature_T=temps),
        "seed": seed_T,
        "pos": torch.randint(0, 1 << 40, (rows,), generator=gen),
        "targets": torch.randint(0, VOCAB, (rows, 3), generator=gen),
    }


def _reference_z(logits: torch.Tensor, inv: torch.Tensor, valid: int) -> torch.Tensor:
    z = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    torch.mul(logits, inv.float()[:, None], out=z)
    z[:, valid:] = float("-inf")
    return z


@pytest.mark.parametrize(
    ("blocks", "per_program", "tp", "tp_rank", "n"),
    [
        (8, 16, 2, 0, 8),
        (4, 4, 2, 1, 8),  # two programs a row
        (16, 16, 1, 0, 20),  # 16 + 4 samples: a partly masked second program
        # TP = 3 cuts a sampling block: shard 0 ends 64 ids into it, shard 1 starts there.
        (8, 8, 3, 0, 5),
        (8, 8, 3, 1, 8),
    ],
)
def test_gumbel_kernel_is_bit_identical_to_the_reference(blocks, per_program, tp, tp_rank, n):
    rows = 24
    padded = 152064 + (192 if tp == 3 else 0)  # a multiple of 3, not of 3 x SAMPLE_BLOCK
    shard = tp_ops.vocab_shard(rank=tp_rank, tp_size=tp, padded_vocab=padded, vocab_size=VOCAB)
    logits = _logits(rows, dtype=torch.bfloat16, seed=blocks + tp_rank, width=shard.size)
    a = _row_args(rows, seed=blocks)
    keys = tp_ops.stream_keys(seed_T=a["seed"], position_T=a["pos"], sample_n=n)
    z_cuda = _reference_z(logits.to(CUDA), a["inv"].to(CUDA), shard.valid_size)
    on_cuda = local_samples(z_RV=z_cuda, keys_RN=keys.to(CUDA), shard=shard)
    on_cpu = local_samples(z_RV=z_cuda.cpu(), keys_RN=keys, shard=shard)
    cfg = rowstats.CONFIG
    old = (cfg.blocks_per_step, cfg.samples_per_program, cfg.sample_margin)
    # The fast block choice alone, as configured, and exact keys everywhere.
    for margin in (0.0, 1.0, float("inf")):
        cfg.blocks_per_step, cfg.samples_per_program, cfg.sample_margin = (
            blocks,
            per_program,
            margin,
        )
        try:
            got = rowstats.gumbel_argmax(
                logits_RV=logits.to(CUDA),
                inv_temperature_R=a["inv"].to(CUDA),
                keys_RN=keys.to(CUDA),
                start=shard.start,
                valid=shard.valid_size,
            )
        finally:
            cfg.blocks_per_step, cfg.samples_per_program, cfg.sample_margin = old
        for ref in (on_cuda, on_cpu):
            for want, have in zip(ref, got, strict=True):
                assert torch.equal(want.cpu(), have.cpu()), margin


def _head(logits: torch.Tensor, a: dict, *, fused: bool, device: torch.device, **kw) -> dict:
    out = head(
        logits_TV=logits.to(device),
        shard=tp_ops.vocab_shard(rank=0, tp_size=1, padded_vocab=PADDED, vocab_size=VOCAB),
        tp_group=None,
        target_ids_TW=a["targets"].to(device),
        inv_temperature_T=a["inv"].to(device),
        seed_T=a["seed"].to(device),
        position_T=a["pos"].to(device),
        fused=fused,
        **kw,
    )
    return {k: (None if v is None else v.cpu()) for k, v in vars(out).items()}


def _assert_same(got: dict, want: dict) -> None:
    for name, w in want.items():
        g = got[name]
        if w is None:
            assert g is None, name
        elif w.dtype.is_floating_point:
            torch.testing.assert_close(g, w, **TOL, msg=name)
        else:
            assert torch.equal(g, w), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("top_k", "sample_n", "entropy"), [(64, 8, True), (256, 2, False)])
def test_fused_head_matches_the_reference(dtype, top_k, sample_n, entropy):
    rows = 40
    logits = _logits(rows, dtype=dtype, seed=7)
    a = _row_args(rows, seed=7)
    kw = dict(top_k=top_k, sample_n=sample_n, want_entropy=entropy, chunk_rows=16)
    fused = _head(logits, a, fused=True, device=CUDA, **kw)
    _assert_same(fused, _head(logits, a, fused=False, device=CUDA, **kw))
    _assert_same(fused, _head(logits, a, fused=False, device=torch.device("cpu"), **kw))


def test_label_only_head_matches_the_reference():
    logits = _logits(33, dtype=torch.bfloat16, seed=3)
    a = _row_args(33, seed=3)
    kw = dict(top_k=0, sample_n=0, want_entropy=False, chunk_rows=10)
    _assert_same(
        _head(logits, a, fused=True, device=CUDA, **kw),
        _head(logits, a, fused=False, device=torch.device("cpu"), **kw),
    )


def test_threshold_ties_fall_back_to_the_reference(monkeypatch):
    # A constant row ties every column at the top-k threshold: more candidates than the
    # buffer holds, so tp_ops must redo the call on the reference path.
    logits = _logits(8, dtype=torch.bfloat16, seed=5)
    logits[4] = 1.5
    a = _row_args(8, seed=5)
    kw = dict(top_k=64, sample_n=4, want_entropy=True, chunk_rows=8)
    flags = []

    def spy(**k):
        out = rowstats.local_reduce(**k)
        flags.append(bool(out.overflow_R.any()))
        return out

    loaded = kernels.load(CUDA)
    assert loaded is not None
    monkeypatch.setattr(
        kernels, "load", lambda device: dataclasses.replace(loaded, local_reduce=spy)
    )
    got = _head(logits, a, fused=True, device=CUDA, **kw)
    monkeypatch.undo()
    assert flags == [True]
    _assert_same(got, _head(logits, a, fused=False, device=torch.device("cpu"), **kw))
    assert torch.equal(got["topk_ids_TK"][4], torch.arange(64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bad_logits_raise(bad):
    logits = _logits(6, dtype=torch.float32, seed=9)
    logits[5, 777] = bad
    a = _row_args(6, seed=9)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        _head(logits, a, fused=True, device=CUDA, top_k=8, sample_n=2, want_entropy=True)


def test_chunked_head_fused_equals_reference_on_cuda():
    rows, hidden = 2500, 256
    gen = torch.Generator(device=CUDA).manual_seed(0)
    hidden_TH = torch.randn(rows, hidden, generator=gen, device=CUDA).to(torch.bfloat16)
    weight_VH = (torch.randn(PADDED, hidden, generator=gen, device=CUDA) * 0.15).to(torch.bfloat16)
    shard = tp_ops.vocab_shard(rank=0, tp_size=1, padded_vocab=PADDED, vocab_size=VOCAB)
    args = dict(
        hidden_TH=hidden_TH,
        weight_VH=weight_VH,
        shard=shard,
        tp_group=None,
        target_ids_TW=torch.randint(0, VOCAB, (rows, 1), generator=gen, device=CUDA),
        inv_temperature_T=torch.full((rows,), 1.25, device=CUDA),
        top_k=64,
        sample_n=8,
        seed_T=torch.full((rows,), 42, dtype=torch.int64, device=CUDA),
        position_T=torch.arange(rows, device=CUDA),
        want_entropy=True,
        chunk_rows=1024,
    )
    outs = []
    for fused in (True, False):
        out = chunked(**args, fused=fused)
        outs.append({k: (None if v is None else v.cpu()) for k, v in vars(out).items()})
    _assert_same(outs[0], outs[1])


def test_rowstats_config_is_consistent():
    # The columns of a step are the residue classes behind the top-k threshold: at least the
    # largest k a queue accepts by default (QueueSettings.max_top_k = 256); and powers of 2.
    cfg = rowstats.CONFIG
    assert cfg.blocks_per_step * tp_ops.SAMPLE_BLOCK >= 256 and cfg.cap >= 2 * 64
    for n in (cfg.blocks_per_step, cfg.samples_per_program):
        assert n & (n - 1) == 0


@pytest.mark.parametrize(
    ("heads", "nope", "rope", "v", "interleaved"),
    [(128, 128, 64, 128, True), (3, 16, 8, 16, False), (5, 8, 8, 12, True)],
    ids=["deepseek-v3", "odd-heads-rotate-half", "tiny-v-not-power-of-2"],
)
def test_mla_qkv_kernel_matches_the_pytorch_ops(heads, nope, rope, v, interleaved):
    """consumer/kernels/mla_rope.py against TeacherMLA's PyTorch ops (de-interleave,
    concatenate, pad, rotate): equal in float32; in bf16 within one rounding (the kernel
    rounds once, the ops after each product)."""
    from consumer.forward.attention import apply_rope
    from consumer.forward.mla import _deinterleave
    from consumer.kernels import mla_rope

    rows, lora = 300, 512
    gen = torch.Generator(device=CUDA).manual_seed(heads + nope)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(rows, heads, nope + rope, generator=gen, device=CUDA).to(dtype)
        kv = torch.randn(rows, heads, nope + v, generator=gen, device=CUDA).to(dtype)
        down = torch.randn(rows, lora + rope, generator=gen, device=CUDA).to(dtype)
        k_pe = down[:, lora:]
        angles = torch.rand(rows, rope // 2, generator=gen, device=CUDA) * 6.0
        cos, sin = angles.cos() * 1.3, angles.sin() * 1.3
        got = mla_rope.mla_qkv(q, kv, k_pe, cos, sin, nope=nope, interleaved=interleaved)
        q_pe = _deinterleave(q[..., nope:]) if interleaved else q[..., nope:]
        k_rot = _deinterleave(k_pe) if interleaved else k_pe
        query = torch.cat((q_pe, q[..., :nope]), dim=-1).float()
        key = torch.cat((k_rot[:, None, :].expand(rows, heads, rope), kv[..., :nope]), dim=-1)
        value = torch.nn.functional.pad(kv[..., nope:], (0, nope + rope - v))
        want = (apply_rope(query, cos, sin), apply_rope(key.float(), cos, sin), value.float())
        for name, w, g in zip("qkv", want, got, strict=True):
            assert g.shape == w.shape and g.is_contiguous() and g.dtype == dtype, name
            torch.testing.assert_close(g.float(), w, atol=tol, rtol=tol, msg=name)
