"""Ask the kernel to read torch's, Triton's and the CUDA libraries' files ahead of the import.

On a fresh machine the page cache is empty, and importing torch (then the CUDA libraries,
cuDNN, cuBLAS, NCCL: gigabytes of shared objects) reads those files page fault by page fault,
one library after another. `main()` calls `start` first: a daemon thread tells the kernel
(posix_fadvise WILLNEED) that every library file will be needed, and the kernel reads them in
the background, at the disk's full rate, while the interpreter starts importing. On a machine
that has the files cached already this costs a few milliseconds. No torch import here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

# Where the big shared objects live in each package (a few directories, not a walk of the
# whole tree: torch holds thousands of files, and the walk would compete with the import).
PATTERNS = {
    "torch": ("lib/*.so*",),
    "triton": ("_C/*.so*", "backends/*/lib/*.so*"),
    "nvidia": ("*/lib/*.so*",),  # the CUDA wheels: cuBLAS, cuDNN, NCCL, ...
}


def library_files(patterns: dict[str, tuple[str, ...]] = PATTERNS) -> list[Path]:
    """The shared objects of the packages in `patterns` (found without importing them),
    largest first: those take longest to read."""
    files = []
    for name, globs in patterns.items():
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            files += [p for g in globs for p in Path(root).glob(g) if p.is_file()]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def bytecode_files(packages: Iterable[str] = ("torch", "triton", "megatron")) -> list[Path]:
    """This interpreter's bytecode files of `packages` (found without importing them): the
    modules the consumer imports lazily, after its start-up import, are read from these."""
    tag = sys.implementation.cache_tag
    files: list[Path] = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            files += Path(root).rglob(f"__pycache__/*.{tag}.pyc")
    return files


def start_files(compile_cache: Path | None) -> list[Path]:
    """What a consumer reads from disk after its import besides the checkpoint, for the
    checkpoint prefetch to read first (consumer/checkpoints/prefetch.py): the bytecode of the
    modules imported later (small files, needed first), the compile cache's kernels, then the
    libraries' shared objects (the CUDA libraries load parts of themselves on first use)."""
    cached = [p for p in compile_cache.rglob("*") if p.is_file()] if compile_cache else []
    return [*bytecode_files(), *cached, *library_files()]


def advise(files: Iterable[Path]) -> int:
    """Tell the kernel each file will be read soon; returns the bytes advised."""
    total = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            total += os.fstat(fd).st_size
        except OSError:
            pass  # a file system without readahead: the import reads it as before
        finally:
            os.close(fd)
    return total


def start() -> threading.Thread | None:
    """Advise the libraries' files on a daemon thread (None where the OS has no fadvise)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(
        target=lambda: advise(library_files()), name="tq-readahead", daemon=True
    )
    thread.start()
    return thread


# The packages whose sources a consumer imports by the thousand: without bytecode each start
# compiles them again (measured on an H200 host whose torch had none: 11.8 s to import the
# consumer, 5.0 s with bytecode).
BYTECODE_PACKAGES = ("torch", "megatron", "triton", "quack", "cutlass")


def without_bytecode(
    packages: Iterable[str] = BYTECODE_PACKAGES, *, dont_write: bool | None = None
) -> list[str]:
    """The packages among `packages` that have no bytecode for their `__init__` and will get
    none (PYTHONDONTWRITEBYTECODE set, or their directory not writable): every start compiles
    their sources. Found without importing them."""
    if dont_write is None:
        dont_write = sys.dont_write_bytecode
    missing = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        cached = Path(importlib.util.cache_from_source(spec.origin))
        if cached.is_file():
            continue
        if dont_write or not os.access(Path(spec.origin).parent, os.W_OK):
            missing.append(name)
    return missing
