"""Import megatron-core without importing torch's compiler stack: part of the start's import.

megatron-core decorates its fusions with `torch.compile` at import (`megatron.core.jit`'s
`jit_fuser`). Decorating compiles nothing, but `torch.compile` imports `torch._dynamo` and
inductor on its first call: about a third of the consumer's import phase, for functions the
consumer's forward does not run (its SwiGLU and RoPE are its own kernels). While
`deferred_torch_compile()` is active, `torch.compile(fn)` returns a wrapper that calls the real
`torch.compile` on its first call, so a fusion that does run still runs compiled: only the
import moves to the first call. Megatron itself is not changed (`consumer/cpu_compat.py`
remains the only module that patches it, for the CPU); `torch.compile` is restored on exit.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def _deferred(compile_: Callable[..., Any], fn: Callable[..., Any], kwargs: dict) -> Any:
    compiled: Callable[..., Any] | None = None
    lock = threading.Lock()

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            with lock:
                if compiled is None:
                    compiled = compile_(fn, **kwargs)
        return compiled(*args, **kw)

    return call


@contextmanager
def deferred_torch_compile() -> Iterator[None]:
    """Within: `torch.compile` of a plain function compiles (and imports its compiler) on the
    function's first call, not now; anything else goes to `torch.compile` at once."""
    import torch

    real = torch.compile

    def lazy(model: Any = None, /, **kwargs: Any) -> Any:
        if model is None:  # used as @torch.compile(...): the decorator
            return lambda fn: lazy(fn, **kwargs)
        if not inspect.isfunction(model):  # modules and the like: as asked
            return real(model, **kwargs)
        return _deferred(real, model, kwargs)

    torch.compile = lazy  # type: ignore[assignment]  # restored below
    try:
        yield
    finally:
        torch.compile = real
