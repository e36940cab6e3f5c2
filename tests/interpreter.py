"""What the tests running Triton kernels under its CPU interpreter share: each case runs in a
fresh Python process (TRITON_INTERPRET is read when the kernels are defined), whose script
starts with `INDEX_PATCH` (`run_interpreted`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.timing import scaled

REPO = Path(__file__).resolve().parents[1]

INDEX_PATCH = textwrap.dedent(
    """
    import numpy as np
    import triton.runtime.interpreter as interpreter

    # Triton 3.6's interpreter turns a runtime loop bound into a Python int with
    # int(ndarray of shape (1,)), which numpy >= 2.4 refuses; take the element instead.
    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":
        _patch_lang_tensor = interpreter._patch_lang_tensor

        def _patched(tensor, scope):
            _patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda t: int(t.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = _patched
    """
)


def run_interpreted(script: str, *args: str, timeout: float) -> None:
    """Run `script` (a prelude starting with INDEX_PATCH, then a case) under Triton's
    interpreter in a fresh process, with `args` as its argv; it must end by printing `ok`."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=scaled(timeout),
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
