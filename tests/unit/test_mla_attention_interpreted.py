"""The packed causal attention kernel for latent attention (consumer/kernels/mla_attention.py)
under Triton's CPU interpreter, against a dense float64 reference written here.

Shapes are tiny and awkward: a 1-token document, an empty one, lengths that are not a
multiple of the 16-row blocks (so the off-diagonal loop, the masked diagonal blocks and the
last tile's padding rows all run), q/k head sizes of one power of two (16) and of two
(24 = 16 + 8), odd head counts, a head group that does not divide them, and q, k, v and out
as strided views. float32 inputs (exact dots in the interpreter) must match to 1e-4; bf16
and fp16 inputs must match the reference computed from the same rounded inputs to within
their rounding. Each case runs in a fresh interpreter, since TRITON_INTERPRET is read when
the kernels are defined. `plan` and the argument checks need no interpreter.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from tests.interpreter import INDEX_PATCH, run_interpreted

pytest.importorskip("triton")

from consumer.kernels import mla_attention as ma

# Triton's interpreter keeps bf16 as raw 16-bit patterns: its dot would multiply the
# patterns as integers, and its float32 <-> bf16 casts truncate. Here bf16 dot operands are
# widened to float32 first and the casts round to nearest even, as the GPU does.
PRELUDE = INDEX_PATCH + textwrap.dedent(
    """
    import json
    import sys

    import torch
    import triton.language as tl

    _convert = interpreter._convert_float

    def _convert_rounded(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        if src == tl.bfloat16 and dst == tl.float32:
            bits = np.ascontiguousarray(data).view(np.int16).copy()
            return torch.from_numpy(bits).view(torch.bfloat16).float().numpy()
        return _convert(data, src, dst, rounding_mode)

    interpreter._convert_float = _convert_rounded
    _dot = interpreter.InterpreterBuilder.create_dot

    def _as_float32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        wide = (handle.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(wide, tl.float32)

    def _dot_widened(self, a, b, d, *rest):
        return _dot(self, _as_float32(a), _as_float32(b), d, *rest)

    interpreter.InterpreterBuilder.create_dot = _dot_widened

    from consumer.kernels import mla_attention as ma


    def reference(q, k, v, lengths, scale):
        # dense causal softmax attention, one document at a time, in float64
        out = torch.zeros(v.shape, dtype=torch.float64)
        start = 0
        for n in lengths:
            qd, kd, vd = (t[start : start + n].double().transpose(0, 1) for t in (q, k, v))
            scores = scale * (qd @ kd.transpose(1, 2))
            later = torch.ones(n, n, dtype=torch.bool).triu(1)  # keys after the query
            weights = scores.masked_fill(later, float("-inf")).softmax(dim=-1)
            out[start : start + n] = (weights @ vd).transpose(0, 1)
            start += n
        return out

    case = json.loads(sys.argv[1])
    """
)

BODY = textwrap.dedent(
    """
    dtype = getattr(torch, case["dtype"])
    lengths, heads, d_qk, d_v = case["lengths"], case["heads"], case["d_qk"], case["d_v"]
    config = ma.Config(
        block_m=case["block_m"], block_n=case["block_n"], warps=4, stages=1,
        head_group=case["head_group"],
    )
    rows = sum(lengths) + case["spare_rows"]  # rows no document covers stay as they were
    gen = torch.Generator().manual_seed(sum(lengths) + heads + d_qk)
    if case["strided"]:
        # q: a slice of wider rows; k: heads-major memory; v: v padded to d_qk, then cut
        q = (torch.randn(rows, heads, d_qk + 8, generator=gen) * 2).to(dtype)[..., 4 : 4 + d_qk]
        k = torch.randn(heads, rows, d_qk, generator=gen).to(dtype).transpose(0, 1)
        v = torch.randn(rows, heads, d_qk + d_v, generator=gen).to(dtype)[..., :d_v]
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    else:
        q = torch.randn(rows, heads, d_qk, generator=gen) * 2  # peaked rows: rescaling runs
        k = torch.randn(rows, heads, d_qk, generator=gen)
        v = torch.randn(rows, heads, d_v, generator=gen)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    canvas = torch.full((rows, heads, d_v + 8), float("nan"), dtype=dtype)
    out = canvas[..., 8:]  # written in place, at a row stride of its own
    scale = d_qk**-0.5
    tiles = ma.plan(lengths, config.block_m)
    got = ma.mla_attention(q, k, v, tiles, scale=scale, config=config, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    covered = sum(lengths)
    want = reference(q[:covered], k[:covered], v[:covered], lengths, scale)
    diff = (got[:covered].double() - want).abs().max().item()
    assert diff <= case["atol"], (diff, case)
    assert canvas[..., :8].isnan().all(), "a column outside out was written"
    assert got[covered:].isnan().all(), "a row past the last document was written"
    print("ok")
    """
)

# lengths, heads, q/k and v head sizes, blocks, head group, views, rows past the documents
LAYOUTS = {
    "two-dots": dict(
        lengths=[1, 5, 17, 3, 40], heads=3, d_qk=24, d_v=8, block_m=16, block_n=16,
        head_group=1, strided=False, spare_rows=0,
    ),
    "one-dot-wide-tiles": dict(
        lengths=[40, 0, 1, 33, 16], heads=3, d_qk=16, d_v=16, block_m=32, block_n=16,
        head_group=2, strided=False, spare_rows=3,
    ),
    "strided-views": dict(
        lengths=[17, 1, 35], heads=2, d_qk=24, d_v=16, block_m=16, block_n=16,
        head_group=2, strided=True, spare_rows=2,
    ),
}  # fmt: skip
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


def _run(case: dict) -> None:
    run_interpreted(PRELUDE + BODY, json.dumps(case), timeout=120)


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [
        ("two-dots", "float32"),
        ("two-dots", "bfloat16"),
        ("one-dot-wide-tiles", "float32"),
        ("one-dot-wide-tiles", "float16"),
        ("strided-views", "float32"),
        ("strided-views", "bfloat16"),
    ],
)
def test_kernel_matches_dense_causal_attention_per_document(layout: str, dtype: str) -> None:
    _run({**LAYOUTS[layout], "dtype": dtype, "atol": TOLERANCE[dtype]})


def test_plan_cuts_documents_into_tiles_most_expensive_first() -> None:
    tiles = ma.plan([0, 5, 40, 0, 17], 16)
    assert tiles.dtype == torch.int32 and tiles.device.type == "cpu"
    # (document's first row, tile's first row in it, length); cost: the last row's keys
    assert tiles.tolist() == [
        [5, 32, 40],  # 40 keys
        [5, 16, 40],  # 32
        [45, 16, 17],  # 17
        [5, 0, 40],  # 16, before the tie in pack order
        [45, 0, 17],  # 16
        [0, 0, 5],  # 5
    ]
    assert ma.plan([], 16).shape == (0, 3)
    assert ma.plan([0, 0], 64).shape == (0, 3)
    assert ma.plan([1], 128).tolist() == [[0, 0, 1]]


@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_plan_covers_every_row_once_and_never_puts_a_cheaper_tile_first(block_m: int) -> None:
    gen = torch.Generator().manual_seed(block_m)
    lengths = torch.randint(0, 300, (25,), generator=gen).tolist()
    tiles = ma.plan(lengths, block_m).tolist()
    seen = [0] * sum(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for doc_start, m, n in tiles:
        assert doc_start in starts and 0 <= m < n and m % block_m == 0
        for r in range(m, min(m + block_m, n)):
            seen[doc_start + r] += 1
    assert seen == [1] * sum(lengths)
    costs = [m + min(block_m, n - m) for _, m, n in tiles]
    assert costs == sorted(costs, reverse=True)


def test_plan_refuses_negative_lengths_and_blocks() -> None:
    with pytest.raises(ValueError, match="length -1"):
        ma.plan([3, -1], 16)
    with pytest.raises(ValueError, match="block_m 0"):
        ma.plan([3], 0)


def test_head_sizes_split_into_at_most_two_power_of_two_dots() -> None:
    assert ma.split_qk_dim(192) == (128, 64)
    assert ma.split_qk_dim(128) == (128, 0)
    assert ma.split_qk_dim(24) == (16, 8)
    assert ma.split_qk_dim(160) == (128, 32)
    for bad in (56, 200, 224):  # 32 + 24, 128 + 72, 128 + 96
        with pytest.raises(ValueError, match="not a power of two or the sum of two"):
            ma.split_qk_dim(bad)


@pytest.mark.parametrize(
    ("d_qk", "d_v", "config", "match"),
    [
        (56, 16, None, "q/k head size 56"),
        (200, 128, None, "q/k head size 200"),
        (24, 12, None, "v head size 12"),
        (24, 8, ma.Config(block_m=16, block_n=32), "block_n <= block_m"),
        (24, 8, ma.Config(block_m=48, block_n=16), "powers of two"),
    ],
)
def test_unsupported_shapes_raise_before_any_launch(d_qk, d_v, config, match) -> None:
    rows, heads = 9, 2
    q, k = (torch.randn(rows, heads, d_qk, dtype=torch.bfloat16) for _ in "qk")
    v = torch.randn(rows, heads, d_v, dtype=torch.bfloat16)
    tiles = ma.plan([rows], 16)
    with pytest.raises(ValueError, match=match):
        ma.mla_attention(q, k, v, tiles, scale=0.1, config=config)


def test_operand_checks() -> None:
    q = torch.randn(9, 2, 24)
    v = torch.randn(9, 2, 8)
    tiles = ma.plan([9], 16)
    with pytest.raises(ValueError, match="contiguous last dim"):
        ma.mla_attention(q, q, torch.randn(9, 2, 16)[..., ::2], tiles, scale=0.1)
    with pytest.raises(ValueError, match="dtypes"):
        ma.mla_attention(q, q.bfloat16(), v, tiles, scale=0.1)
    with pytest.raises(ValueError, match="int32"):
        ma.mla_attention(q, q, v, tiles.long(), scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        ma.mla_attention(q, q, v, tiles, scale=0.0)
    # compiled for a GPU, every dot dimension must be at least 16 (the interpreter takes 8)
    with pytest.raises(ValueError, match="at least 16"):
        ma._check_dims(24, 8, ma.Config(block_m=16, block_n=16), gpu=True)
    assert ma._check_dims(192, 128, ma.HOPPER_CONFIG, gpu=True) == (128, 64)
