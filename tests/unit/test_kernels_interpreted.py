"""The fused head's Triton kernels (consumer/kernels) under Triton's CPU interpreter.

The CUDA tests (tests/gpu) run the compiled kernels; these run their logic on a machine
without a GPU, so CI sees a change that breaks it. Each case runs in a fresh interpreter,
since TRITON_INTERPRET is read when the kernels are defined.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.interpreter import INDEX_PATCH, run_interpreted

pytest.importorskip("triton")


PRELUDE = INDEX_PATCH + textwrap.dedent(
    """
    import dataclasses
    import sys

    import torch

    from consumer import kernels, tp_ops
    from consumer.kernels import rowstats
    from consumer.tp_ops.local import local_samples
    from tests.helpers import head

    args = [int(a) for a in sys.argv[1:]]
    """
)

# Samples must equal the PyTorch reference bit for bit: block keys, ids and tempered logits.
SAMPLES = textwrap.dedent(
    """
    start, valid, width, n, per_program, margin = args
    rows = 6
    gen = torch.Generator().manual_seed(start + valid + n)
    logits = torch.randn(rows, width, generator=gen) * 3.0
    logits[1, 10:200] = float("-inf")  # masked ids, a whole block among them
    logits[2, 5] = 60.0  # one dominant id
    logits = logits.to(torch.bfloat16)
    inv = tp_ops.validate_temperature(temperature_T=[0.7, 1.0, 1.5, 2.0, 0.3, 1.0])
    keys = tp_ops.stream_keys(
        seed_T=torch.arange(rows) * 7 - 3, position_T=torch.arange(rows) + 5, sample_n=n
    )
    shard = tp_ops.VocabShard(start=start, size=width, vocab_size=start + valid)
    z = torch.empty(rows, width)
    torch.mul(logits, inv[:, None], out=z)
    z[:, valid:] = float("-inf")
    want = local_samples(z_RV=z, keys_RN=keys, shard=shard)
    rowstats.CONFIG.samples_per_program = per_program
    rowstats.CONFIG.blocks_per_step = 2  # and rows in parts of 2 to 4 blocks
    rowstats.CONFIG.target_programs = rows * 3
    # The fast block choice (margin 0: never checked), the default, and exact keys always.
    rowstats.CONFIG.sample_margin = (0.0, 1.0, float("inf"))[margin]
    got = rowstats.gumbel_argmax(
        logits_RV=logits, inv_temperature_R=inv, keys_RN=keys, start=start, valid=valid
    )
    for name, w, g in zip(("key", "id", "z"), want, got, strict=True):
        assert torch.equal(w, g), (name, w, g)
    print("ok")
    """
)

# The whole head through the kernels against the reference path, on the same CPU tensors:
# ids equal, values equal to fp32 rounding (sums run in another order). 71 sampling blocks,
# enough for top-k 64 on the kernels' path.
HEAD = textwrap.dedent(
    """
    top_k, want_entropy, bf16 = args
    calls = []

    def spy(**kw):
        out = rowstats.local_reduce(**kw)
        calls.append(out is not None and not bool(out.overflow_R.any()))
        return out

    # The kernels take CPU tensors here: the head's driver gets them for the CPU device.
    loaded = dataclasses.replace(kernels.triton_kernels(), local_reduce=spy)
    kernels.load = lambda device: loaded
    rowstats.CONFIG.blocks_per_step = 4  # a few steps a row: the running rescale runs
    rowstats.CONFIG.target_programs = 36  # 12 rows in parts: the parts' merge runs
    rows, padded, vocab = 12, 9088, 9000
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(rows, padded, generator=gen) * 3.0
    logits[1, 10:3000] = float("-inf")
    logits[3] = -5.0
    logits[3, :500] = torch.randint(-2, 3, (500,), generator=gen).float()  # ties, top ids close
    logits[5, :2000] = torch.linspace(30.0, 20.0, 2000)  # the row's max far from block 0's
    logits = logits.to(torch.bfloat16 if bf16 else torch.float32)
    call = dict(
        logits_TV=logits,
        shard=tp_ops.vocab_shard(rank=0, tp_size=1, padded_vocab=padded, vocab_size=vocab),
        tp_group=None,
        target_ids_TW=torch.randint(300, vocab, (rows, 3), generator=gen),
        inv_temperature_T=tp_ops.validate_temperature(temperature_T=[0.7, 1.0, 2.0] * 4),
        top_k=top_k,
        sample_n=4,
        seed_T=torch.arange(rows),
        position_T=torch.arange(rows) + 3,
        want_entropy=bool(want_entropy),
    )
    out = {}
    for fused in (True, False):
        out[fused] = vars(head(**call, fused=fused))
    assert calls == [True], calls  # the kernels took the chunk and finished every row
    for name, want in out[False].items():
        got = out[True][name]
        if want is None or not want.is_floating_point():
            assert (got is None and want is None) or torch.equal(got, want), name
        else:
            torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5, msg=name)
    print("ok")
    """
)


def _run(body: str, *args: int) -> None:
    run_interpreted(PRELUDE + body, *map(str, args), timeout=300)


@pytest.mark.parametrize("margin", [0, 1, 2])
@pytest.mark.parametrize(
    ("start", "valid", "width", "n", "per_program"),
    [
        (0, 1000, 1024, 8, 16),  # a whole vocabulary, the last block partial
        (320, 300, 320, 3, 16),  # a shard starting 64 ids into a block
        (128, 256, 256, 20, 16),  # 16 + 4 samples: two programs a row
        (0, 100, 128, 5, 2),  # one block, three programs a row
    ],
)
def test_sampling_kernel_matches_the_reference(start, valid, width, n, per_program, margin):
    _run(SAMPLES, start, valid, width, n, per_program, margin)


@pytest.mark.parametrize(("top_k", "want_entropy", "bf16"), [(20, 1, 1), (64, 0, 0), (0, 1, 1)])
def test_fused_head_matches_the_reference_path(top_k, want_entropy, bf16):
    _run(HEAD, top_k, want_entropy, bf16)


# The fused expert GEMMs (consumer/kernels/expert_gemm.py) against the unfused path. Triton's
# interpreter stores bf16 and FP8 as raw bits: its dot would multiply bf16 bit patterns as
# integers and its float casts truncate, so here bf16 operands are widened for the dot and
# casts between float32, bf16, fp16 and FP8 round to nearest even as the GPU does.
EXPERTS = textwrap.dedent(
    """
    import triton.language as tl

    from consumer.forward import moe_gemm

    bits = {tl.float32: (torch.float32, np.float32, torch.float32),
            tl.float16: (torch.float16, np.float16, torch.float16),
            tl.bfloat16: (torch.bfloat16, np.uint16, torch.int16),
            tl.float8e4nv: (torch.float8_e4m3fn, np.uint8, torch.uint8)}
    convert = interpreter._convert_float

    def rounded(data, src, dst, rounding_mode):
        if src not in bits or dst not in bits:
            return convert(data, src, dst, rounding_mode)
        (s_torch, s_np, _), (d_torch, d_np, d_raw) = bits[src], bits[dst]
        t = torch.from_numpy(np.ascontiguousarray(data).view(s_np).copy()).view(s_torch)
        return t.to(d_torch).view(d_raw).numpy().view(d_np)

    interpreter._convert_float = rounded
    dot = interpreter.InterpreterBuilder.create_dot

    def widened_dot(self, a, b, d, *rest):
        def widen(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            wide = (h.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(wide, tl.float32)

        return dot(self, widen(a), widen(b), d, *rest)

    interpreter.InterpreterBuilder.create_dot = widened_dot

    from consumer.kernels import expert_gemm as eg

    tokens, k, hidden, ffn, experts, empty, fp8, half, down_bm, tma, tail = args
    if down_bm:  # the second GEMM on tiles of its own, scheduled at its own row count
        # (FP8: 256 columns span two weight blocks, so one scale a column)
        eg.BF16_DOWN_TILES = eg.Tiles(bm=down_bm, bn=256, bk=64, warps=8, stages=3)
        eg.FP8_DOWN_TILES = eg.Tiles(bm=down_bm, bn=256, bk=128, warps=8, stages=3)
    if tail:  # each expert's last part of at most `tail` rows in a launch of its own
        for name, bn, bk in (("BF16", 128, 64), ("BF16_DOWN", 256, 64), ("FP8", 128, 128),
                             ("FP8_DOWN", 128, 128)):  # fmt: skip
            setattr(eg, name + "_TILES", eg.Tiles(bm=2 * tail, bn=bn, bk=bk, warps=4))
            setattr(eg, name + "_TAIL_TILES", eg.Tiles(bm=tail, bn=bn, bk=bk, warps=4))
    # the weights, and the second GEMM's sorted rows, through tensor descriptors or pointers
    for name in ("BF16_TILES", "BF16_DOWN_TILES", "FP8_TILES", "FP8_DOWN_TILES"):
        setattr(eg, name, dataclasses.replace(getattr(eg, name), tma=bool(tma)))
    gen = torch.Generator().manual_seed(tokens + hidden)
    dtype = torch.float16 if half else torch.bfloat16
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w1 = torch.randn(experts, 2 * ffn, hidden, generator=gen) / 16
    w2 = torch.randn(experts, hidden, ffn, generator=gen) / 16
    scales = {}
    if fp8:
        (fc1, s1), (fc2, s2) = (moe_gemm._quantize_experts(w) for w in (w1, w2))
        scales = {"fc1_scale": s1, "fc2_scale": s2}
    else:
        fc1, fc2 = w1.to(dtype), w2.to(dtype)
    ids = torch.randint(0, experts, (tokens * k,), generator=gen)
    ids[ids == empty] = (empty + 1) % experts  # an expert with no rows
    dst = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts)
    weights = torch.rand(tokens * k, generator=gen)
    got, want = (torch.full((tokens * k, hidden), float("nan"), dtype=dtype) for _ in "ab")
    call = (x, dst // k, dst, weights, counts, fc1, fc2)
    moe_gemm.routed_swiglu(*call, got, path="triton", **scales)
    moe_gemm.routed_swiglu(*call, want, path="unfused", **scales)
    assert not got.isnan().any(), "a routed row was never written"
    diff = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item()
    # FP8: the sums run in another order, which can move one rounding of SwiGLU's output
    assert diff.max().item() <= (0.03 if fp8 else 0.01) * scale, (diff.max(), scale)
    assert diff.mean().item() <= 1e-3 * scale, (diff.mean(), scale)
    print("ok")
    """
)


@pytest.mark.parametrize(
    ("tokens", "k", "hidden", "ffn", "experts", "empty", "fp8", "half", "down_bm", "tma", "tail"),
    [
        (37, 2, 200, 72, 5, 1, 0, 0, 0, 0, 0),  # depths not a multiple of the tile or of 128
        (1, 2, 64, 32, 4, 3, 0, 1, 0, 0, 0),  # one token, fp16
        # FP8 block-quantized experts, two row tiles, two column tiles of each GEMM (one
        # weight scale a tile)
        (150, 2, 256, 256, 3, 0, 1, 0, 0, 0, 0),
        (150, 2, 384, 128, 3, 0, 1, 0, 64, 0, 0),  # FP8, the down GEMM one scale a column
        (70, 2, 300, 72, 4, 2, 0, 0, 64, 0, 0),  # the down GEMM on 64 x 256 tiles, a partial one
        (37, 2, 200, 72, 5, 1, 0, 0, 0, 1, 0),  # through TMA: blocks past the depth and the rows
        (150, 2, 256, 128, 3, 0, 1, 0, 0, 1, 0),  # FP8 through TMA
        # 32-row tiles and a launch of 16-row ones for each expert's last part: experts
        # with and without one, with a last part that fills its 16 rows or not
        (90, 2, 200, 72, 6, 4, 0, 0, 0, 1, 16),
        (150, 2, 256, 128, 5, 0, 1, 0, 0, 0, 16),  # FP8
    ],
)
def test_expert_gemm_kernels_match_the_unfused_path(
    tokens, k, hidden, ffn, experts, empty, fp8, half, down_bm, tma, tail
):
    _run(EXPERTS, tokens, k, hidden, ffn, experts, empty, fp8, half, down_bm, tma, tail)


# The combine kernel (consumer/kernels/moe_combine.py): each token's routed rows, found by
# position (-1: a choice another rank served), weighted and summed, against a float64 sum.
COMBINE = textwrap.dedent(
    """
    from consumer.kernels import moe_combine

    tokens, k, hidden, half, missing = args
    gen = torch.Generator().manual_seed(tokens * k + hidden)
    dtype = torch.float16 if half else torch.float32
    y = torch.randn(tokens * k, hidden, generator=gen).to(dtype)
    pos = torch.randperm(tokens * k, generator=gen)
    weights = torch.rand(tokens * k, generator=gen)
    pos[torch.rand(tokens * k, generator=gen) < missing / 100] = -1
    got = moe_combine.combine(y, pos, weights.to(dtype), k)
    rows = y.double()[pos.clamp(min=0)] * (pos >= 0)[:, None]
    want = (rows * weights.to(dtype).double()[:, None]).view(tokens, k, hidden).sum(1)
    assert got.dtype == dtype and got.shape == (tokens, hidden), (got.dtype, got.shape)
    tol = 2e-3 if half else 1e-5
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=0)
    print("ok")
    """
)


@pytest.mark.parametrize(
    ("tokens", "k", "hidden", "half", "missing"),
    [(5, 8, 1500, 0, 0), (3, 1, 64, 1, 0), (9, 4, 200, 0, 40)],  # two column blocks, top-1,
)  # a third of the choices on another rank's experts
def test_combine_kernel_sums_each_tokens_weighted_rows(tokens, k, hidden, half, missing):
    _run(COMBINE, tokens, k, hidden, half, missing)


# Latent attention's q, k, v for the flash kernel (consumer/kernels/mla_rope.py) against the
# PyTorch ops TeacherMLA runs elsewhere: de-interleave, concatenate, pad, rotate.
MLA = textwrap.dedent(
    """
    from consumer.forward.attention import apply_rope
    from consumer.forward.mla import _deinterleave
    from consumer.kernels import mla_rope

    heads, nope, rope, v, interleaved = args
    rows, lora = 5, 16
    gen = torch.Generator().manual_seed(heads + nope)
    q = torch.randn(rows, heads, nope + rope, generator=gen)
    kv = torch.randn(rows, heads, nope + v, generator=gen)
    down = torch.randn(rows, lora + rope, generator=gen)  # k_pe is a strided view, as in MLA
    k_pe = down[:, lora:]
    angles = torch.rand(rows, rope // 2, generator=gen) * 6.0
    cos, sin = angles.cos() * 1.3, angles.sin() * 1.3
    got = mla_rope.mla_qkv(q, kv, k_pe, cos, sin, nope=nope, interleaved=bool(interleaved))
    q_pe, k_pe = q[..., nope:], k_pe
    if interleaved:
        q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
    query = torch.cat((q_pe, q[..., :nope]), dim=-1)
    key = torch.cat((k_pe[:, None, :].expand(rows, heads, rope), kv[..., :nope]), dim=-1)
    value = torch.nn.functional.pad(kv[..., nope:], (0, nope + rope - v))
    want = (apply_rope(query, cos, sin), apply_rope(key, cos, sin), value)
    for name, w, g in zip("qkv", want, got, strict=True):
        assert g.shape == w.shape and g.is_contiguous(), (name, g.shape, w.shape)
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)
    print("ok")
    """
)


@pytest.mark.parametrize(
    ("heads", "nope", "rope", "v", "interleaved"),
    [(4, 8, 8, 12, 1), (3, 16, 8, 16, 0), (20, 128, 64, 128, 1)],  # tiny, odd heads, DeepSeek
)
def test_mla_qkv_kernel_matches_the_pytorch_ops(heads, nope, rope, v, interleaved):
    _run(MLA, heads, nope, rope, v, interleaved)
