"""Build a consumer from settings and run it: the body of `python -m consumer`."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import redis
import structlog
import torch

from consumer import cpu_compat
from consumer.checkpoints.prefetch import Prefetch
from consumer.forward import quack_gemm
from consumer.forward.attention import varlen_supported
from consumer.forward.graphs import GraphedForward
from consumer.forward.load_phases import phase, recording
from consumer.forward.model import TINY, build_model
from consumer.forward.scoring import Scorer
from consumer.forward.spec import param_dtype
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


def pick_device(setting: str) -> torch.device:
    """The device this rank computes on."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def pick_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The parameter dtype: `model.dtype`, where auto is bfloat16 on CUDA, float32 elsewhere."""
    return param_dtype(setting, device.type)


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
    return scorer_of(model, spec, settings, layout, device), version


def scorer_of(
    model: torch.nn.Module,
    spec: Any,
    settings: Settings,
    layout: ParallelLayout,
    device: torch.device,
) -> Scorer:
    """The scorer that serves `model` on this rank (stage to stage where layers are split)."""
    common: dict[str, Any] = {
        "model": model,
        "spec": spec,
        "layout": layout,
        "device": device,
        "chunk_rows": settings.consumer.head_chunk_rows,
    }
    if layout.pp > 1:  # consumer/forward/pipeline.py: stage to stage, micro-batches in flight
        from consumer.forward.pipeline import PipelineScorer

        return PipelineScorer(**common, microbatches=settings.parallel.microbatches)
    return Scorer(**common, graphs=graphed_forward(model, settings, layout, device))


def shell_scorer(settings: Settings, layout: ParallelLayout, path: str | None) -> Scorer | None:
    """A scorer of the teacher at `path` (else the configured one) whose parameters are all
    zero: the warm-up runs on it while the checkpoint's bytes come from disk (the prefetch),
    and `load_in_place` fills it after. None where the weights must be loaded first: the
    tiny preset, a Megatron checkpoint, FP8 linears or experts (`hf.build_hf_shell`)."""
    path = path or settings.model.path
    if path is None:
        return None
    from consumer.checkpoints.teacher import checkpoint_kind

    if checkpoint_kind(path) != "hf":
        return None
    from consumer.checkpoints.hf import build_hf_shell

    device = pick_device(settings.consumer.device)
    dtype = pick_dtype(settings.model.dtype, device)
    shell = build_hf_shell(path, layout, params_dtype=dtype, device=device, fp8=settings.model.fp8)
    if shell is None:
        return None
    return scorer_of(shell[0], shell[1], settings, layout, device)


def load_in_place(scorer: Scorer, settings: Settings, path: str | None) -> str:
    """Load the teacher at `path` (else the configured one) into `scorer`'s parameters (a
    `shell_scorer`'s); returns the model version."""
    from consumer.checkpoints.hf import load_hf_weights
    from consumer.checkpoints.teacher import model_version

    path = path or settings.model.path
    assert path is not None, "a shell is built for a checkpoint only"
    load_hf_weights(scorer.model, scorer.spec, path, scorer.layout, fp8=settings.model.fp8)
    return model_version(path)


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

    quack_gemm.settle()  # quack's import on its thread (`preload`) ends before the forwards
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
    warm: Callable[[Scorer], dict] | None = None,
) -> tuple[Scorer, str, int, str, dict | None]:
    """Load the weights this replica starts on (`weights.start_choice`, made by the leader and
    broadcast): the queue's updated weights if any, else the configured model. If the queue's
    weights cannot be loaded, the replica starts on the weights before the update (or its
    configured model) instead of dying, and the running update is recorded as failed; only
    the configured model failing is fatal. Returns scorer, version, the generation served, its
    path ("" = the configured model), and what `warm` returned where it ran here.

    With `warm` (the start-up's warm-up), a Hugging Face teacher is warmed up before its
    weights are loaded: on a shell of zero parameters (`shell_scorer`), then filled in place,
    so the warm-up's seconds pass while the prefetch still reads the checkpoint from disk.
    Every rank agrees on the shell before the warm-up (whose collectives all ranks must
    reach), and on the load after it."""
    group, device = layout.replica_group, pick_device(settings.consumer.device)
    queue = settings.queue.name
    path = broadcast_text(
        (choice.path or "") if choice else "", src=layout.leader_rank, group=group
    )

    def load(p: str) -> tuple[Scorer, str | None]:
        shell = shell_scorer(settings, layout, p or None) if warm is not None else None
        if shell is not None:
            return shell, None  # no version yet: the weights come after the warm-up
        return build_scorer(settings, layout, p or None)

    loaded, reason = load_agreed(load, path, group=group, device=device)
    warmed = None
    if loaded is not None and loaded[1] is None and warm is not None:
        shell = loaded[0]
        warmed = warm(shell)
        loaded, reason = load_agreed(
            lambda p: (shell, load_in_place(shell, settings, p or None)),
            path,
            group=group,
            device=device,
        )
        if loaded is None:
            warmed = None  # the scorer built next is another: the caller warms it
    if loaded is not None:
        version = cast(str, loaded[1])
        if choice is not None:
            log.info(
                "model.selected",
                path=path or settings.model.path or "(tiny preset)",
                source=choice.source,
                generation=choice.generation,
                model_version=version,
            )
            return loaded[0], version, choice.generation, path, warmed
        return loaded[0], version, 0, path, warmed
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
    return scorer, version, generation, fallback, None


class StartClock:
    """Seconds per phase of a consumer's start, for `consumer.ready`'s `phases_s` and the
    `teacherq_consumer_start_seconds` gauges: import (interpreter, torch, megatron), setup
    (parallel layout, Redis checks), build / read / copy / load (the model: built, bytes read,
    copied to the device, the rest of loading), compile (waiting for the precompile workers),
    warmup (consumer/serve/warmup.py, and sealing the compile cache), open (the leader's
    stream and heartbeat). Where the checkpoint is prefetched, a Hugging Face teacher is warmed
    up before its weights are read (`start_model`): compile and warmup come before read."""

    def __init__(self, started: float | None) -> None:
        self.started = started if started is not None else time.monotonic()
        self._last = self.started
        self.phases: dict[str, float] = {}

    def lap(self, name: str, *, split: dict[str, float] | None = None) -> None:
        """Close phase `name` now; `split` (load phases: build, read, copy, and compile and
        warmup where the warm-up ran before the weights came) names parts of it, and what
        they leave is kept as `name`. A phase met twice adds up."""
        now = time.monotonic()
        total = now - self._last
        self._last = now
        for part, seconds in (split or {}).items():
            self.phases[part] = round(self.phases.get(part, 0.0) + seconds, 3)
            total -= seconds
        self.phases[name] = round(self.phases.get(name, 0.0) + max(total, 0.0), 3)
        self.phases["total"] = round(now - self.started, 3)


def compiled_kernels(cache: CompileCache | None) -> set[str]:
    """Kernels in Triton's cache now (one metadata group file per compiled kernel, named
    `triton:<kernel>@<hash>`) and in quack-kernels' (one object file each,
    `quack:<sha>`); none where the cache is not ours to count."""
    if cache is None or cache.path is None:
        return set()
    triton = Path(cache.variables["TRITON_CACHE_DIR"]).glob("*/__grp__*.json")
    found = {f"triton:{f.stem.removeprefix('__grp__')}@{f.parent.name[:12]}" for f in triton}
    quack = cache.variables.get("QUACK_CACHE_DIR")
    if quack:
        found |= {f"quack:{f.stem[:16]}" for f in Path(quack).glob("*/*.o")}
    return found


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
    `prefetch` (the checkpoint read into the page cache, prepared by `__main__`) is started
    after the import and stopped once the weights are loaded."""
    clock = StartClock(started)
    cpu_compat.apply()
    quack_gemm.allow(settings.consumer.expert_gemms == "auto")
    clock.lap("import")
    if prefetch is not None:
        prefetch.start()  # now that the import's own reads are done
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

        def warm(fresh: Scorer) -> dict:
            """Wait for the precompile workers, then warm `fresh` up (phases compile and
            warmup of the start). Counts and names the kernels the warm-up compiled itself:
            none when the cache or the workers had them (counted after the workers, whose
            kernels land in the same cache)."""
            with phase("compile"):
                precompiled = (
                    precompile.wait(settings.consumer.precompile_timeout_s) if precompile else None
                )
            with phase("warmup"):
                before = compiled_kernels(compile_cache)
                done = warmup(fresh, settings)
                compiled = sorted(compiled_kernels(compile_cache) - before)
                return {
                    "precompile": precompiled or {},
                    **done,
                    "compiled_in_warmup": len(compiled),
                    # which: a kernel the precompile plan missed (at most 8 named)
                    "compiled_in_warmup_kernels": compiled[:8],
                }

        with recording() as load_phases:
            # Warm up first only while the prefetch reads the checkpoint: otherwise the load
            # would follow the warm-up instead of overlapping the precompile workers.
            scorer, version, generation, served_path, warmed = start_model(
                settings, layout, client, choice, warm=warm if prefetch is not None else None
            )
        if prefetch is not None:
            prefetch.stop()
        clock.lap("load", split=load_phases)
        before_load = warmed is not None
        with recording() as warm_phases:
            if warmed is None:  # the weights had to come first
                warmed = warm(scorer)
            with phase("warmup"):
                sealed = seal(compile_cache, precompile, cache_remote)
        clock.lap("warmup", split=warm_phases)
        log.info(
            "consumer.warmed_up",
            compile_caches=compile_cache.variables if compile_cache else {},
            compile_cache=compile_cache.describe() if compile_cache else {},
            sealed_files=sealed,
            before_load=before_load,
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
