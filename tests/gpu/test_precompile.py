"""The precompile workers' compile-only path (consumer/kernels/launch.py) leaves the first
real launch nothing to build: neither the kernel nor, on Triton releases that compile one per
kernel signature, its host-side launcher module."""

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

REPO = Path(__file__).resolve().parents[2]
COMPILE = """
import sys
from pathlib import Path
import torch
from consumer.kernels import launch, swiglu
if len(sys.argv) > 1:  # as a precompile worker: launchers claimed in a shared folder
    launch.share_launchers(Path(sys.argv[1]))
swiglu.precompile(ffn=1408, dtype=torch.bfloat16)
"""
LAUNCH = """
import torch
from consumer.kernels import swiglu
x = torch.randn(5, 2 * 1408, device="cuda", dtype=torch.bfloat16)
out = swiglu.swiglu(x)
gate, up = x.float().chunk(2, dim=-1)
torch.testing.assert_close(out.float(), torch.nn.functional.silu(gate) * up, atol=2e-2, rtol=2e-2)
"""


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("shared", [False, True])
def test_a_launch_after_precompile_builds_nothing(tmp_path: Path, shared: bool) -> None:
    cache, claims = tmp_path / "triton", tmp_path / "claims"
    claims.mkdir()
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    for code in (COMPILE, LAUNCH):
        if code is LAUNCH:
            compiled = _files(cache)
        argv = [sys.executable, "-c", code, *([str(claims)] if shared and code is COMPILE else [])]
        out = subprocess.run(argv, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
    assert compiled, "the compile-only call wrote nothing"
    assert _files(cache) == compiled  # the launch found its kernel and launcher in the cache
