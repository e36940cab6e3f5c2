"""consumer/serve/bake.py: a consumer's kernels compiled for sm90 without a GPU, as a seed for
its compile cache. What is checked here: the seed holds one compiled kernel per variant of
the plan and a record of them, and a cache seeded from it is what the same compiles then
find, writing nothing new (Triton computes the same key for them: the target's architecture,
not a device, is in it). That an H100 computes that key too is for tests/gpu."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip("triton")

from consumer.serve.compile_cache import SEED, apply, environment_key, seed

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("--kernel", "swiglu", "--kernel", "rope")  # a few of the tiny plan's: quick


def _bake(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "consumer.serve.bake", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def _kernels(folder: Path) -> set[str]:
    return {str(f.relative_to(folder)) for f in (folder / "triton").rglob("*") if f.is_file()}


def test_a_baked_seed_is_what_the_same_compiles_then_find(tmp_path: Path) -> None:
    out = tmp_path / "seed"
    done = _bake(out, *KERNELS)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""  # a summary line on stderr, nothing on stdout
    record = json.loads((out / SEED).read_text())
    assert record["capability"] == 90
    assert record["key"]["triton"] == metadata.version("triton")
    names = record["variants"]
    assert names and {n.split()[0] for n in names} == {"swiglu", "rope"}
    assert sum(f.endswith(".cubin") for f in record["files"]) == len(names)  # one each, sm90
    assert f"{len(names)} of {len(names)} variants compiled" in done.stderr

    cache = apply(tmp_path / "root", tmp_path, {}, key=environment_key())
    assert cache.path is not None and seed(cache, out) == len(record["files"])
    seeded = _kernels(cache.path)
    again = _bake(cache.path, *KERNELS)  # the same compiles, into the seeded cache
    assert again.returncode == 0, again.stderr[-2000:]
    assert _kernels(cache.path) == seeded  # every kernel found there: nothing compiled


def test_a_missing_or_refused_config_is_named_in_one_line(tmp_path: Path) -> None:
    done = _bake(tmp_path / "seed", "--config", str(tmp_path / "no-model"))
    assert done.returncode == 78
    assert done.stderr.strip().splitlines() == [
        f"teacherq bake: --config: no config.json in {tmp_path / 'no-model'}"
    ]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-family"}))
    done = _bake(tmp_path / "seed", "--config", str(bad))
    [line] = done.stderr.strip().splitlines()
    assert done.returncode == 78 and line.startswith(f"teacherq bake: {bad}/config.json: ")
    assert "no-such-family" in line


def test_the_bake_plans_what_each_rank_s_workers_plan_on_an_sm90_gpu(
    hf_checkpoint, tmp_path, monkeypatch
) -> None:
    """The bake's plan is the union of every tensor-parallel rank's precompile plan (each
    rank's vocabulary shard is its own head-pass variant), with FP8 kernels for an FP8
    checkpoint where torch's CUDA build has block-scaled FP8 GEMMs, as a worker on an sm90 GPU
    decides (`precompile.model_shape`, `fp8_gemm.cuda_problem`)."""
    import torch

    from consumer.serve import precompile
    from consumer.serve.bake import bake_plan
    from shared.settings import Settings

    source = hf_checkpoint("qwen2", "bake-src", seed=5, hidden_size=128, intermediate_size=256)
    config = json.loads((source / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    settings = Settings()
    settings = settings.model_copy(update={
        "parallel": settings.parallel.model_copy(update={"tp": 2}),
        "model": settings.model.model_copy(update={"dtype": "bfloat16"}),
    })  # fmt: skip
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    baked = bake_plan(settings, str(tmp_path))
    spec, fp8 = precompile.model_shape(str(tmp_path))
    ranks = [precompile.warmup_plan(
        spec, tp=2, tp_rank=r, ep=1, dtype=torch.bfloat16, fp8=True,
        max_top_k=settings.queue.max_top_k, max_sample_n=settings.queue.max_sample_n,
        token_budget=settings.consumer.token_budget, full=True,
    ) for r in (0, 1)]  # fmt: skip
    assert fp8 and set(baked) == set(ranks[0]) | set(ranks[1])
    assert set(ranks[1]) - set(ranks[0]) and "fp8_quant" in {v.kernel for v in baked}
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # dequantized at load there
    assert "fp8_quant" not in {v.kernel for v in bake_plan(settings, str(tmp_path))}
