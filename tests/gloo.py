"""Run a function on N spawned processes joined in a gloo process group (CPU collectives in tests).

    results = run_gloo(4, worker, arg1, arg2, timeout=scaled(120))

`worker(rank, world_size, *args)` must be importable by the spawned children (a module-level
function of a test module or helper). Its return value travels back pickled; an exception in
any child fails the caller with that child's traceback.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.redis_server import free_port
from tests.timing import scaled


class ChildFailed(AssertionError):
    """A spawned rank raised, died or did not finish; the message holds what is known."""


def _child(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    # Loopback only: containers often have no resolvable hostname for gloo to bind to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensor data inline instead of sharing memory with a dying process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - the child reports any failure to the parent
        results.put((rank, False, traceback.format_exc()))
    # The message is in the pipe once the queue's feeder thread is done; then leave without
    # the interpreter's teardown of torch and megatron-core (a second or two per rank).
    results.close()
    results.join_thread()
    os._exit(0)


def run_gloo(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = scaled(120.0),
    threads: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return values by rank.

    Each child uses `threads` torch threads. Raises ChildFailed with the child's traceback when
    any rank raises, exits without a result, or the whole run exceeds `timeout` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, threads, timeout, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()

    values: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(failures) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                if failures:
                    break  # the grace period for peers' messages is over
                if time.monotonic() > deadline:
                    failures.append(f"timed out after {timeout:.0f} s")
                    break
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    failures.append(f"a rank exited with code {dead[0]} and no result")
                    break
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                # Peers stranded in a collective by this error usually report within the
                # 0.5 s grace period above; the first message is normally the root cause.
                failures.append(f"rank {rank} raised:\n{payload}")
    finally:
        for proc in procs:
            proc.join(timeout=0.5 if failures else scaled(10))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=scaled(5))
        with contextlib.suppress(Exception):
            results.close()
    if failures:
        raise ChildFailed("\n\n".join(failures))
    return [values[rank] for rank in range(world_size)]
