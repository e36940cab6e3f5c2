"""The sampling kernel (consumer/kernels/gumbel.py) under Triton's CPU interpreter.

The CUDA tests (tests/gpu) run the compiled kernel; this one runs its logic on a machine
without a GPU, so CI sees a change that breaks it. Each case runs in a fresh interpreter,
since TRITON_INTERPRET is read when the kernels are defined. Samples must equal the PyTorch
reference bit for bit: ids, block keys and tempered logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np
    import torch
    import triton.runtime.interpreter as interpreter

    # Triton 3.6's interpreter turns a runtime loop bound into a Python int with
    # int(ndarray of shape (1,)), which numpy >= 2.4 refuses; take the element instead.
    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        patch = interpreter._patch_lang_tensor

        def _patched(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda t: int(t.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = _patched

    from consumer import tp_ops
    from consumer.kernels import gumbel

    start, valid, width, n, per_program = (int(a) for a in sys.argv[1:])
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
    want = tp_ops._local_samples(z, keys, shard)
    gumbel.CONFIG.samples_per_program = per_program
    got = gumbel.gumbel_argmax(
        logits_RV=logits, inv_temperature_R=inv, keys_RN=keys, start=start, valid=valid
    )
    for name, w, g in zip(("key", "id", "z"), want, got, strict=True):
        assert torch.equal(w, g), (name, w, g)
    print("ok")
    """
)


@pytest.mark.parametrize(
    ("start", "valid", "width", "n", "per_program"),
    [
        (0, 1000, 1024, 8, 16),  # a whole vocabulary, the last block partial
        (320, 300, 320, 3, 16),  # a shard starting 64 ids into a block
        (128, 256, 256, 20, 16),  # 16 + 4 samples: two programs a row
        (0, 100, 128, 5, 2),  # one block, three programs a row
    ],
)
def test_interpreted_kernel_matches_the_reference(start, valid, width, n, per_program):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *map(str, (start, valid, width, n, per_program))],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
