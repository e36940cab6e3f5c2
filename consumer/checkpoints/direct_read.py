"""Read a checkpoint's bytes straight into staging memory, group by group, ahead of the loader.

The other way in (`parallel_read`) brings pages into the page cache and lets the loader copy
out of its memory map: the bytes cross memory twice (disk -> page cache -> staging) and the
kernel reads through its page-cache machinery. `DirectStage` reads each group's spans with
`O_DIRECT` (the disk's DMA lands in the buffer; nothing stays cached), on a few threads, into
page-locked memory where the model lives on a GPU, so a tensor the readers take whole goes to
the device with no copy on the host. Where the filesystem refuses `O_DIRECT` (tmpfs, some
overlays) the same reads go through the page cache instead.

The loader reads group i through `view(i)`: a checkpoint whose reads of staged bytes return
views of the staging buffer, and whose other reads (a span the plan missed, an FP8 tensor
dequantized with its scales, a group whose read failed) go to the memory map as before, so a
stage can make a load faster but never different. `advance(i)` hands group i's buffer back.
At most `window` bytes are staged and not yet released (one group larger than that is read
alone).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from consumer.checkpoints import hf_fp8, page_cache
from consumer.checkpoints.hf_files import _VIEW_DTYPES, HfCheckpoint
from consumer.checkpoints.parallel_read import (
    CHUNK,
    THREADS,
    ReaderThreads,
    Span,
    Verdict,
    default_window,
)

log = structlog.get_logger(__name__)

ALIGN = 4096
"""`O_DIRECT`'s alignment of file offsets, lengths and memory on the filesystems seen here."""
MEASURED_ON = frozenset({"cpu"})
"""Devices whose loads `choose` sends through a stage: where it was measured faster from a
cold page cache (docs/benchmarks.md, "Checkpoint reads"); cuda joins once measured there."""
COLD_BELOW = 0.5
"""A checkpoint with less than this share of its planned bytes in the page cache is read
past it (a warm one is copied out of the cache, which is faster than any disk)."""


def choose(plan: Sequence[Sequence[Span]], device: torch.device) -> bool:
    """Whether a load of `plan` onto `device` should read through a `DirectStage`: on a
    device where that was measured faster, when the page cache holds little of the plan."""
    if device.type not in MEASURED_ON:
        return False
    share = page_cache.cached_share((s.path, s.start, s.end) for spans in plan for s in spans)
    return share is not None and share < COLD_BELOW


@dataclass
class _Group:
    spans: list[tuple[Span, int, int]]  # (span, its aligned file start, its offset in buffer)
    nbytes: int  # the buffer's size: every span rounded out to ALIGN
    buffer: torch.Tensor | None = None
    left: int = 0  # chunks still to read
    failed: bool = False


@dataclass(frozen=True)
class _Chunk:
    group: int
    path: Path
    start: int  # aligned file offset
    end: int  # aligned end (may pass the file's end: the read comes back short)
    at: int  # offset in the group's buffer


class DirectStage(ReaderThreads):
    """Reads `plan`'s groups into staging buffers on `threads` threads (see the module doc);
    `start` begins, `view(i)` waits for group i, `advance(i)` frees it, `close` ends."""

    def __init__(
        self,
        ckpt: HfCheckpoint,
        plan: Sequence[Sequence[Span]],
        *,
        pinned: bool,
        threads: int = THREADS,
        window: int | None = None,
        chunk: int = CHUNK,
    ) -> None:
        self.ckpt = ckpt
        self.pinned = pinned
        self.window = window if window is not None else default_window()
        self._groups: list[_Group] = []
        chunks: list[_Chunk] = []
        for g, spans in enumerate(plan):
            placed, at = [], 0
            for span in spans:
                start = span.start - span.start % ALIGN
                end = -(-span.end // ALIGN) * ALIGN
                placed.append((span, start, at))
                for a in range(start, end, chunk):
                    piece = _Chunk(g, span.path, a, min(end, a + chunk), at + a - start)
                    chunks.append(piece)
                at += end - start
            self._groups.append(_Group(placed, at, left=0))
        for c in chunks:
            self._groups[c.group].left += 1
        self._init_threads(threads, chunks)
        self.bytes_read = 0
        self.direct = True  # False once a file refused O_DIRECT
        self._outstanding = 0  # bytes of buffers made and not released
        self._released = -1  # groups released so far (the loader's position)
        self._fds: dict[Path, int] = {}

    _name = "tq-direct-read"

    def view(self, i: int) -> HfCheckpoint:
        """The checkpoint for reading group i: its staged bytes from the buffer (waited for),
        the rest from the memory map."""
        group = self._groups[i]
        with self._cond:
            while group.left > 0 and not group.failed and not self._closed:
                self._cond.wait()
        ready = group.buffer is not None and group.left == 0 and not group.failed
        return StagedView(self.ckpt, group if ready else None)

    def advance(self, i: int) -> None:
        """The loader is done with group i (a device copy out of its buffer may still run:
        page-locked memory goes back to torch's host allocator, which waits for it)."""
        group = self._groups[i]
        with self._cond:
            if group.buffer is not None:
                self._outstanding -= group.nbytes
            group.buffer = None
            self._released = max(self._released, i)
            self._cond.notify_all()

    def close(self) -> None:
        super().close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        for group in self._groups:
            group.buffer = None
        if self.pinned:  # give the page-locked blocks torch's host allocator keeps back
            with contextlib.suppress(AttributeError, RuntimeError):
                torch._C._host_emptyCache()

    def _admit(self, chunk: _Chunk) -> Verdict:
        """Take a chunk of a group that has its buffer; make the buffer of the next group
        while the window has room for it (or the loader waits for that group)."""
        group = self._groups[chunk.group]
        if group.buffer is not None or group.failed:
            return "take"
        if chunk.group == self._released + 1 or self._outstanding + group.nbytes <= self.window:
            self._outstanding += group.nbytes
            group.buffer = _buffer(group.nbytes, self.pinned)
            return "take"
        return "wait"

    def _fd(self, path: Path) -> int:
        with self._cond:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
                except OSError:
                    if not self.direct:
                        raise
                    self.direct = False  # the filesystem refuses O_DIRECT: buffered reads
                    log.debug("checkpoint.direct_read_refused", file=str(path))
                    fd = os.open(path, os.O_RDONLY)
                self._fds[path] = fd
            return fd

    def _work(self) -> None:
        while (chunk := self._take()) is not None:
            group = self._groups[chunk.group]
            done = 0
            try:
                buffer = group.buffer
                if buffer is None or group.failed:
                    continue
                view = _memory(buffer)[chunk.at : chunk.at + chunk.end - chunk.start]
                done = _read_into(self._fd(chunk.path), chunk.start, view)
            except (OSError, ValueError) as exc:
                group.failed = True  # the loader reads this group from the map instead
                log.debug("checkpoint.direct_read_failed", file=str(chunk.path), error=str(exc))
            finally:
                with self._cond:
                    self.bytes_read += done
                    group.left -= 1
                    self._cond.notify_all()


class StagedView(HfCheckpoint):
    """`ckpt` (sharing its files and maps) whose reads of a tensor lying inside one of
    `group`'s staged spans return a view of the staging buffer; every other read is
    `ckpt`'s own."""

    def __init__(self, ckpt: HfCheckpoint, group: _Group | None) -> None:
        self.__dict__.update(ckpt.__dict__)
        self._group = group

    def read_slices(self, name: str, *slices: slice) -> torch.Tensor:
        staged = self._staged(name, slices) if self._group is not None else None
        return staged if staged is not None else super().read_slices(name, *slices)

    def _staged(self, name: str, slices: Sequence[slice]) -> torch.Tensor | None:
        if name in self.scales:
            return None  # FP8: dequantized with its scales, from the map
        dtype = _VIEW_DTYPES.get(self.dtypes.get(name, ""))
        if dtype is None:
            return None
        path, start, end = self.byte_span(name, slices)
        assert self._group is not None and self._group.buffer is not None
        for span, file_start, at in self._group.spans:
            if span.path == path and span.start <= start and end <= span.end:
                shape = self.shapes[name]
                ranges = hf_fp8.slice_ranges(shape, slices)
                strides = [1] * len(shape)
                for d in range(len(shape) - 2, -1, -1):
                    strides[d] = strides[d + 1] * shape[d + 1]
                first = at + start - file_start
                try:
                    flat = self._group.buffer[first : first + end - start].view(dtype)
                except RuntimeError:  # not aligned to its element size: read it from the map
                    return None
                return flat.as_strided([b - a for a, b in ranges], strides)
        return None


def _read_into(fd: int, start: int, view: memoryview) -> int:
    """Fill `view` from `fd` at `start`; bytes read (fewer at the file's end, where a read
    comes back short: asking again from an unaligned offset would be refused)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], start + done)
        if n <= 0:
            break
        done += n
        if done % ALIGN:
            break
    return done


def _buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """`nbytes` of ALIGN-aligned host memory (page-locked where `pinned`)."""
    if pinned:  # torch's host allocator hands out page-aligned blocks
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)[:nbytes]
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + nbytes]


def _memory(buffer: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 tensor's bytes (what `preadv` fills)."""
    import ctypes

    return memoryview((ctypes.c_char * buffer.numel()).from_address(buffer.data_ptr())).cast("B")
