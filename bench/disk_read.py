"""How fast can this machine's disk hand a checkpoint's bytes over, by each way of reading?

The loader's read-ahead (`consumer/checkpoints/parallel_read.py`) populates memory maps with
`MADV_POPULATE_READ`; on an H100 host it reached 1.4 GB/s where `dd` with `O_DIRECT` gave 2.0.
This bench reads the same files from a cold page cache (evicted before each pass, no root
needed) by each method, side by side, so the loader's next design rests on a measurement:

- `populate`: the read-ahead as it is (a private map of each file, `MADV_POPULATE_READ` per
  chunk, `--threads` threads).
- `pread`: buffered `preadv` of each chunk into a per-thread buffer (fills the page cache).
- `direct`: `O_DIRECT` `preadv` into page-aligned memory (bypasses the page cache: one DMA
  from the disk into the buffer, no copy after). Where the filesystem refuses `O_DIRECT` the
  method is reported as refused.
- `direct-pinned` (with --device cuda): `direct` into page-locked host memory, then a
  non-blocking copy of each chunk to the device: what a loader that reads straight into its
  staging buffers would reach.

    python bench/disk_read.py --files /tmp/teacherq-checkpoint-read/7b-28l/*.safetensors

Prints one line per pass and the best of each method; --out writes them as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from consumer.checkpoints import page_cache  # torch-free

ALIGN = 4096
"""O_DIRECT's alignment of offsets, lengths and buffers on the filesystems seen here."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=Path, nargs="+", required=True)
    p.add_argument("--methods", default="populate,pread,direct")
    p.add_argument("--threads", default="8,16", help="comma-separated thread counts")
    p.add_argument("--chunk-mib", default="16", help="comma-separated chunk sizes in MiB")
    p.add_argument("--limit-gb", type=float, default=0.0, help="read at most this much")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cuda adds the direct-pinned method")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def chunks(files: list[Path], size: int, limit: int) -> list[tuple[Path, int, int]]:
    """(file, start, end) of every chunk, in order, the files' lengths rounded down to the
    alignment (the tail is a few KiB at most) and the total cut at `limit` (0: no cut)."""
    out, total = [], 0
    for path in files:
        length = path.stat().st_size // ALIGN * ALIGN
        for start in range(0, length, size):
            end = min(length, start + size)
            if limit and total + end - start > limit:
                return out
            out.append((path, start, end))
            total += end - start
    return out


def run_threads(work: list, threads: int, read: Callable[[int, list], int]) -> int:
    """Hand the chunks of `work` out to `threads` threads, each calling `read(thread, chunk)`;
    the bytes they read."""
    lock = threading.Lock()
    position = [0]
    done = [0] * threads

    def worker(i: int) -> None:
        while True:
            with lock:
                if position[0] >= len(work):
                    return
                chunk = work[position[0]]
                position[0] += 1
            done[i] += read(i, chunk)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(done)


def method_populate(work: list, threads: int, size: int, _device) -> int:
    maps = {}
    for path in {c[0] for c in work}:
        with open(path, "rb") as f:
            maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def read(_i: int, chunk: tuple) -> int:
        path, start, end = chunk
        if not page_cache.populate(maps[path], start, end):
            raise RuntimeError("this kernel has no MADV_POPULATE_READ")
        return end - start

    try:
        return run_threads(work, threads, read)
    finally:
        for m in maps.values():
            m.close()


def _fds(work: list, flags: int) -> dict[Path, int]:
    return {path: os.open(path, os.O_RDONLY | flags) for path in {c[0] for c in work}}


def _method_pread(flags: int, buffer: Callable[[int], object]) -> Callable:
    """`preadv` of each chunk into a buffer of the thread's own, the files opened with
    `flags`."""

    def method(work: list, threads: int, size: int, _device) -> int:
        fds = _fds(work, flags)
        buffers = [buffer(size) for _ in range(threads)]
        try:
            return run_threads(
                work,
                threads,
                lambda i, c: page_cache.pread_range(fds[c[0]], c[1], c[2], buffers[i]),
            )
        finally:
            for fd in fds.values():
                os.close(fd)

    return method


method_pread = _method_pread(0, bytearray)
method_direct = _method_pread(os.O_DIRECT, lambda size: mmap.mmap(-1, size))  # page-aligned


def method_direct_pinned(work: list, threads: int, size: int, device) -> int:
    """O_DIRECT into two page-locked buffers a thread, each chunk copied on to the device
    (non-blocking, on the thread's own stream) while the thread reads the next."""
    import ctypes

    import torch

    fds = _fds(work, os.O_DIRECT)
    target = torch.empty(size * threads * 2, dtype=torch.uint8, device=device)
    pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(threads * 2)]
    views = [
        memoryview((ctypes.c_char * size).from_address(p.data_ptr())).cast("B") for p in pinned
    ]
    streams = [torch.cuda.Stream(device) for _ in range(threads)]
    events: list = [None] * (threads * 2)
    turn = [0] * threads

    def read(i: int, chunk: tuple) -> int:
        slot = 2 * i + turn[i]
        turn[i] ^= 1
        if events[slot] is not None:
            events[slot].synchronize()
        n = page_cache.pread_range(fds[chunk[0]], chunk[1], chunk[2], views[slot])
        with torch.cuda.stream(streams[i]):
            target[slot * size : slot * size + n].copy_(pinned[slot][:n], non_blocking=True)
            events[slot] = torch.cuda.Event()
            events[slot].record()
        return n

    try:
        n = run_threads(work, threads, read)
        torch.cuda.synchronize(device)
        return n
    finally:
        for fd in fds.values():
            os.close(fd)


METHODS = {
    "populate": method_populate,
    "pread": method_pread,
    "direct": method_direct,
    "direct-pinned": method_direct_pinned,
}


def block_queue() -> dict:
    """The block devices' queue settings that bound a read (read-ahead, request size)."""
    out = {}
    for dev in sorted(Path("/sys/block").glob("*")):
        if dev.name.startswith(("loop", "ram")):
            continue
        q = dev / "queue"
        row = {}
        for key in ("read_ahead_kb", "max_sectors_kb", "nr_requests", "rotational"):
            with contextlib.suppress(OSError):
                row[key] = (q / key).read_text().strip()
        out[dev.name] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    methods = args.methods.split(",")
    if args.device.startswith("cuda") and "direct-pinned" not in methods:
        methods.append("direct-pinned")
    threads = [int(t) for t in args.threads.split(",")]
    sizes = [int(float(c) * (1 << 20)) for c in args.chunk_mib.split(",")]
    runs = []
    for repeat in range(args.repeats):
        for size in sizes:
            work = chunks(args.files, size, int(args.limit_gb * 1e9))
            for method in methods:
                for t in threads:
                    page_cache.evict(args.files)
                    start = time.perf_counter()
                    try:
                        n = METHODS[method](work, t, size, args.device)
                    except OSError as exc:
                        print(f"{method}: refused ({exc})", flush=True)
                        break
                    seconds = time.perf_counter() - start
                    row = {"method": method, "threads": t, "chunk_mib": size >> 20,
                           "bytes": n, "seconds": seconds, "gb_s": n / seconds / 1e9,
                           "repeat": repeat}  # fmt: skip
                    runs.append(row)
                    print(f"{method:14s} threads {t:2d} chunk {size >> 20:3d} MiB: "
                          f"{n / 1e9:6.2f} GB in {seconds:6.2f} s = {row['gb_s']:5.2f} GB/s",
                          flush=True)  # fmt: skip
    best: dict[str, dict] = {}
    for row in runs:
        if row["gb_s"] > best.get(row["method"], {}).get("gb_s", 0):
            best[row["method"]] = row
    print("\nbest of each:")
    for method, row in best.items():
        print(f"  {method:14s} {row['gb_s']:5.2f} GB/s ({row['threads']} threads, "
              f"{row['chunk_mib']} MiB)")  # fmt: skip
    report = {"files": [str(f) for f in args.files], "host": platform.node(),
              "kernel": platform.release(), "queues": block_queue(), "runs": runs,
              "best": best}  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
