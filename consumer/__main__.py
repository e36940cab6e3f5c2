"""`python -m consumer` (under torchrun for more than one rank): serve a teacherq queue."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import NoReturn

import structlog


def main() -> int:
    """Read settings from the environment, configure logging, run the consumer.

    Configuration errors (bad settings, an unsafe Redis) print one or two lines to stderr and
    exit with 78 (EX_CONFIG), before any model is loaded: restarting cannot fix them, so
    supervisors should not restart on 78 (docs/operations.md)."""
    started = time.monotonic()  # the start of the "import" phase of time-to-ready
    from consumer.serve import readahead

    readahead.start()  # the libraries torch is about to load, read ahead on a fresh machine
    from shared.errors import ResultNotStored
    from shared.exitcodes import CONFIG, FAILED
    from shared.log import configure_logging, route_library_logs
    from shared.settings import SettingsError, load_settings

    try:
        settings = load_settings()
    except SettingsError as exc:
        sys.stderr.write(f"teacherq consumer: {exc}\n")
        return CONFIG
    rank = int(os.environ.get("RANK", 0))
    configure_logging(level=settings.log.level, fmt=settings.log.format, rank=rank)
    route_library_logs(level=settings.log.level)  # megatron's notices: debug lines
    if rank == 0 and (uncompiled := readahead.without_bytecode()):
        structlog.get_logger("teacherq.consumer").warning(
            "consumer.no_bytecode",
            packages=uncompiled,
            note="every start compiles their sources (seconds): run `python -m compileall` "
            "on site-packages once, or unset PYTHONDONTWRITEBYTECODE",
        )
    from consumer.checkpoints import prefetch as checkpoint_prefetch
    from consumer.serve import cache_store, compile_cache
    from consumer.serve.precompile import Precompile

    # Before torch is imported: Triton and inductor read these when they first compile.
    cache = compile_cache.apply(
        settings.consumer.compile_cache_dir, settings.redis.home, os.environ
    )
    # A fresh machine: the sealed cache from the object store, fetched by the host's first
    # rank (which also seals and pushes); the others find it in place before they compile.
    remote = cache_store.remote(settings) if os.environ.get("LOCAL_RANK", "0") == "0" else None
    if remote is not None:
        cache = cache_store.pull(cache, remote)
    if settings.consumer.compile_cache_seed is not None:  # kernels baked into the image
        compile_cache.seed(cache, settings.consumer.compile_cache_seed)
    # The warm-up's kernels compile in other processes while this one imports and loads.
    precompile = Precompile.start(settings, os.environ, cache)
    # `kill -USR1 PID` writes every thread's stack to stderr: what a stuck consumer is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from consumer.serve.preflight import UnsafeRedis, preflight

    prefetch = None
    try:
        client = None
        if rank == 0:  # before torch and megatron are imported: a refusal takes a second
            from shared.redis_client import connect

            client = connect(settings.redis)
            verdict = preflight(client, settings)
            if verdict:
                raise UnsafeRedis(verdict)
        # The checkpoint's bytes, read from disk once torch and megatron are imported.
        prefetch = checkpoint_prefetch.start(
            prefetch_path(settings, client) if settings.model.prefetch else None,
            enabled=settings.model.prefetch,
            first=lambda: readahead.start_files(cache.path),
            begin=False,
        )
        from consumer.serve.lazy_compile import deferred_torch_compile

        with deferred_torch_compile():  # megatron's fusions: torch's compiler when first run
            from consumer.serve.service import run

        return run(
            settings,
            started=started,
            compile_cache=cache,
            precompile=precompile,
            cache_remote=remote,
            prefetch=prefetch,
        )
    except UnsafeRedis as exc:
        if rank == 0:
            sys.stderr.write(f"teacherq consumer: refusing to start: {exc}\n")
        return CONFIG
    except SettingsError as exc:  # a setting only the start could test (a metrics port)
        sys.stderr.write(f"teacherq consumer: {exc}\n")
        return CONFIG
    except ResultNotStored as exc:  # logged as store.failed; the cause at debug level
        structlog.get_logger("teacherq.consumer").debug("store.failed_cause", exc_info=exc)
        sys.stderr.write(f"teacherq consumer: stopping: {exc}\n")
        return FAILED
    finally:
        if precompile is not None:
            precompile.stop()
        if prefetch is not None and not prefetch.stopped:
            prefetch.stop()


def prefetch_path(settings, client) -> str | None:
    """The checkpoint this start will load, as far as this rank can tell before torch is
    imported: the queue's updated weights where the leader's first rank finds some
    (`shared.weights.start_choice`, the rule the consumer applies), else `model.path`."""
    if client is not None:
        from shared import weights

        choice = weights.start_choice(weights.current(client, settings.queue.name))
        if choice.path:
            return choice.path
    return settings.model.path


def leave(code: int) -> NoReturn:
    """Exit with `code`, skipping the interpreter's teardown where nothing is left to wait for.

    Tearing down a heap that holds torch and megatron-core, module by module, takes about 2 s:
    every consumer's exit, every scale-in and every test that stops one paid it. The exit
    handlers still run first (the trace sinks and the OTLP exporter flush there; CPython's
    own exit runs them through the same `atexit._run_exitfuncs`), then the standard streams
    are flushed. A thread that is not a daemon would be waited for by a normal exit: while
    one runs, the exit is a normal one."""
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()  # the interpreter's own exit path, run here
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream: nothing to flush
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
