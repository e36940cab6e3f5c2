"""Launch a Triton kernel, or only compile it: what `consumer/serve/precompile.py` needs.

A compile-only call goes through the kernel's own `warmup` (Triton's ahead-of-time path: the
same argument binding, specialization and cache key as a launch, no launch), so what it
writes into TRITON_CACHE_DIR is what a later launch with the same kinds of arguments loads.
A launch's first call also builds the kernel's host-side launcher; a compile-only call
builds it too (`build_launchers`). `Shaped` stands in for a tensor there: Triton reads a
pointer argument's dtype and whether its address is 16-byte aligned; a fresh allocation always
is, so `data_ptr` is 0. This module imports neither torch nor Triton at import.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

_claims: list[Path] = []  # where the precompile workers of one start claim launchers
_no_launchers: list[bool] = []  # set by `without_launchers`: compiles only


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
    Triton's cache, nothing runs on the device), its host-side launcher included."""
    if compile_only:
        build_launchers(kernel.warmup(*args, grid=grid, **kwargs))
    else:
        kernel[grid](*args, **kwargs)


def build_launchers(compiled: Any) -> None:
    """Build the host-side launcher of each compiled kernel (`warmup` returns one, or a list
    where the kernel is autotuned) as its first launch would, without loading it on a device.
    Up to Triton 3.6 that compiles a small C module per kernel signature with the host's C
    compiler, about 0.4 s each, into the same cache: left to the first launch, a fresh 1.5B
    consumer spent 1.4 s of its warm-up there (docs/benchmarks.md, cold-start run 12). Later
    Triton releases build no module, and this costs nothing. Under `share_launchers`, only
    the launchers this process is the first to claim."""
    if _no_launchers:
        return
    from triton.runtime import driver

    for kernel in compiled if isinstance(compiled, list) else [compiled]:
        if kernel is not None and first_to_claim(kernel):  # (None: a test's stand-in)
            driver.active.launcher_cls(kernel.src, kernel.metadata)


def without_launchers() -> None:
    """From now on compile-only calls build no launcher: where no CUDA driver is loaded (a
    bake on a machine without a GPU, consumer/serve/bake.py), the C module cannot link. The
    consumer's precompile workers build them at its start."""
    _no_launchers[:] = [True]


def stand_in_driver(capability: int = 90) -> None:
    """Make Triton's NVIDIA backend the active driver with an sm_`capability` target, without
    touching CUDA: compiling needs the target only. A kernel compiled so has the cache key a
    compile on such a GPU computes (Triton's key holds the target's architecture, not the
    device)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    class StandIn(CudaDriver):
        def __init__(self) -> None:  # CudaDriver's own loads libcuda
            self.backend = "cuda"

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: Any = None) -> int:
            return 0

        def get_active_torch_device(self) -> Any:
            import torch

            return torch.device("cpu")

    driver.set_active(StandIn())


def share_launchers(claims: Path) -> None:
    """From now on `build_launchers` builds a launcher only where no other process sharing
    the folder `claims` has claimed its kind: one C compile per kind among the precompile
    workers of a start, not one per worker."""
    _claims[:] = [claims]


def first_to_claim(kernel: Any) -> bool:
    """Whether this process should build `kernel`'s launcher: always, unless `share_launchers`
    was called; then only if it is the first to claim the kernel's argument types (what the
    launcher's C source is made of), by creating a file named for them."""
    if not _claims:
        return True
    kinds = repr(tuple(kernel.src.signature.values())).encode()
    try:
        os.close(
            os.open(_claims[0] / hashlib.sha256(kinds).hexdigest()[:24], os.O_CREAT | os.O_EXCL)
        )
    except FileExistsError:
        return False
    return True
