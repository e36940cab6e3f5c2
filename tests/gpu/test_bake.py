"""A seed baked without a GPU (consumer/serve/bake.py, Triton's target stood in for) holds
what this sm90 GPU's own compiles look up: compiled again here through the real driver, into
a cache seeded from it, every kernel is found and nothing new is written."""

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
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("a seed is compiled for sm90", allow_module_level=True)

from consumer.serve.compile_cache import apply, environment_key, seed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("rowstats", "swiglu", "rope")
REAL = f"""
import os, sys
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
from consumer.kernels import launch
from consumer.serve.bake import bake_plan
from consumer.serve.precompile import compile_variant
from shared.settings import load_settings
launch.without_launchers()
for variant in bake_plan(load_settings(), None):
    if variant.kernel in {KERNELS!r}:
        compile_variant(variant)  # the device's own target, through the real driver
"""


def _kernels(folder: Path) -> set[str]:
    return {str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file()}


def test_a_seed_baked_without_the_gpu_is_what_it_compiles(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kernels = [arg for k in KERNELS for arg in ("--kernel", k)]
    baked = subprocess.run([sys.executable, "-m", "consumer.serve.bake", str(tmp_path / "seed"),
                            *kernels], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert baked.returncode == 0, baked.stderr[-2000:]
    cache = apply(tmp_path / "root", tmp_path, {}, key=environment_key())
    assert cache.path is not None and seed(cache, tmp_path / "seed") > 0
    triton = cache.path / "triton"
    seeded = _kernels(triton)
    real = subprocess.run([sys.executable, "-c", REAL, str(triton)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert real.returncode == 0, real.stderr[-2000:]
    assert _kernels(triton) == seeded, "the device's compiles missed the seed"
