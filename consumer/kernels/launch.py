"""Launch a Triton kernel, or only compile it: what `consumer/serve/precompile.py` needs.

A compile-only call goes through the kernel's own `warmup` (Triton's ahead-of-time path: the
same argument binding, specialization and cache key as a launch, no launch), so what it
writes into TRITON_CACHE_DIR is what a later launch with the same kinds of arguments loads.
`Shaped` stands in for a tensor there: Triton reads a pointer argument's dtype and whether
its address is 16-byte aligned; a fresh allocation always is, so `data_ptr` is 0.
This module imports neither torch nor Triton.
"""

from __future__ import annotations

from typing import Any


class Shaped:
    """A tensor as a compile-only launch sees it: dtype, shape and strides, aligned address."""

    def __init__(self, dtype: Any, shape: tuple[int, ...], strides: tuple[int, ...] | None = None):
        self.dtype = dtype
        self.shape = shape
        if strides is None:  # contiguous
            strides, step = (), 1
            for size in reversed(shape):
                strides, step = (step, *strides), step * max(size, 1)
        self._strides = strides

    def data_ptr(self) -> int:
        """An aligned address (what Triton specializes a pointer on)."""
        return 0

    def ptr_range(self) -> int:
        """A 32-bit pointer range, as Triton's own MockTensor assumes (backends that ask)."""
        return 0

    def stride(self, dim: int | None = None) -> Any:
        """The strides, as torch.Tensor.stride answers."""
        return self._strides if dim is None else self._strides[dim]

    def contiguous(self) -> Shaped:
        """Itself: the wrappers call this only on operands that are contiguous already."""
        return self

    def __getitem__(self, _rows: slice) -> Shaped:
        """A row slice at an aligned offset (rows in whole chunks), as the wrappers take."""
        return self


def launch(kernel: Any, grid: Any, *args: Any, compile_only: bool = False, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)`, or with `compile_only` its compilation alone (into
    Triton's cache, nothing runs on the device)."""
    if compile_only:
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)
