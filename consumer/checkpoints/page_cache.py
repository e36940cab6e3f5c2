"""Bringing a file's bytes into the page cache, and taking them out: the primitives under the
loader's read-ahead (`parallel_read`) and the start-up prefetch (`prefetch`). No torch here:
the prefetch runs before torch is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path

# Linux 5.14+ (Python names it from 3.12 on; its value is fixed by the kernel's ABI)
_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else 0)
_populate_works = _POPULATE_READ != 0


def populate(mapped: mmap.mmap, start: int, end: int) -> bool:
    """Fault [start, end) of `mapped` in (read from disk where not cached, and mapped); False
    where the kernel has no MADV_POPULATE_READ (then never asked again).

    The call goes to libc through ctypes, which lets go of the GIL while the kernel reads:
    Python's own `mmap.madvise` holds it, so every other thread of the process (the loader's
    copies, the other readers) would stop for each chunk's read from disk."""
    global _populate_works
    if not _populate_works:
        return False
    aligned = start - start % mmap.PAGESIZE
    end = min(end, len(mapped))  # (a header may promise more than a truncated file holds)
    if end <= aligned:
        return True
    address = _address(mapped)
    try:
        if address is None:  # a read-only map: ctypes cannot take its address
            mapped.madvise(_POPULATE_READ, aligned, end - aligned)
        elif _madvise(address + aligned, end - aligned, _POPULATE_READ) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _populate_works = False  # a kernel before 5.14
        return False
    return True


def _address(mapped: mmap.mmap) -> int | None:
    """Where `mapped` starts in this process's memory; None for a map ctypes cannot view (a
    read-only one). The view is let go at once, so the map can still be closed."""
    try:
        view = ctypes.c_char.from_buffer(mapped)
    except TypeError:
        return None
    try:
        return ctypes.addressof(view)
    finally:
        del view


_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int


def pread_range(fd: int, start: int, end: int, buffer: bytearray) -> int:
    """Read [start, end) of `fd` through `buffer` (and so into the page cache); bytes read."""
    done = 0
    view = memoryview(buffer)
    while start + done < end:
        n = os.preadv(fd, [view[: min(len(buffer), end - start - done)]], start + done)
        if n <= 0:
            break  # the file is shorter than its header says: the loader will say so
        done += n
    return done


def page_cached(fd: int, at: int) -> bool:
    """Whether the page cache holds the byte at `at` of `fd`: a one-byte read that would wait
    on the disk fails at once with `RWF_NOWAIT` (and starts reading its page)."""
    with contextlib.suppress(BlockingIOError):
        return os.preadv(fd, [bytearray(1)], at, os.RWF_NOWAIT) == 1
    return False


def cached_share(spans: Iterable[tuple[Path, int, int]], samples: int = 64) -> float | None:
    """The share of `samples` pages, spread evenly over the bytes of `spans` ((file, start,
    end)), that the page cache holds; None where it cannot be told (no `RWF_NOWAIT`). A probe
    that misses starts reading its page (that page alone), so the answer costs a few reads."""
    spans = [s for s in spans if s[2] > s[1]]
    total = sum(end - start for _, start, end in spans)
    if not total or not hasattr(os, "RWF_NOWAIT"):
        return None
    step = max(1, total // samples)
    hits = probes = 0
    fds: dict[Path, int] = {}
    try:
        offset = 0
        for path, start, end in spans:
            for at in range(start + (-offset) % step, end, step):
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                    # a miss then reads its own page only: with the kernel's readahead around
                    # it, the next probe could find its page read by this one's miss
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                probes += 1
                hits += page_cached(fd, at)
            offset += end - start
    except OSError:  # EOPNOTSUPP (a filesystem without it), a file gone
        return None
    finally:
        for fd in fds.values():
            os.close(fd)
    return hits / probes if probes else None


def available_memory() -> int | None:
    """Bytes of memory this process can still fill without evicting what others use: the
    kernel's MemAvailable, or less where a cgroup (a container's limit) leaves less; None
    where neither can be read."""
    found = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
                break
    with contextlib.suppress(OSError, ValueError):
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int((cgroup / "memory.current").read_text())
            found = left if found is None else min(found, left)
    return None if found is None else max(found, 0)


def evict(paths: Iterable[Path]) -> None:
    """Drop `paths`' pages from the page cache (written back first, so that they can be), as
    a fresh machine has them; no root needed. For measuring cold loads (bench/checkpoint_read.py
    and the tests)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
