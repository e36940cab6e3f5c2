"""FP8 block-quantized checkpoints (#40), in the format DeepSeek-V3 and the `-FP8` releases
publish: tiny checkpoints written by transformers are quantized here by an independent
reference quantizer (block-wise absmax / 448 to float8_e4m3fn, float32 `weight_scale_inv` per
block), and the loaded teacherq model must hold exactly the reference dequantization and score
as transformers does on the dequantized checkpoint, at TP=1 and TP=2. Block sizes are small and
odd (so tiny tensors span several blocks, ragged at their edges) and non-square."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from consumer.checkpoints.validate import CheckpointError
from consumer.group.batching import batch_from_jobs
from tests.fp8_reference import (
    VOCAB,
    dequantize_blockwise,
    fp8_jobs,
    quantize_blockwise,
    write_fp8_pair,
)
from tests.gloo import run_gloo
from tests.reference import hf_full_log_softmax
from tests.timing import scaled

ATOL = 2e-3
MOE = {"num_layers": 2, "num_experts": 4, "top_k": 2, "moe_intermediate_size": 32}
CASES = {
    # name: (family, config sizes, weight_block_size); the blocks of each divide its TP=2 shares
    "qwen3": ("qwen3", {}, [16, 32]),
    "qwen3_moe": ("qwen3_moe", MOE, [16, 16]),
    "deepseek_v3": ("deepseek_v3", {**MOE, "first_k_dense_replace": 1}, [8, 8]),
}
# ragged blocks (24 rows, 40 columns: neither divides 64 or 128): loads at TP=1; at TP=2 each
# rank's 32 q rows would cut a block, which is refused
RAGGED = ("qwen2", {}, [24, 40])


@pytest.fixture(scope="module")
def pairs(hf_checkpoint, tmp_path_factory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, (family, sizes, block) in {**CASES, "ragged": RAGGED}.items():
        kv_heads = 4 if family == "deepseek_v3" else 2
        source = hf_checkpoint(
            family, f"fp8-src-{name}", seed=11, vocab_size=VOCAB, num_kv_heads=kv_heads, **sizes
        )
        fp8, ref = write_fp8_pair(source, root / name, block)
        out[name] = (str(fp8), str(ref))
    return out


def _score(path: str, layout) -> list[dict]:
    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward.scoring import Scorer

    model, spec = load_hf_checkpoint(path, layout)
    scorer = Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu"))
    return scorer.score(batch_from_jobs(fp8_jobs()))


def _check_against_transformers(ref_path: str, got: list[dict]) -> None:
    for job, out in zip(fp8_jobs(), got, strict=True):
        ids = np.asarray(job.request.input_ids)
        ref = hf_full_log_softmax(ref_path, ids)
        np.testing.assert_allclose(out["logprobs"], ref[np.arange(len(ids) - 1), ids[1:]],
                                   atol=ATOL, rtol=0)  # fmt: skip
        top = np.argsort(-ref, axis=-1, kind="stable")[:, :3]
        np.testing.assert_array_equal(out["topk_token_ids"], top)


def test_reference_quantizer_is_lossy_but_close():
    """The reference round trip changes weights (so the tests below could tell the FP8 values
    from the originals) but stays within e4m3's 2^-3 relative step of each block's absmax."""
    w = torch.randn(50, 70, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_blockwise(w, [16, 32])
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 3)
    back = dequantize_blockwise(q, scale, [16, 32])
    assert not torch.equal(back, w)
    assert (back - w).abs().max() <= w.abs().max() / 8


@pytest.mark.parametrize("name", [*CASES, "ragged"])
def test_loaded_weights_equal_reference_dequantization(name, pairs, layout):
    """Every parameter teacherq loads from the FP8 checkpoint equals, bit for bit, the one it
    loads from the reference dequantization (fused QKV, gate/up, experts, latent attention and
    all): the stored value times its block scale, wherever the block edges fall."""
    from consumer.checkpoints import load_hf_checkpoint

    fp8_path, ref_path = pairs[name]
    got, _ = load_hf_checkpoint(fp8_path, layout)
    want, _ = load_hf_checkpoint(ref_path, layout)
    want_params = dict(want.named_parameters())
    for pname, p in got.named_parameters():
        assert torch.equal(p, want_params[pname]), pname


def test_sliced_read_reads_exactly_its_blocks(pairs):
    """A slice that starts and ends inside blocks dequantizes exactly as the whole tensor does."""
    from consumer.checkpoints.hf_files import HfCheckpoint

    fp8_path, ref_path = pairs["ragged"]
    name = "model.layers.1.mlp.down_proj.weight"
    with HfCheckpoint(fp8_path) as ckpt, HfCheckpoint(ref_path) as ref:
        assert ckpt.fp8 is not None and name in ckpt.scales
        whole = ref.read(name)
        assert torch.equal(ckpt.read(name), whole)
        assert torch.equal(ckpt.read(name, rows=slice(5, 50), cols=slice(30, 97)),
                           whole[5:50, 30:97])  # fmt: skip


@pytest.mark.parametrize("name", [*CASES, "ragged"])
def test_logprobs_match_transformers_on_dequantized(name, pairs, layout):
    """Log-probs and top-k of a packed batch scored from the FP8 checkpoint equal transformers'
    float32 forward on the dequantized checkpoint."""
    fp8_path, ref_path = pairs[name]
    _check_against_transformers(ref_path, _score(fp8_path, layout))


def _split_worker(rank: int, world: int, paths: dict[str, str], tp: int = 2, ep: int = 1):
    from consumer import cpu_compat
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=tp, pp=1, ep=ep)
    out = {name: _score(path, layout) for name, path in paths.items()}
    return out if layout.is_leader else None


def test_tp2_matches_transformers(pairs):
    """At TP=2 (gloo) each rank reads and dequantizes its own slice of weights and scales; the
    scores still equal transformers' on the dequantized checkpoint."""
    paths = {name: pairs[name][0] for name in CASES}
    scored = run_gloo(2, _split_worker, paths, timeout=scaled(300))[0]
    for name in CASES:
        _check_against_transformers(pairs[name][1], scored[name])


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 2)], ids=["ep2", "tp2xep2"])
def test_moe_fp8_at_expert_parallel_layouts_matches_transformers(pairs, tp, ep):
    """The mixture-of-experts FP8 checkpoints (Qwen3-MoE, DeepSeek-V3) at EP=2 and TP=2 x EP=2
    on gloo: each rank reads its experts' FP8 blocks and scales; the scores equal
    transformers' on the dequantized checkpoint."""
    moe = [name for name in CASES if CASES[name][0] != "qwen3"]
    paths = {name: pairs[name][0] for name in moe}
    scored = run_gloo(max(tp, ep), _split_worker, paths, tp, ep, timeout=scaled(300))[0]
    for name in moe:
        _check_against_transformers(pairs[name][1], scored[name])


def test_split_cutting_blocks_is_refused(pairs):
    """TP=2 on 24-row blocks would give each rank 32 q rows: refused before any load, naming
    the tensor, the block size setting and the layout."""
    from consumer.checkpoints.teacher import check_teacher

    with pytest.raises(CheckpointError) as err:
        check_teacher(pairs["ragged"][0], tp=2)
    msg = str(err.value)
    assert "q_proj" in msg and "weight_block_size [24, 40]" in msg and "tp=2" in msg


def test_probe_and_validation_accept_fp8(pairs):
    """`teacherq update-weights`' probe and the consumers' full header check accept an FP8
    checkpoint (scales included in the inventory) for every family here."""
    from consumer.checkpoints.teacher import check_teacher
    from shared.checkpoint_probe import probe_checkpoint

    for name, (fp8_path, _) in pairs.items():
        assert probe_checkpoint(fp8_path) == "hf"
        spec = check_teacher(fp8_path, tp=1)
        assert spec.vocab_size == VOCAB, name


def _rewrite_config(src: str, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"weight_block_size": None}, "weight_block_size"),
        ({"quant_method": "gptq"}, "quant_method"),
    ],
)
def test_unsupported_quantization_is_refused(changes, field, pairs, tmp_path):
    """Quantizations other than block-wise dynamic FP8 are refused naming the field."""
    from consumer.checkpoints.teacher import check_teacher

    path = _rewrite_config(pairs["qwen3"][0], tmp_path / "bad", **changes)
    with pytest.raises(CheckpointError, match=f"quantization_config.{field}"):
        check_teacher(path, tp=1)


def test_fp8_weight_without_scale_is_refused(pairs, tmp_path):
    """A float8 tensor stored without its weight_scale_inv is named, not loaded as raw FP8."""
    from consumer.checkpoints.teacher import check_teacher

    dst = tmp_path / "noscale"
    shutil.copytree(pairs["qwen3"][0], dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.weight: stored in FP8 without"):
        check_teacher(dst, tp=1)


def test_fp8_setting_reads_and_refuses(monkeypatch):
    """`TEACHERQ_MODEL__FP8` takes `auto` or `dequantize` and refuses anything else naming the
    variable; on the CPU both dequantize, and the reason says which one decided."""
    from consumer.checkpoints.hf_fp8 import Fp8Format, fp8_compute_problem
    from shared.settings import Settings, SettingsError, load_settings

    assert Settings().model.fp8 == "auto"
    monkeypatch.setenv("TEACHERQ_MODEL__FP8", "dequantize")
    assert load_settings().model.fp8 == "dequantize"
    monkeypatch.setenv("TEACHERQ_MODEL__FP8", "fp8")
    with pytest.raises(SettingsError, match="TEACHERQ_MODEL__FP8"):
        load_settings()
    fmt = Fp8Format(128, 128)
    assert fp8_compute_problem("auto", "cpu", fmt) == "no FP8 GEMM on cpu"
    assert fp8_compute_problem("dequantize", "cpu", fmt) == "model.fp8=dequantize"
    assert "128x128" in str(fp8_compute_problem("auto", "cpu", Fp8Format(16, 32)))
