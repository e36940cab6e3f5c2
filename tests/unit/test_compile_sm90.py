"""scripts/compile_sm90.py: the Hopper kernels compile for sm_90a without a GPU.

The interpreted tests run the kernels' arithmetic on the CPU but never compile them; a change
that Triton cannot lower for Hopper (a layout, a descriptor, shared memory past the limit)
would otherwise surface only on the GPU machine. This compiles what a DeepSeek-V3 consumer's
warm-up compiles for the expert GEMMs (bf16 and FP8) and latent attention with the installed
Triton, in a process of its own (the script swaps Triton's active driver for a stand-in).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("--kernel", "expert_gemm", "--kernel", "mla_attention")


def _compile(*args: str) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "scripts" / "compile_sm90.py"), "--json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_deepseek_kernels_compile_for_hopper_on_the_tensor_cores(fp8):
    rows = _compile("--shape", "deepseek-v3", *KERNELS, *(["--fp8"] if fp8 else []))
    by_kernel: dict[str, list[dict]] = {}
    for row in rows:
        by_kernel.setdefault(row["kernel"], []).append(row)
    # both expert GEMMs (gate/up + SwiGLU, down) and the attention kernel
    assert len(by_kernel["_expert_gemm_kernel"]) == 2, rows
    assert len(by_kernel["_mla_attention_kernel"]) == 1, rows
    for row in rows:
        assert row["wgmma"] > 0, row  # Hopper's asynchronous tensor-core instructions
        assert row["shared_bytes"] <= 227 * 1024, row  # an H100's per-block limit
        assert 0 < row["registers"] <= 255, row
    if not fp8:  # the bf16 gate/up GEMM reads its weights through TMA (BF16_TILES)
        assert max(r["tma"] for r in by_kernel["_expert_gemm_kernel"]) > 0, rows


def test_an_unknown_shape_is_refused_by_name():
    cmd = [sys.executable, str(ROOT / "scripts" / "compile_sm90.py"), "--shape", "no-such"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0 and "no-such" in done.stderr
