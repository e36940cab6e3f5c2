"""Build a consumer from settings and run it: the body of `python -m consumer`."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, cast

import redis
import structlog
import torch

from consumer import cpu_compat
from consumer.checkpoints.prefetch import Prefetch
from consumer.forward.attention import varlen_supported
from consumer.forward.graphs import GraphedForward
from consumer.forward.load_phases import phase, recording
from consumer.forward.model import TINY, build_model
from consumer.forward.scoring import Scorer
from consumer.group.batching import broadcast_text
from consumer.group.faults import FaultInjector
from consumer.parallel import ParallelLayout, init_parallel, shutdown
from consumer.serve import cache_store
from consumer.serve.assemble import build_leader
from consumer.serve.compile_cache import CompileCache
from consumer.serve.follower import follow
from consumer.serve.precompile import Precompile
from consumer.serve.preflight import UnsafeRedis, preflight
from consumer.serve.reload import Reloader, load_agreed
from consumer.serve.stop import StopFlag
from shared import weights
from shared.errors import InvalidCheckpoint
from shared.settings import Settings
from shared.storage import ObjectStore

log = structlog.get_logger("teacherq.consumer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(setting: str) -> torch.device:
    """The device this rank computes on."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The parameter dtype: `model.dtype`, where auto is bfloat16 on CUDA, float32 elsewhere."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[setting]


def build_scorer(
    settings: Settings, layout: ParallelLayout, path: str | None = None
) -> tuple[Scorer, str]:
    """Load the teacher on this rank — `path` if given (a weight update), else the configured
    one; returns the scorer and the model version."""
    device = pick_device(settings.consumer.device)
    dtype = pick_dtype(settings.model.dtype, device)
    path = path or settings.model.path
    if path is None:
        from consumer.checkpoints import check_parallel

        spec = TINY
        check_parallel(spec, layout.tp, ep=layout.ep)
        with phase("build"):
            model = build_model(
                spec, layout, params_dtype=dtype, device=device, seed=settings.model.seed
            )
        version = f"tiny-random-seed{settings.model.seed}"
    else:
        from consumer.checkpoints import load_teacher

        model, spec, version = load_teacher(
            path, layout, params_dtype=dtype, device=device, fp8=settings.model.fp8
        )
    common: dict[str, Any] = {
        "model": model,
        "spec": spec,
        "layout": layout,
        "device": device,
        "chunk_rows": settings.consumer.head_chunk_rows,
    }
    if layout.pp > 1:  # consumer/forward/pipeline.py: stage to stage, micro-batches in flight
        from consumer.forward.pipeline import PipelineScorer

        return PipelineScorer(**common, microbatches=settings.parallel.microbatches), version
    return Scorer(**common, graphs=graphed_forward(model, settings, layout, device)), version


def graphed_forward(
    model: torch.nn.Module, settings: Settings, layout: ParallelLayout, device: torch.device
) -> GraphedForward | None:
    """CUDA graphs for the forward where they apply (see consumer/forward/graphs.py)."""
    graphs = settings.consumer.cuda_graphs
    moe = any(type(m).__name__ == "TeacherMoE" for m in model.modules())  # data-dependent shapes
    if device.type != "cuda" or layout.tp != 1 or graphs == 0 or moe:
        return None
    dtype = next(model.parameters()).dtype
    head_dim = int(cast(Any, model).config.kv_channels)  # megatron's TransformerConfig
    buckets = varlen_supported(device, dtype, head_dim)
    return GraphedForward(
        model, max_graphs=graphs, buckets=buckets, max_rows=settings.consumer.token_budget
    )


def last_control_id(client, queue: str) -> str:
    """Where the control stream ends now: commands after this are for this process."""
    from shared import keys

    last = client.xrevrange(keys.control_stream(queue), count=1)
    return last[0][0].decode() if last else "0-0"


def warmup(scorer: Scorer, settings: Settings) -> dict[str, object]:
    """Run every kernel the serving path can launch, on every rank (consumer/serve/warmup.py);
    returns what was warmed, for the start-up log."""
    from consumer.serve import warmup as warming

    plan = warming.plan(
        max_top_k=settings.queue.max_top_k,
        max_sample_n=settings.queue.max_sample_n,
        vocab_size=scorer.spec.vocab_size,
        max_input_tokens=scorer.spec.max_input_tokens,
        token_budget=settings.consumer.token_budget,
        full=settings.consumer.warmup == "full"
        or (settings.consumer.warmup == "auto" and scorer.device.type == "cuda"),
        graphs=scorer.graphs is not None and scorer.graphs.buckets,
    )
    return warming.run(scorer, plan)


def start_model(
    settings: Settings,
    layout: ParallelLayout,
    client: redis.Redis | None,
    choice: weights.StartChoice | None,
) -> tuple[Scorer, str, int, str]:
    """Load the weights this replica starts on (`weights.start_choice`, made by the leader and
    broadcast): the queue's updated weights if any, else the configured model. If the queue's
    weights cannot be loaded, the running update is recorded as failed and the replica starts
    on the weights before it (or its configured model) instead of dying; returns scorer,
    version, the generation served and its path ("" = the configured model). Only the
    configured model failing is fatal."""
    group, device = layout.replica_group, pick_device(settings.consumer.device)
    queue = settings.queue.name
    path = broadcast_text(
        (choice.path or "") if choice else "", src=layout.leader_rank, group=group
    )

    def load(p: str) -> tuple[Scorer, str]:
        return build_scorer(settings, layout, p or None)

    loaded, reason = load_agreed(load, path, group=group, device=device)
    if loaded is not None:
        if choice is not None:
            log.info(
                "model.selected",
                path=path or settings.model.path or "(tiny preset)",
                source=choice.source,
                generation=choice.generation,
                model_version=loaded[1],
            )
            return loaded[0], loaded[1], choice.generation, path
        return loaded[0], loaded[1], 0, path
    if not path:  # the configured model itself: a configuration error
        raise CheckpointLoadError(f"TEACHERQ_MODEL__PATH={settings.model.path!r}: {reason}")
    fallback = ""
    generation = 0
    if choice is not None and client is not None:
        served = weights.current(client, queue)
        if choice.trying_update:
            weights.fail_update(
                client,
                queue,
                generation=choice.generation,
                replica=f"{socket.gethostname()}-{os.getpid()} (starting)",
                reason=reason or "load failed",
            )
            fallback = served.active_path or ""
            generation = served.active_generation
        log.warning(
            "model.fallback",
            path=path,
            error=reason,
            using=fallback or settings.model.path or "(tiny preset)",
        )
    fallback = broadcast_text(fallback, src=layout.leader_rank, group=group)
    if fallback == path:
        fallback = ""
    scorer, version = build_scorer(settings, layout, fallback or None)
    log.info(
        "model.selected",
        path=fallback or settings.model.path or "(tiny preset)",
        source="update-weights" if fallback else "settings",
        generation=generation,
        model_version=version,
        note=f"queue weights {path!r} failed to load",
    )
    return scorer, version, generation, fallback


class StartClock:
    """Seconds per phase of a consumer's start, for `consumer.ready`'s `phases_s` and the
    `teacherq_consumer_start_seconds` gauges: import (interpreter, torch, megatron), setup
    (parallel layout, Redis checks), build / read / copy / load (the model: built, bytes read,
    copied to the device, the rest of loading), compile (waiting for the precompile workers),
    warmup (consumer/serve/warmup.py, and sealing the compile cache), open (the leader's
    stream and heartbeat)."""

    def __init__(self, started: float | None) -> None:
        self.started = started if started is not None else time.monotonic()
        self._last = self.started
        self.phases: dict[str, float] = {}

    def lap(self, name: str, *, split: dict[str, float] | None = None) -> None:
        """Close phase `name` now; `split` (load phases: build, read, copy) names parts of
        it, and what they leave is kept as `name`."""
        now = time.monotonic()
        total = now - self._last
        self._last = now
        for part, seconds in (split or {}).items():
            self.phases[part] = round(seconds, 3)
            total -= seconds
        self.phases[name] = round(max(total, 0.0), 3)
        self.phases["total"] = round(now - self.started, 3)


def compiled_kernels(cache: CompileCache | None) -> int:
    """Kernels in Triton's cache now (one metadata group file per compiled kernel); 0 where
    the cache is not ours to count."""
    if cache is None or cache.path is None:
        return 0
    return sum(1 for _ in Path(cache.variables["TRITON_CACHE_DIR"]).glob("*/__grp__*.json"))


def seal(
    cache: CompileCache | None,
    precompile: Precompile | None,
    remote: ObjectStore | None = None,
) -> int:
    """Seal the compile cache after the warm-up (one process per host: LOCAL_RANK 0; the
    other ranks' kernels are sealed by the next start), with this start's precompile plan
    among those it holds, and where that changed it, store it in `remote`
    (`consumer.compile_cache_url`); returns the files listed, 0 if this process does not
    seal."""
    if cache is None or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0
    before = (cache.sealed_files, cache.plans, cache.state)
    files = cache.seal(precompile.plan if precompile else None)
    if remote is not None and (cache.sealed_files, cache.plans, cache.state) != before:
        cache_store.push(cache, remote)  # in the background: the consumer is ready meanwhile
    return files


class CheckpointLoadError(InvalidCheckpoint):
    """The configured model (TEACHERQ_MODEL__PATH) cannot be loaded: a configuration error."""


def run(
    settings: Settings,
    *,
    started: float | None = None,
    compile_cache: CompileCache | None = None,
    precompile: Precompile | None = None,
    cache_remote: ObjectStore | None = None,
    prefetch: Prefetch | None = None,
) -> int:
    """Serve the queue until stopped; returns the process exit code. Raises UnsafeRedis,
    before loading the model, when the start-up checks refuse (see `preflight`). `started`
    (time.monotonic() at the process's start) times the import phase of `consumer.ready`;
    `compile_cache` is sealed after the warm-up (and stored in `cache_remote`, the
    `consumer.compile_cache_url` store `__main__` opened, where the seal changed it);
    `precompile` (workers compiling the warm-up's kernels) is waited for before it;
    `prefetch` (the checkpoint read into the page cache from the process's start) is stopped
    once the weights are loaded."""
    clock = StartClock(started)
    cpu_compat.apply()
    clock.lap("import")
    stop = StopFlag()
    stop.install()
    layout = init_parallel(
        tp=settings.parallel.tp, pp=settings.parallel.pp, ep=settings.parallel.ep
    )
    structlog.contextvars.bind_contextvars(
        rank=layout.rank, tp_rank=layout.tp_rank, dp_rank=layout.dp_rank
    )
    faults = FaultInjector(
        settings.consumer.crash_at,
        raise_at=settings.consumer.raise_at,
        poison=settings.consumer.poison,
        rank=layout.rank,
    )
    try:
        client = None
        choice: weights.StartChoice | None = None
        verdict = ""
        if layout.is_leader:
            from shared.redis_client import connect

            client = connect(settings.redis)
            verdict = preflight(client, settings)
        # Start-up checks come before the model loads (minutes for a large teacher), and every
        # rank of the group learns their verdict: all exit with the configuration code.
        verdict = broadcast_text(verdict, src=layout.leader_rank, group=layout.replica_group)
        if verdict:
            raise UnsafeRedis(verdict)
        if layout.is_leader:
            from shared import weights

            assert client is not None
            control_cursor = last_control_id(client, settings.queue.name)
            choice = weights.start_choice(weights.current(client, settings.queue.name))
        clock.lap("setup")
        with recording() as load_phases:
            scorer, version, generation, served_path = start_model(settings, layout, client, choice)
        clock.lap("load", split=load_phases)
        if prefetch is not None:
            prefetch.stop()
        precompiled = (
            precompile.wait(settings.consumer.precompile_timeout_s) if precompile else None
        )
        clock.lap("compile")
        compiled_before = compiled_kernels(compile_cache)
        warmed = warmup(scorer, settings)
        sealed = seal(compile_cache, precompile, cache_remote)
        clock.lap("warmup")
        log.info(
            "consumer.warmed_up",
            compile_caches=compile_cache.variables if compile_cache else {},
            compile_cache=compile_cache.describe() if compile_cache else {},
            precompile=precompiled or {},
            # Kernels the warm-up compiled itself: 0 when the cache or the precompile had them.
            compiled_in_warmup=compiled_kernels(compile_cache) - compiled_before,
            sealed_files=sealed,
            **warmed,
        )
        reload = Reloader(
            scorer=scorer,
            path=served_path,
            configured=settings.model.path,
            build=lambda p: build_scorer(settings, layout, p or None),
            warm=lambda fresh: log.info("weights.warmed_up", **warmup(fresh, settings)),
            fp8=settings.model.fp8,
        )

        def ready_phases() -> dict[str, float]:
            clock.lap("open")  # the leader's stream and heartbeat set up
            leader.metrics.start_phases(clock.phases)
            return clock.phases

        if not layout.is_leader:
            follow(scorer, faults, reload=reload)
            return 0
        from shared.storage import ObjectStore

        store = ObjectStore.from_settings(settings.storage)
        assert client is not None and choice is not None
        leader = build_leader(
            settings=settings,
            scorer=scorer,
            client=client,
            store=store,
            model_version=version,
            stop=stop,
            faults=faults,
            reload=reload,
            generation=generation,
            control_cursor=control_cursor,
            ready_phases=ready_phases,
            model_path=served_path or settings.model.path or "",
        )
        if choice.trying_update and generation == choice.generation:
            # This replica started on the running update's weights: count it as applied.
            weights.ack_update(
                client,
                settings.queue.name,
                replica=leader.name,
                generation=generation,
                live_replicas=[leader.name],
            )
        from shared.trace_store import install_sink

        sink = install_sink(
            client,
            settings.queue.name,
            process=f"consumer {leader.name}",
            ttl_s=settings.queue.trace_ttl_s,
            sample_rate=settings.queue.trace_sample_rate,
        )
        try:
            leader.run()
        finally:
            sink.close()
        return 0
    finally:
        shutdown()
