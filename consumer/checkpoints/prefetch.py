"""Read the checkpoint's files into the page cache while a consumer starts (`model.prefetch`).

On a fresh machine the checkpoint's bytes come from disk, and before this the first of them
was read only once the model was built and, since the warm-up runs before the weights are
loaded (`consumer.serve.service.start_model`), only after the warm-up. `python -m consumer`
prepares a `Prefetch` before torch is imported (it finds the checkpoint from the settings and
the queue's weight record) and the consumer starts it as soon as the import is done: threads
read the safetensors files, in their names' order (the loader's order, layer by layer, for
the shards transformers writes), 16 MiB at a time, while the model is built and warmed up,
so the loader's own read-ahead (`parallel_read`) then finds most pages cached.

Not during the import: the import reads thousands of small files (bytecode, shared objects)
one at a time, and each such read waited behind the prefetch's reads in the disk's queue.
Measured on an H100 host (docs/benchmarks.md), a prefetch from the process's first moment
made the 7B start's import 3x slower (5.7 s to 16-20 s) and the start no faster.

Each thread reads with `pread` into a buffer of its own, not by populating a memory map (as
the loader's read-ahead does), which would hold the process's memory-map lock for the length
of each disk read while the warm-up maps and allocates memory.

What else the start reads from disk waits behind the prefetch's reads: measured on an H100
host, a warm-up that took 4.4 s on a warm page cache took 10-13 s beside a prefetch. So the
threads first read what the start reads after its import (`first`; `python -m consumer` passes
`consumer.serve.readahead.start_files`): the bytecode of the modules imported later, the
compile cache's kernels, the libraries' shared objects (the CUDA libraries load parts of
themselves on first use); then the checkpoint.

It runs only where it cannot hurt: a local Hugging Face safetensors directory whose files fit
in half the memory still available (a checkpoint larger than that would evict its own pages
before the loader gets there; the loader's windowed read-ahead serves it alone), once per
machine (LOCAL_RANK 0: the page cache is the machine's, every rank's shards come out of it).
The consumer stops it once its weights are loaded. `model.prefetch` turns it on (off by
default: see docs/benchmarks.md, "Checkpoint prefetch at start-up").
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from consumer.checkpoints import page_cache

log = structlog.get_logger(__name__)

CHUNK = 16 << 20
"""Bytes per read: large enough that the call costs nothing, small enough that the threads
share a file."""
THREADS = 8
"""Reads in flight; they wait on the disk, not on a CPU."""
MEMORY_SHARE = 0.5
"""The share of the available memory a checkpoint may fill to be prefetched."""


@dataclass(frozen=True)
class _Chunk:
    path: Path
    start: int
    end: int


def checkpoint_files(path: str | Path) -> list[Path] | None:
    """The safetensors files of the Hugging Face checkpoint at `path`, in their names' order;
    None where `path` is not a local directory holding them (a Megatron checkpoint, a URL)."""
    root = Path(path)
    if not (root / "config.json").is_file():
        return None
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    return files or None


class Prefetch:
    """Reads `first`, then `files`, into the page cache on `threads` threads (see the module
    doc); `stop` ends it after the chunks in hand. `bytes_read` (of `files`) and `seconds` say
    how far it got."""

    def __init__(
        self,
        files: list[Path],
        *,
        first: Sequence[Path] | Callable[[], Iterable[Path]] = (),
        threads: int = THREADS,
        chunk: int = CHUNK,
    ) -> None:
        self.files = files
        self.total = sum(f.stat().st_size for f in files)
        self.first: list[Path] = []
        self.first_bytes = 0
        self._list_first = first if callable(first) else lambda: first
        self._chunks: list[_Chunk] | None = None  # listed by the first thread to run
        self._mine = set(files)
        self._chunk = chunk
        self.threads = threads
        self.bytes_read = 0
        self.failed = 0
        self.seconds = 0.0
        self._next = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._workers: list[threading.Thread] = []
        self._started = 0.0
        self._running = 0

    def start(self, after: threading.Thread | None = None) -> Prefetch:
        """Start the threads; with `after`, they wait for that thread first."""
        self._running = self.threads
        for i in range(self.threads):
            worker = threading.Thread(
                target=self._work, args=(after,), name=f"tq-prefetch-{i}", daemon=True
            )
            worker.start()
            self._workers.append(worker)
        return self

    @property
    def done(self) -> bool:
        """It was started, and every thread has finished (all read, or stopped)."""
        return bool(self._workers) and self._running == 0

    @property
    def stopped(self) -> bool:
        """`stop` was called."""
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop reading (threads finish the chunk in hand), wait for the threads, and log
        how far it got (`checkpoint.prefetched`)."""
        finished_before = self.done
        self._stopped.set()
        if not self._workers:
            return  # never started: nothing read, nothing to say
        for worker in self._workers:
            worker.join()
        log.info(
            "checkpoint.prefetched",
            bytes=self.bytes_read,
            of_bytes=self.total,
            library_bytes=self.first_bytes,
            seconds=round(self.seconds, 3),
            gb_per_s=round(self.bytes_read / self.seconds / 1e9, 2) if self.seconds else None,
            finished_before_load=finished_before,
            failed_chunks=self.failed,
        )

    def _plan(self) -> list[_Chunk]:
        """`first`'s files (listed here, on a prefetch thread: a walk of a package's bytecode
        takes a while), then the checkpoint's, cut into chunks."""
        listed: list[Path] = []
        with contextlib.suppress(OSError):
            listed = list(self._list_first())
        first = _sizes(listed)
        self.first = [f for f, _ in first]
        self.first_bytes = sum(size for _, size in first)
        sized = [*first, *_sizes(self.files)]  # a file gone since: left to the loader
        return [
            _Chunk(f, start, min(size, start + self._chunk))
            for f, size in sized
            for start in range(0, size, self._chunk)
        ]

    def _take(self) -> _Chunk | None:
        with self._lock:
            if self._chunks is None:
                self._chunks = self._plan()
            if self._stopped.is_set() or self._next >= len(self._chunks):
                return None
            chunk = self._chunks[self._next]
            self._next += 1
            return chunk

    def _work(self, after: threading.Thread | None) -> None:
        if after is not None:
            after.join()
        with self._lock:
            if not self._started:
                self._started = time.monotonic()
        buffer: bytearray | None = None
        files: dict[Path, int] = {}
        try:
            while (chunk := self._take()) is not None:
                try:
                    fd = files.get(chunk.path)
                    if fd is None:
                        fd = files[chunk.path] = os.open(chunk.path, os.O_RDONLY)
                    buffer = buffer or bytearray(self._chunk)
                    page_cache.pread_range(fd, chunk.start, chunk.end, buffer)
                    with self._lock:
                        if chunk.path in self._mine:
                            self.bytes_read += chunk.end - chunk.start
                except (OSError, ValueError):
                    with self._lock:
                        self.failed += 1  # left to the loader, which reads it as it would
        finally:
            for fd in files.values():
                os.close(fd)
            with self._lock:
                self._running -= 1
                self.seconds = time.monotonic() - self._started


def _sizes(files: Iterable[Path]) -> list[tuple[Path, int]]:
    """(file, size) of each of `files` that is a readable regular file now."""
    found = []
    for f in files:
        with contextlib.suppress(OSError):
            if f.is_file():
                found.append((f, f.stat().st_size))
    return found


def start(
    path: str | None,
    *,
    enabled: bool = True,
    first: Sequence[Path] | Callable[[], Iterable[Path]] = (),
    after: threading.Thread | None = None,
    threads: int = THREADS,
    begin: bool = True,
) -> Prefetch | None:
    """A `Prefetch` of the checkpoint at `path` (started, unless `begin` is false: then the
    caller starts it), or None where it does not run (see the module doc; the reason at
    debug level). `first`: files read before the checkpoint's, or a function that lists them
    (called on a prefetch thread): what the rest of the start will read (see the module doc)."""
    why = None
    files = checkpoint_files(path) if path and enabled else None
    if not enabled:
        why = "model.prefetch is off"
    elif int(os.environ.get("LOCAL_RANK", "0")) != 0:
        why = "another rank of this machine prefetches"
    elif files is None:
        why = "not a local Hugging Face safetensors directory"
    else:
        available = page_cache.available_memory()
        total = sum(f.stat().st_size for f in files)
        if available is not None and total > MEMORY_SHARE * available:
            why = f"{total} bytes exceed half the {available} bytes of memory available"
    if why is not None or files is None:
        log.debug("checkpoint.prefetch_skipped", path=path, reason=why)
        return None
    prefetch = Prefetch(files, first=first, threads=threads)
    return prefetch.start(after) if begin else prefetch
