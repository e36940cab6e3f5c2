"""What the tests running Triton kernels under its CPU interpreter share: each case runs in a
fresh Python process (TRITON_INTERPRET is read when the kernels are defined), whose script
starts with `INDEX_PATCH`."""

from __future__ import annotations

import textwrap

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
