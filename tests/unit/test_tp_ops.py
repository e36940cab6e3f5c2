"""consumer.tp_ops against full-vocabulary references, on gloo groups of TP = 1, 2 and 4.

Each TP size is one spawned run (`_tp_worker`) that evaluates every scenario; the tests compare
its per-rank outputs with references computed here from the full, unpadded logits. Padded
vocabulary columns hold the LARGEST logits of every row, so any output that forgot to mask them
differs from the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from consumer import head_common, tp_ops
from consumer.tp_ops import (
    SAMPLE_BLOCK,
    CommStats,
    HeadOutputs,
    VocabShard,
    sampling_hash,
    stream_keys,
    uniform_from_hash,
    validate_temperature,
    vocab_shard,
)
from consumer.tp_ops.local import local_samples
from tests.gloo import run_gloo
from tests.helpers import chunked, head
from tests.timing import scaled

TP_SIZES = (1, 2, 4)
VOCAB, PADDED = 1000, 1024
BIG_VOCAB, BIG_PADDED = 8000, 8192
ROWS = 24
TEMPS = (0.5, 1.0, 2.0, 0.7, 1.3, 3.0)
K_MAIN, N_MAIN = 300, 8  # K_MAIN > 256 columns per shard at TP = 4
FIELDS = (
    "target_logprobs_TW",
    "topk_ids_TK",
    "topk_logprobs_TK",
    "topk_rest_logprob_T",
    "sample_ids_TN",
    "sample_logprobs_TN",
    "entropy_T",
)
# fp32 outputs of size ~60 carry ~4e-6 of rounding; a few ulps relative plus 1e-5 absolute.
TOL = {"atol": 1e-5, "rtol": 2e-6}


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _case(
    *,
    gen_seed: int,
    vocab: int = VOCAB,
    padded: int = PADDED,
    rows: int = ROWS,
    dtype: torch.dtype = torch.float32,
    ties: bool = False,
    k: int = K_MAIN,
    n: int = N_MAIN,
) -> dict:
    gen = torch.Generator().manual_seed(gen_seed)
    if ties:
        # Five distinct values over the whole vocabulary: top-k and argmax ties everywhere.
        logits_TV = torch.randint(-2, 3, (rows, padded), generator=gen).float()
    else:
        logits_TV = torch.randn(rows, padded, generator=gen) * 3.0
        logits_TV[1, 10:41] = float("-inf")  # tokens a caller masked out: probability 0
        logits_TV[1, 256:512] = float("-inf")  # ... and a whole TP=4 shard with no finite logit
        # One dominant token: the mass outside the top-k (~1e-17) is lost by 1 - sum(top-k).
        logits_TV[2, 123] = 80.0
    logits_TV[:, vocab:] = 60.0 + torch.rand(rows, padded - vocab, generator=gen)
    logits_TV = logits_TV.to(dtype)

    targets_TW = torch.randint(0, vocab, (rows, 6), generator=gen)
    targets_TW[:, 1] = 0
    targets_TW[:, 2] = vocab - 1
    targets_TW[:, 3] = padded // 4 + torch.arange(rows)  # owned by the second quarter
    targets_TW[:, 4] = padded // 2 - 1 - torch.arange(rows)  # end of the second half's lead
    if not ties:
        targets_TW[1, 5] = 20  # a -inf logit
    temps = [TEMPS[i % len(TEMPS)] for i in range(rows)]
    seed_T = torch.full((rows,), 1234, dtype=torch.int64)
    seed_T[::5] = -(2**62) + 7  # negative seeds are 64-bit words like any other
    position_T = torch.arange(rows, dtype=torch.int64) + 100
    return {
        "vocab": vocab,
        "logits": logits_TV,
        "targets": targets_TW,
        "inv": validate_temperature(temperature_T=temps),
        "seed": seed_T,
        "pos": position_T,
        "k": k,
        "n": n,
    }


def _permuted(case: dict, perm: torch.Tensor) -> dict:
    out = dict(case)
    for key in ("logits", "targets", "inv", "seed", "pos"):
        out[key] = case[key][perm]
    return out


def _hidden_case(gen_seed: int) -> dict:
    gen = torch.Generator().manual_seed(gen_seed)
    rows, hid = 20, 16
    hidden_TH = torch.randn(rows, hid, generator=gen)
    hidden_TH[:, -1] = 1.0
    weight_VH = torch.randn(PADDED, hid, generator=gen) * 0.5
    weight_VH[:, -1] = 0.0
    weight_VH[VOCAB:, -1] = 80.0  # padded rows of the output layer give huge logits
    case = _case(gen_seed=gen_seed, rows=rows, k=40, n=4)
    case.update(hidden=hidden_TH, weight=weight_VH, logits=hidden_TH @ weight_VH.t())
    return case


def _spec() -> dict:
    main = _case(gen_seed=1)
    perm = torch.randperm(ROWS, generator=torch.Generator().manual_seed(5))
    nan_case = _case(gen_seed=4, rows=4, k=5, n=2)
    nan_case["logits"][2, 3] = float("nan")  # a real column: every rank must refuse
    pad_nan = _case(gen_seed=4, rows=4, k=5, n=2)
    pad_nan["logits"][2, PADDED - 1] = float("nan")  # padding is never read
    return {
        "main": main,
        "perm": perm,
        "permuted": _permuted(main, perm),
        "bf16": _case(gen_seed=2, dtype=torch.bfloat16, k=64, n=4),
        "ties": _case(gen_seed=3, ties=True, k=50, n=4),
        "big": _case(gen_seed=6, vocab=BIG_VOCAB, padded=BIG_PADDED),
        "hidden": _hidden_case(7),
        "nan": nan_case,
        "pad_nan": pad_nan,
    }


# --------------------------------------------------------------------------------------------
# The spawned side: every scenario for one TP size
# --------------------------------------------------------------------------------------------


def _run_case(
    case: dict, *, rank: int, tp: int, group: dist.ProcessGroup | None, **overrides
) -> HeadOutputs:
    shard = vocab_shard(
        rank=rank, tp_size=tp, padded_vocab=case["logits"].shape[1], vocab_size=case["vocab"]
    )
    kwargs = {
        "target_ids_TW": case["targets"],
        "inv_temperature_T": case["inv"],
        "top_k": case["k"],
        "sample_n": case["n"],
        "seed_T": case["seed"],
        "position_T": case["pos"],
        "want_entropy": True,
    }
    kwargs.update(overrides)
    logits_TV = case["logits"][:, shard.start : shard.end].contiguous()
    return head(logits_TV=logits_TV, shard=shard, tp_group=group, **kwargs)


def _tp_worker(rank: int, world: int, spec: dict) -> dict:
    group = dist.group.WORLD
    run = functools.partial(_run_case, rank=rank, tp=world, group=group)
    res: dict = {}
    comm_small, comm_big = CommStats(), CommStats()
    res["main"] = run(spec["main"], comm=comm_small)
    res["big"] = run(spec["big"], comm=comm_big)
    res["comm_small"], res["comm_big"] = comm_small, comm_big
    res["chunked"] = run(spec["main"], chunk_rows=5)
    res["prefix"] = run(spec["main"], top_k=17, sample_n=3)
    res["permuted"] = run(spec["permuted"], chunk_rows=7)
    res["bf16"] = run(spec["bf16"])
    res["ties"] = run(spec["ties"], chunk_rows=10)
    res["empty"] = run(spec["main"], target_ids_TW=None, top_k=0, sample_n=0, want_entropy=False)
    res["empty_w"] = run(
        spec["main"], target_ids_TW=torch.empty(ROWS, 0, dtype=torch.int64), sample_n=0
    )

    hid = spec["hidden"]
    shard = vocab_shard(rank=rank, tp_size=world, padded_vocab=PADDED, vocab_size=VOCAB)
    res["hidden_chunked"] = chunked(
        hidden_TH=hid["hidden"],
        weight_VH=hid["weight"][shard.start : shard.end],
        shard=shard,
        tp_group=group,
        target_ids_TW=hid["targets"],
        inv_temperature_T=hid["inv"],
        top_k=hid["k"],
        sample_n=hid["n"],
        seed_T=hid["seed"],
        position_T=hid["pos"],
        want_entropy=True,
        chunk_rows=3,
    )
    res["hidden_logits"] = run(hid)

    try:
        run(spec["nan"])
        res["nan_error"] = None
    except ValueError as exc:
        res["nan_error"] = str(exc)
    res["pad_nan"] = run(spec["pad_nan"])

    if world == 4:
        # Two TP groups of two inside a world of four: rank and size must come from the group.
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        res["subgroup"] = _run_case(spec["main"], rank=rank % 2, tp=2, group=pairs[rank // 2])
    return res


@functools.cache
def _spec_cached() -> dict:
    return _spec()


@functools.cache
def _results(tp: int) -> list[dict]:
    return run_gloo(tp, _tp_worker, _spec_cached(), timeout=scaled(180))


@pytest.fixture(scope="module", params=TP_SIZES, ids=[f"tp{t}" for t in TP_SIZES])
def tp_results(request) -> tuple[int, list[dict]]:
    return request.param, _results(request.param)


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def _tempered(case: dict) -> torch.Tensor:
    """fp32 tempered logits of the real vocabulary, formed as the kernel must form them."""
    return case["logits"][:, : case["vocab"]].float() * case["inv"][:, None]


def _reference(case: dict, *, k: int | None = None) -> dict:
    k = case["k"] if k is None else k
    z_TV = _tempered(case)
    logp_TV = torch.log_softmax(z_TV.double(), dim=1)
    p_TV = logp_TV.exp()
    # Stable descending sort keeps ascending ids inside a tie: the documented tie rule.
    top_TK = torch.sort(z_TV, dim=1, descending=True, stable=True).indices[:, :k]
    outside_TV = torch.ones_like(logp_TV, dtype=torch.bool).scatter_(1, top_TK, False)
    return {
        "target_logprobs_TW": logp_TV.gather(1, case["targets"]),
        "topk_ids_TK": top_TK,
        "topk_logprobs_TK": logp_TV.gather(1, top_TK),
        "topk_rest_logprob_T": torch.logsumexp(logp_TV.masked_fill(~outside_TV, -math.inf), 1),
        "entropy_T": -torch.where(p_TV > 0, p_TV * logp_TV, 0.0).sum(1),
        "logp_TV": logp_TV,
    }


_M64 = (1 << 64) - 1
_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _py_hash(seed: int, position: int, j: int, v: int) -> int:
    """The docstring definition of sampling_hash, in Python integers."""

    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * _M1) & _M64
        x ^= x >> 27
        x = (x * _M2) & _M64
        return x ^ (x >> 31)

    def sm(s: int, c: int) -> int:
        return mix((s + c * _GAMMA) & _M64)

    return sm(sm(sm(sm(seed & _M64, 1), position + 1), j + 1), v + 1)


def _np_sm(s: np.ndarray, c: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = s + c * np.uint64(_GAMMA)
        x ^= x >> np.uint64(30)
        x *= np.uint64(_M1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(_M2)
        return x ^ (x >> np.uint64(31))


def _np_gumbel(h: np.ndarray) -> np.ndarray:
    u = (h >> np.uint64(12)).astype(np.float64) * 2.0**-52 + 2.0**-53
    return -np.log(-np.log(u))


def _np_sampling_exp(y: np.ndarray) -> np.ndarray:
    """`sampling_exp`'s definition in numpy fp32 (each ufunc rounds once)."""
    f32 = np.float32
    with np.errstate(invalid="ignore"):
        t = y.astype(f32) * f32(head_common.LOG2E_F32)
        tc = np.maximum(t, f32(head_common.EXP2_FLOOR - 1), dtype=f32)
        tc = np.where(np.isnan(t), f32(0), tc)
        n = np.floor(tc)
        f = tc - n
        p = np.full_like(f, f32(head_common.EXP2_COEFFS[0]))
        for c in head_common.EXP2_COEFFS[1:]:
            p = p * f + f32(c)
        scale = np.ldexp(f32(1), n.astype(np.int32)).astype(f32)
        return np.where(t >= f32(head_common.EXP2_FLOOR), p * scale, f32(0))


def test_sampling_exp_matches_numpy_and_exp():
    y = torch.cat([-torch.rand(100_000) * 70, torch.tensor([0.0, -0.0, -63.7, -64.0, -1e-30])])
    got = tp_ops.sampling_exp(y)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(_np_sampling_exp(y.numpy())))
    exact = torch.exp(y.double())
    near = y > -63.7
    rel = ((got.double() - exact).abs() / exact)[near]
    assert float((rel / (2e-7 + 8e-8 * y[near].abs())).max()) < 1.0
    assert float(got[y < -64].abs().max()) == 0.0
    edge = torch.tensor([float("-inf"), float("nan")])
    assert torch.equal(tp_ops.sampling_exp(edge), torch.zeros(2))


def _reference_samples(case: dict, n: int) -> torch.Tensor:
    """The two-level Gumbel-max of `sampling_hash`'s docstring over the full vocabulary (blocks
    of SAMPLE_BLOCK ids from id 0, then an id inside the winning block), in numpy with an
    independent uint64 hash and exp."""
    z_TV = _tempered(case).numpy()
    rows, vocab = z_TV.shape
    width = SAMPLE_BLOCK
    blocks = -(-vocab // width)
    z_TX = np.full((rows, blocks * width), -np.inf, dtype=np.float32)
    z_TX[:, :vocab] = z_TV
    z_TGB = z_TX.reshape(rows, blocks, width)
    m_TG = z_TGB.max(axis=2)
    live_TG = m_TG > -np.inf
    m_TG = np.where(live_TG, m_TG, np.float32(0))
    e_TGB = _np_sampling_exp(z_TGB - m_TG[:, :, None]).astype(np.float64)
    with np.errstate(divide="ignore"):
        lse_TG = np.log(e_TGB.sum(axis=2)) + m_TG.astype(np.float64)
    lse_TG = np.where(live_TG, lse_TG, -np.inf)
    # The block counter -(first id + 1), as a 64-bit word.
    counter_G = (-(np.arange(blocks, dtype=np.int64) * width + 1)).astype(np.uint64)
    one = np.uint64(1)
    s0 = _np_sm(case["seed"].numpy().astype(np.uint64), one)
    s1 = _np_sm(s0, case["pos"].numpy().astype(np.uint64) + one)
    rows_T1 = np.arange(rows)[:, None]
    ids = np.empty((rows, n), dtype=np.int64)
    for j in range(n):
        s2 = _np_sm(s1, np.uint64(j + 1))
        bkey_TG = (lse_TG + _np_gumbel(_np_sm(s2[:, None], counter_G[None, :]))).astype(np.float32)
        block_T = np.argmax(bkey_TG, axis=1)  # first maximum: the lowest block
        col_TB = block_T[:, None] * width + np.arange(width)[None, :]
        g_TB = _np_gumbel(_np_sm(s2[:, None], col_TB.astype(np.uint64) + one)).astype(np.float32)
        ekey_TB = z_TX[rows_T1, col_TB] + g_TB
        ids[:, j] = col_TB[np.arange(rows), np.argmax(ekey_TB, axis=1)]  # lowest id on ties
    return torch.from_numpy(ids)


def _check_against_reference(out: HeadOutputs, case: dict, *, label: str) -> None:
    ref = _reference(case, k=out.topk_ids_TK.shape[1])
    assert out.topk_ids_TK.dtype == out.sample_ids_TN.dtype == torch.int64
    for name in ("target_logprobs_TW", "topk_logprobs_TK", "topk_rest_logprob_T", "entropy_T"):
        got = getattr(out, name)
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.double(), ref[name], **TOL, msg=f"{label}: {name}")
    assert torch.equal(out.topk_ids_TK, ref["topk_ids_TK"]), label
    samples_TN = out.sample_ids_TN
    assert int(samples_TN.max()) < case["vocab"], f"{label}: a padded id was sampled"
    assert torch.equal(samples_TN, _reference_samples(case, samples_TN.shape[1])), label
    torch.testing.assert_close(
        out.sample_logprobs_TN.double(), ref["logp_TV"].gather(1, samples_TN), **TOL
    )
    assert bool(torch.isfinite(out.sample_logprobs_TN).all()), "sampled a probability-0 id"


def _assert_same(
    a: HeadOutputs, b: HeadOutputs, *, exact: bool, label: str, atol: float = 1e-6
) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, f"{label}: {name}"
        elif exact or not x.is_floating_point():
            assert torch.equal(x, y), f"{label}: {name}"
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=1e-6, msg=f"{label}: {name}")


# --------------------------------------------------------------------------------------------
# Tests on the spawned runs
# --------------------------------------------------------------------------------------------


def test_every_rank_gets_identical_outputs(tp_results):
    tp, ranks = tp_results
    for scenario, out in ranks[0].items():
        if isinstance(out, HeadOutputs):
            for r in range(1, tp):
                _assert_same(out, ranks[r][scenario], exact=True, label=f"{scenario} rank {r}")


def test_matches_full_vocab_reference(tp_results):
    _, ranks = tp_results
    spec, res = _spec_cached(), ranks[0]
    _check_against_reference(res["main"], spec["main"], label="main")
    _check_against_reference(res["big"], spec["big"], label="big vocab")
    _check_against_reference(res["chunked"], spec["main"], label="chunk_rows=5")
    _check_against_reference(res["permuted"], spec["permuted"], label="permuted")
    _check_against_reference(res["ties"], spec["ties"], label="tied logits")
    _check_against_reference(res["pad_nan"], spec["pad_nan"], label="NaN in padding")


def test_bf16_logits_match_reference_on_rounded_values(tp_results):
    _, ranks = tp_results
    case = _spec_cached()["bf16"]
    assert case["logits"].dtype == torch.bfloat16
    _check_against_reference(ranks[0]["bf16"], case, label="bf16")


def test_temperatures_differ_per_row(tp_results):
    # Guards the reference itself: rows really ran at several temperatures, applied once.
    _, ranks = tp_results
    case = _spec_cached()["main"]
    inv = case["inv"]
    assert len(set(inv.tolist())) == len(TEMPS)
    plain = torch.log_softmax(case["logits"][:, :VOCAB].double(), 1)
    hot = inv != 1.0
    got = ranks[0]["main"].target_logprobs_TW.double()
    assert not torch.allclose(got[hot], plain.gather(1, case["targets"])[hot], atol=1e-3)


def test_chunking_batch_order_and_prefixes(tp_results):
    _, ranks = tp_results
    res, perm = ranks[0], _spec_cached()["perm"]
    main = res["main"]
    _assert_same(res["chunked"], main, exact=False, label="chunked")
    permuted = res["permuted"]
    inverse = torch.argsort(perm)
    for name in FIELDS:
        got = getattr(permuted, name)[inverse]
        want = getattr(main, name)
        if got.is_floating_point():
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(got, want), name
    prefix = res["prefix"]
    assert torch.equal(prefix.sample_ids_TN, main.sample_ids_TN[:, :3])
    assert torch.equal(prefix.topk_ids_TK, main.topk_ids_TK[:, :17])
    torch.testing.assert_close(prefix.sample_logprobs_TN, main.sample_logprobs_TN[:, :3])
    torch.testing.assert_close(prefix.topk_logprobs_TK, main.topk_logprobs_TK[:, :17])


def test_empty_widths(tp_results):
    _, ranks = tp_results
    res = ranks[0]
    empty = res["empty"]
    for name in ("target_logprobs_TW", "topk_ids_TK", "topk_logprobs_TK", "sample_ids_TN"):
        assert tuple(getattr(empty, name).shape) == (ROWS, 0), name
    assert empty.entropy_T is None
    assert torch.equal(empty.topk_rest_logprob_T, torch.zeros(ROWS))  # all mass outside k=0
    assert tuple(res["empty_w"].target_logprobs_TW.shape) == (ROWS, 0)
    torch.testing.assert_close(res["empty_w"].topk_logprobs_TK, res["main"].topk_logprobs_TK)


def test_chunked_head_equals_single_chunk_and_reference(tp_results):
    _, ranks = tp_results
    res, case = ranks[0], _spec_cached()["hidden"]
    # The two paths multiply differently shaped blocks, so their logits differ in the last bits.
    _assert_same(
        res["hidden_chunked"], res["hidden_logits"], exact=False, label="hidden", atol=1e-5
    )
    _check_against_reference(res["hidden_chunked"], case, label="chunked_head")


def test_nan_logits_fail_on_every_rank(tp_results):
    _, ranks = tp_results
    for r, res in enumerate(ranks):
        assert res["nan_error"] is not None, f"rank {r} accepted NaN logits"
        assert "NaN or +inf" in res["nan_error"]


def test_comm_bytes_do_not_grow_with_vocab(tp_results):
    tp, ranks = tp_results
    for res in ranks:
        small, big = res["comm_small"], res["comm_big"]
        if tp == 1:
            assert small.calls == big.calls == {}
            continue
        assert small == big
        case = _spec_cached()["main"]
        words = 3 + case["targets"].shape[1] + 2 * case["k"] + 3 * case["n"]
        assert small.calls == {"all_gather": 1}
        assert small.bytes_sent == {"all_gather": ROWS * words * 4}
        assert small.bytes_received == {"all_gather": ROWS * words * 4 * tp}


def test_sampling_and_topk_identical_across_tp_sizes():
    base = _results(1)[0]
    for tp in TP_SIZES[1:]:
        res = _results(tp)[0]
        for scenario in ("main", "permuted", "bf16", "ties", "big", "hidden_chunked"):
            assert torch.equal(res[scenario].sample_ids_TN, base[scenario].sample_ids_TN)
            assert torch.equal(res[scenario].topk_ids_TK, base[scenario].topk_ids_TK)
    sub = _results(4)
    for rank in range(4):
        _assert_same(sub[rank]["subgroup"], _results(2)[0]["main"], exact=False, label="subgroup")


# --------------------------------------------------------------------------------------------
# In-process tests (TP = 1, tp_group=None)
# --------------------------------------------------------------------------------------------


def test_hash_matches_its_definition():
    seeds = [0, 1, -1, 2**63 - 1, -(2**62) + 7]
    positions = [0, 5, 2**40 + 3, 17, 1]
    ids = torch.tensor([0, 1, 999, 151_935, 2**30])
    for j in (0, 3):
        got = sampling_hash(
            seed_T=torch.tensor(seeds),
            position_T=torch.tensor(positions),
            sample_index=j,
            vocab_ids_V=ids,
        )
        for r, (s, p) in enumerate(zip(seeds, positions, strict=True)):
            for c, v in enumerate(ids.tolist()):
                want = _py_hash(s, p, j, v)
                assert int(got[r, c]) & _M64 == want
                u = float(uniform_from_hash(got[r : r + 1, c : c + 1]))
                assert u == (2 * (want >> 12) + 1) / 2**53
                assert 0.0 < u < 1.0


def _one_row_case(*, logits_V: torch.Tensor, temperature: float, rows: int, seed: int) -> dict:
    return {
        "logits": logits_V.expand(rows, -1).contiguous(),
        "inv": validate_temperature(temperature_T=[temperature] * rows),
        "seed": torch.full((rows,), seed, dtype=torch.int64),
        "pos": torch.arange(rows, dtype=torch.int64),
    }


def _chisquare_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare

    expected = probs / probs.sum() * counts.sum()
    # Pool cells expecting fewer than 5 draws so the chi-square approximation holds.
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize(
    ("vocab", "width"), [(30, 32), (300, 384)], ids=["one-block", "three-blocks"]
)
def test_sampling_follows_the_tempered_softmax(vocab, width):
    rows, n, start = 4000, 8, 0
    gen = torch.Generator().manual_seed(11)
    logits_V = torch.randn(width, generator=gen) * 1.5
    logits_V[: vocab // 3] += 1.0  # blocks of unequal mass
    logits_V[vocab:] = 40.0
    shard = vocab_shard(rank=0, tp_size=1, padded_vocab=width, vocab_size=vocab)
    counts = {}
    for i, temperature in enumerate((0.5, 1.0, 2.0)):
        case = _one_row_case(logits_V=logits_V, temperature=temperature, rows=rows, seed=100 + i)
        out = head(
            logits_TV=case["logits"],
            shard=shard,
            tp_group=None,
            target_ids_TW=None,
            inv_temperature_T=case["inv"],
            top_k=0,
            sample_n=n,
            seed_T=case["seed"],
            position_T=case["pos"],
            want_entropy=False,
            chunk_rows=1000,
        )
        ids = out.sample_ids_TN.flatten() - start
        assert int(ids.min()) >= 0 and int(ids.max()) < vocab
        counts[temperature] = np.bincount(ids.numpy(), minlength=vocab).astype(np.float64)
        probs = torch.softmax(logits_V[:vocab].double() / temperature, 0).numpy()
        p = _chisquare_p(counts[temperature], probs)
        assert p > 1e-3, f"T={temperature}: chi-square p={p:.2e}"
    # Negative controls: the same test rejects draws checked against a neighbouring temperature.
    for drawn, wrong in ((1.0, 1.15), (0.5, 0.6), (2.0, 1.0)):
        probs = torch.softmax(logits_V[:vocab].double() / wrong, 0).numpy()
        p = _chisquare_p(counts[drawn], probs)
        assert p < 1e-3, f"draws at T={drawn} passed as T={wrong} (p={p:.2e})"


def test_a_shard_starting_inside_a_block_samples_its_own_softmax():
    # TP rank 1 of 2 over 640 padded ids: the shard starts at id 320, in the middle of a
    # sampling block, so its 300 real ids form blocks of 64, 128 and 108.
    shard = vocab_shard(rank=1, tp_size=2, padded_vocab=640, vocab_size=620)
    assert shard.start % SAMPLE_BLOCK == SAMPLE_BLOCK // 2 and shard.valid_size == 300
    rows, n = 4000, 8
    gen = torch.Generator().manual_seed(12)
    z_V = torch.randn(shard.size, generator=gen) * 1.5
    z_V[:100] += 1.0
    keys_RN = stream_keys(
        seed_T=torch.full((rows,), 77, dtype=torch.int64),
        position_T=torch.arange(rows, dtype=torch.int64),
        sample_n=n,
    )
    _, id_RN, zwin_RN = local_samples(
        z_RV=z_V.expand(rows, -1).contiguous(), keys_RN=keys_RN, shard=shard
    )
    local = id_RN.flatten() - shard.start
    assert int(local.min()) >= 0 and int(local.max()) < shard.valid_size
    assert torch.equal(zwin_RN.flatten(), z_V[local])
    counts = np.bincount(local.numpy(), minlength=shard.valid_size).astype(np.float64)
    probs = torch.softmax(z_V[: shard.valid_size].double(), 0).numpy()
    p = _chisquare_p(counts, probs)
    assert p > 1e-3, f"chi-square p={p:.2e}"
    shifted = torch.softmax(z_V[: shard.valid_size].double() * 1.15, 0).numpy()
    assert _chisquare_p(counts, shifted) < 1e-3, "the test cannot tell a wrong distribution"


def _small_args(**overrides) -> dict:
    gen = torch.Generator().manual_seed(3)
    rows = 4
    args = {
        "logits_TV": torch.randn(rows, 64, generator=gen),
        "shard": vocab_shard(rank=0, tp_size=1, padded_vocab=64, vocab_size=60),
        "tp_group": None,
        "target_ids_TW": torch.zeros(rows, 2, dtype=torch.int64),
        "inv_temperature_T": torch.ones(rows),
        "top_k": 5,
        "sample_n": 2,
        "seed_T": torch.zeros(rows, dtype=torch.int64),
        "position_T": torch.arange(rows, dtype=torch.int64),
        "want_entropy": True,
    }
    args.update(overrides)
    return args


def test_small_args_are_valid():
    out = head(**_small_args())
    assert tuple(out.topk_ids_TK.shape) == (4, 5)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_validate_temperature_rejects(temperature):
    with pytest.raises(ValueError, match="finite number > 0"):
        validate_temperature(temperature_T=[1.0, temperature])


def test_validate_temperature_rejects_overflowing_reciprocal():
    with pytest.raises(ValueError, match="overflows float32"):
        validate_temperature(temperature_T=[1e-45])
    torch.testing.assert_close(
        validate_temperature(temperature_T=torch.tensor([0.5, 2.0])), torch.tensor([2.0, 0.5])
    )


nan, inf = float("nan"), float("inf")
_rows4 = torch.ones(4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"inv_temperature_T": torch.tensor([1.0, 0.0, 1.0, 1.0])}, "finite values > 0"),
        ({"inv_temperature_T": torch.tensor([1.0, nan, 1.0, 1.0])}, "finite values > 0"),
        ({"inv_temperature_T": torch.tensor([1.0, inf, 1.0, 1.0])}, "finite values > 0"),
        ({"inv_temperature_T": torch.ones(3)}, r"shape \[4\]"),
        ({"top_k": 61}, "exceeds the vocabulary size"),
        ({"top_k": -1}, "top_k must be"),
        ({"sample_n": -2}, "sample_n must be"),
        ({"target_ids_TW": torch.tensor([[0], [1], [2], [60]])}, "target ids must lie"),
        ({"target_ids_TW": torch.tensor([[0], [1], [2], [-1]])}, "target ids must lie"),
        ({"target_ids_TW": torch.zeros(5, 2, dtype=torch.int64)}, "has 5 rows"),
        ({"target_ids_TW": torch.zeros(4, 2, dtype=torch.int32)}, "int64"),
        ({"logits_TV": torch.zeros(4, 63)}, "width 63"),
        ({"logits_TV": torch.zeros(4, 64, dtype=torch.int64)}, "float tensor"),
        ({"seed_T": None}, "seed_T is required"),
        ({"position_T": torch.zeros(4, dtype=torch.int32)}, "position_T must be an int64"),
        ({"seed_T": torch.zeros(3, dtype=torch.int64)}, r"seed_T must be an int64 tensor"),
        ({"chunk_rows": 0}, "chunk_rows"),
        ({"shard": VocabShard(start=64, size=64, vocab_size=100)}, "is not the shard"),
    ],
)
def test_invalid_arguments_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        head(**_small_args(**overrides))


@pytest.mark.parametrize("bad", [nan, inf])
def test_nonfinite_logits_raise(bad):
    logits = torch.randn(4, 64)
    logits[2, 7] = bad
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        head(**_small_args(logits_TV=logits))
    masked = torch.randn(4, 64)
    masked[1, :60] = -inf  # no finite logit left in row 1
    with pytest.raises(ValueError, match="first rows \\[1\\]"):
        head(**_small_args(logits_TV=masked, top_k=0))


def test_head_outputs_map_applies_to_every_tensor():
    out = head(**_small_args(top_k=3, sample_n=2, want_entropy=True))
    doubled = out.map(lambda t: t * 2)
    for f in dataclasses.fields(out):
        assert torch.equal(getattr(doubled, f.name), getattr(out, f.name) * 2), f.name
    no_entropy = head(**_small_args(want_entropy=False))
    assert no_entropy.map(lambda t: t * 2).entropy_T is None


def test_merge_order_is_value_then_lowest_id():
    vals = torch.tensor([1.0, 1.0, -0.0, 0.0, float("-inf"), float("-inf"), 2.5, -3.0])
    ids = torch.tensor([9, 4, 7, 3, 1, 0, 8, 2])
    order = torch.argsort(head_common.order_key(vals, ids), descending=True)
    # Independent statement of the rule: sort by (-value, id) in Python.
    want = sorted(range(len(ids)), key=lambda i: (-float(vals[i]), int(ids[i])))
    assert order.tolist() == want


def test_vocab_shard_layout():
    shards = [vocab_shard(rank=r, tp_size=4, padded_vocab=1024, vocab_size=1000) for r in range(4)]
    assert [s.start for s in shards] == [0, 256, 512, 768]
    assert [s.valid_size for s in shards] == [256, 256, 256, 232]
    with pytest.raises(ValueError, match="not a multiple"):
        vocab_shard(rank=0, tp_size=3, padded_vocab=1024, vocab_size=1000)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_shard(rank=0, tp_size=2, padded_vocab=1024, vocab_size=1025)


def test_chunked_head_rejects_mismatches():
    shard = vocab_shard(rank=0, tp_size=1, padded_vocab=64, vocab_size=60)
    args = _small_args()
    del args["logits_TV"]
    args["shard"] = shard
    with pytest.raises(ValueError, match="disagree"):
        chunked(hidden_TH=torch.zeros(4, 8), weight_VH=torch.zeros(64, 9), **args)
    with pytest.raises(ValueError, match="one float dtype"):
        chunked(
            hidden_TH=torch.zeros(4, 8), weight_VH=torch.zeros(64, 8, dtype=torch.float64), **args
        )
    with pytest.raises(ValueError, match="width 63"):
        chunked(hidden_TH=torch.zeros(4, 8), weight_VH=torch.zeros(63, 8), **args)


def _hidden_args(logits_TV: torch.Tensor) -> dict:
    """chunked_head arguments whose logits are `logits_TV`: identity hidden states."""
    args = _small_args()
    del args["logits_TV"]
    return {**args, "hidden_TH": logits_TV, "weight_VH": torch.eye(logits_TV.shape[1])}


def test_a_deferred_head_gives_the_same_outputs_and_raises_only_when_collected():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    want = chunked(**_hidden_args(logits))
    pending = chunked(**_hidden_args(logits), deferred=True)
    got = pending.result()
    for f in dataclasses.fields(HeadOutputs):
        a, b = getattr(want, f.name), getattr(got, f.name)
        assert (a is None and b is None) or torch.equal(a, b), f.name
    bad = logits.clone()
    bad[2, 7] = nan
    pending = chunked(**_hidden_args(bad), deferred=True)  # queued: no error yet
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        pending.result()


def _consumer_imports(path) -> set[str]:
    """Every consumer.* module a source file imports (at any depth of the file)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found.update(n for n in [node.module, *names] if n.startswith("consumer"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("consumer"))
    return found


def test_head_imports_run_one_way():
    """The head's import rule (docs/architecture.md) holds in the source: the leaf
    imports neither path, the fused kernels never import tp_ops, and of tp_ops only the
    drivers import the kernels."""
    from pathlib import Path

    consumer = Path(tp_ops.__file__).resolve().parents[1]
    leaf = _consumer_imports(consumer / "head_common.py")
    assert leaf == set(), leaf
    for path in (consumer / "kernels").glob("*.py"):
        bad = {m for m in _consumer_imports(path) if m.startswith("consumer.tp_ops")}
        assert not bad, (path.name, bad)
    modules = sorted((consumer / "tp_ops").glob("*.py"))
    assert {p.stem for p in modules} >= {"drivers", "local", "exchange", "random_source"}
    for path in modules:
        bad = {m for m in _consumer_imports(path) if m.startswith("consumer.kernels")}
        if path.stem == "drivers":
            assert bad == {"consumer.kernels"}, bad  # the loader only
        elif path.stem != "__init__":
            assert not bad, (path.name, bad)
    init = _consumer_imports(consumer / "tp_ops" / "__init__.py")
    assert not {m for m in init if m.startswith("consumer.kernels")}, init
