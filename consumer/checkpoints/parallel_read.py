"""Bring a checkpoint's bytes in with many reads in flight, just ahead of the loader.

The loader copies each tensor out of its file's memory map. When the page cache does not hold
the checkpoint (a fresh machine, or one whose memory went to something else), each page comes
in through a fault of the copying thread, with the kernel's readahead as the only reads in
flight, and each page is mapped by one fault at a time.

`ReadAhead` works through the byte ranges the loader will copy, in the order it copies them,
on a few threads: each asks the kernel to populate the loader's own mapping for a range
(`MADV_POPULATE_READ`: the pages read into the page cache and mapped, no copy), so when the
loader gets there its copy neither waits on the disk nor faults. Without that advice (a kernel
before 5.14, or no mapping given) a thread reads the range with `pread` instead, which fills the
page cache. It stays at most `window` bytes ahead of the loader (a checkpoint larger than
memory must not evict its own pages before they are used) and skips a range the loader has
passed. Measured in docs/benchmarks.md ("Checkpoint reads").

`read_plan` finds the ranges by running the loader's own readers against `PlanView`, a
checkpoint whose reads record what they touch and return tensors on the meta device, so the
plan cannot drift from what the readers read.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

import structlog
import torch

from consumer.checkpoints import hf_fp8, page_cache
from consumer.checkpoints.hf_files import _VIEW_DTYPES, HfCheckpoint

log = structlog.get_logger(__name__)

CHUNK = 16 << 20
"""Bytes per read: large enough that a read is not dominated by its call, small enough that
the threads share a tensor."""
THREADS = 8
"""Reads in flight. They wait on the disk, not on a CPU, so more threads than cores serve."""
WINDOW = 2 << 30
"""How far ahead of the loader reads may run (bytes); lowered to a quarter of the memory
available where that is less."""


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of a file that a read touches."""

    path: Path
    start: int
    end: int


class PlanView(HfCheckpoint):
    """The checkpoint, with reads that record the spans they would touch (`spans`) and return
    an empty tensor of the right shape on the meta device. Shares `ckpt`'s open files."""

    def __init__(self, ckpt: HfCheckpoint) -> None:
        self.__dict__.update(ckpt.__dict__)
        self.spans: list[Span] = []

    def read_slices(self, name: str, *slices: slice) -> torch.Tensor:
        scale = self.scales.get(name)
        self.spans.append(Span(*self.byte_span(name, slices)))
        if scale is not None:  # FP8: read dequantized, with its scales
            self.spans.append(Span(*self.byte_span(scale)))
        shape = [b - a for a, b in hf_fp8.slice_ranges(self.shapes[name], slices)]
        dtype = torch.float32 if scale is not None else _VIEW_DTYPES.get(self.dtypes[name])
        return torch.empty(shape, dtype=dtype or torch.uint8, device="meta")


def read_plan(
    ckpt: HfCheckpoint, readers: Iterable[Callable[[HfCheckpoint], object]]
) -> list[list[Span]]:
    """For each reader, in order, the spans it reads. A reader that does more with its reads
    than the meta tensors can follow (copies them into a padded tensor, say) keeps the spans
    it recorded before that."""
    view = PlanView(ckpt)
    plan = []
    for read in readers:
        view.spans = []
        with contextlib.suppress(Exception):  # a plan is an optimisation, never a failure
            read(view)
        plan.append(view.spans)
    return plan


def read_ahead(ckpt: HfCheckpoint, plan: Sequence[Sequence[Span]], *, threads: int) -> ReadAhead:
    """A `ReadAhead` over `plan` (what the loader will read of `ckpt`: `read_plan`),
    populating `ckpt`'s own memory maps (the ones the loader's views come from); none at
    `threads` = 0."""
    files = {span.path for spans in plan for span in spans}
    maps = {file: ckpt.mapping(file)[0] for file in files}
    return ReadAhead(plan if threads > 0 else [], maps=maps, threads=threads)


Verdict = Literal["take", "skip", "wait"]


class ReaderThreads:
    """`threads` daemon threads working through `_chunks` in order: each runs `_work`, which
    asks `_take` for the next chunk that `_admit` lets through. `start` begins them, `close`
    sets `_closed`, wakes whoever waits on `_cond` and joins them. Subclasses call
    `_init_threads` in `__init__` and write `_admit` and `_work`."""

    threads: int
    waiting: int
    """Threads waiting for `_admit` to let the next chunk through."""
    _chunks: Sequence[Any]
    _next: int
    _closed: bool
    _cond: threading.Condition
    _workers: list[threading.Thread]
    _name = "tq-read"

    def _init_threads(self, threads: int, chunks: Sequence[Any]) -> None:
        self._chunks = chunks
        self.threads = threads if chunks else 0
        self.waiting = 0
        self._next = 0
        self._closed = False
        self._cond = threading.Condition()
        self._workers = []

    def _admit(self, chunk: Any) -> Verdict:
        """Whether `chunk` is read now, skipped, or waited for (called holding `_cond`)."""
        raise NotImplementedError

    def progress(self, nbytes: int) -> None:
        """The loader has copied `nbytes` more (`ParamWriter`'s `progress`); a reader paced
        by it moves on (`ReadAhead`)."""

    def _work(self) -> None:
        raise NotImplementedError

    def _take(self) -> Any:
        """The next chunk `_admit` takes, waiting while it says wait; None at the end."""
        with self._cond:
            while not self._closed and self._next < len(self._chunks):
                chunk = self._chunks[self._next]
                verdict = self._admit(chunk)
                if verdict == "wait":
                    self.waiting += 1
                    self._cond.wait()
                    self.waiting -= 1
                    continue
                self._next += 1
                if verdict == "take":
                    return chunk
            return None

    def start(self) -> Self:
        for i in range(self.threads):
            worker = threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join()
        self._workers = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class ReadAhead(ReaderThreads):
    """Brings in `plan`'s spans on `threads` threads, at most `window` bytes ahead of the
    loader (see the module doc): populating `maps[path]` (the loader's memory map of that file)
    where given, else reading the file. Call `advance(i)` when the loader has read group i,
    and `close` at the end; `start` begins. A read that fails is left to the loader (which
    raises or not as it would have)."""

    def __init__(
        self,
        plan: Sequence[Sequence[Span]],
        *,
        maps: Mapping[Path, mmap.mmap] | None = None,
        threads: int = THREADS,
        window: int | None = None,
        chunk: int = CHUNK,
    ) -> None:
        self._ends = _group_ends(plan)  # bytes of the plan up to the end of each group
        self.window = window if window is not None else default_window()
        self._init_threads(threads, list(_chunks(plan, chunk)))
        self.maps = dict(maps or {})
        self.bytes_read = 0
        """Bytes brought in (populated or read; those cached already included)."""
        self.failed = 0
        """Chunks whose read failed (left to the loader)."""
        self._done_group = -1
        self._consumed = 0
        self._within = 0  # bytes the loader has read of the group it is in (`progress`)
        self._chunk = chunk

    _name = "tq-read-ahead"

    def advance(self, group: int) -> None:
        """The loader has read group `group` (and all before it)."""
        with self._cond:
            self._done_group = max(self._done_group, group)
            self._consumed = self._ends[group] if self._ends else 0
            self._within = 0
            self._cond.notify_all()

    def progress(self, nbytes: int) -> None:
        """The loader has read `nbytes` more of the group after the last one `advance` named:
        the window moves on inside a group too. A group can be far larger than the window (a
        DeepSeek-V3 layer's experts: 15 GB); counted by groups alone, the threads stopped
        `window` bytes into it and left the rest to the loader's page faults, one at a time."""
        with self._cond:
            self._within += nbytes
            self._cond.notify_all()

    def _admit(self, chunk: _Chunk) -> Verdict:
        if chunk.group <= self._done_group:
            return "skip"  # the loader is past it
        return "take" if chunk.offset - self._consumed - self._within < self.window else "wait"

    def _work(self) -> None:
        buffer: bytearray | None = None  # for pread, made at its first use
        files: dict[Path, int] = {}
        try:
            while (chunk := self._take()) is not None:
                try:
                    mapped = self.maps.get(chunk.path)
                    if mapped is not None and page_cache.populate(mapped, chunk.start, chunk.end):
                        done = chunk.end - chunk.start
                    else:
                        fd = files.get(chunk.path)
                        if fd is None:
                            fd = files[chunk.path] = os.open(chunk.path, os.O_RDONLY)
                        buffer = buffer or bytearray(self._chunk)
                        done = page_cache.pread_range(fd, chunk.start, chunk.end, buffer)
                    with self._cond:
                        self.bytes_read += done
                except (OSError, ValueError) as exc:
                    with self._cond:
                        self.failed += 1
                    log.debug("checkpoint.read_ahead_failed", file=str(chunk.path), error=str(exc))
        finally:
            for fd in files.values():
                os.close(fd)


@dataclass(frozen=True)
class _Chunk:
    group: int
    offset: int  # bytes of the plan before this chunk
    path: Path
    start: int
    end: int


def _chunks(plan: Sequence[Sequence[Span]], size: int) -> Iterable[_Chunk]:
    offset = 0
    for group, spans in enumerate(plan):
        for span in spans:
            for start in range(span.start, span.end, size):
                end = min(span.end, start + size)
                yield _Chunk(group, offset, span.path, start, end)
                offset += end - start


def _group_ends(plan: Sequence[Sequence[Span]]) -> list[int]:
    ends, total = [], 0
    for spans in plan:
        total += sum(s.end - s.start for s in spans)
        ends.append(total)
    return ends


def default_window() -> int:
    """`WINDOW`, or a quarter of the memory available where that is less."""
    available = page_cache.available_memory()
    return WINDOW if available is None else max(CHUNK, min(WINDOW, available // 4))
