"""Build a consumer from settings and run it: the body of `python -m consumer`."""

from __future__ import annotations

import os
import socket
from typing import Any, cast

import redis
import structlog
import torch

from consumer import cpu_compat
from consumer.attention import varlen_supported
from consumer.batching import batch_from_jobs, broadcast_text
from consumer.faults import FaultInjector
from consumer.follower import follow
from consumer.graphs import GraphedForward
from consumer.leader import Leader
from consumer.model import TINY, build_model
from consumer.parallel import ParallelLayout, init_parallel, shutdown
from consumer.preflight import UnsafeRedis, preflight
from consumer.reload import load_agreed
from consumer.scoring import Scorer
from consumer.stop import StopFlag
from shared import weights
from shared.errors import InvalidCheckpoint
from shared.messages import Job, TeacherRequest
from shared.settings import Settings

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
    if layout.pp > 1:  # consumer/pipeline.py: stage to stage, micro-batches in flight
        from consumer.pipeline import PipelineScorer

        return PipelineScorer(**common, microbatches=settings.parallel.microbatches), version
    return Scorer(**common, graphs=graphed_forward(model, settings, layout, device)), version


def graphed_forward(
    model: torch.nn.Module, settings: Settings, layout: ParallelLayout, device: torch.device
) -> GraphedForward | None:
    """CUDA graphs for the forward where they apply (see consumer/graphs.py)."""
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


def warmup(scorer: Scorer) -> None:
    """One small forward on every rank so the first real batch pays no allocation cost."""
    req = TeacherRequest(input_ids=[0, 1, 2, 3], top_k=1, sample_n=1, return_entropy=True)
    scorer.score(
        batch_from_jobs([Job(job_id="warmup", entry_id="0-0", request=req, submitted_at=0)])
    )


def start_model(
    settings: Settings,
    layout: ParallelLayout,
    client: redis.Redis | None,
    choice: weights.StartChoice | None,
) -> tuple[Scorer, str, int]:
    """Load the weights this replica starts on (`weights.start_choice`, made by the leader and
    broadcast): the queue's updated weights if any, else the configured model. If the queue's
    weights cannot be loaded, the running update is recorded as failed and the replica starts
    on the weights before it (or its configured model) instead of dying; returns scorer,
    version and the generation served. Only the configured model failing is fatal."""
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
            return loaded[0], loaded[1], choice.generation
        return loaded[0], loaded[1], 0
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
    return scorer, version, generation


class CheckpointLoadError(InvalidCheckpoint):
    """The configured model (TEACHERQ_MODEL__PATH) cannot be loaded: a configuration error."""


def run(settings: Settings) -> int:
    """Serve the queue until stopped; returns the process exit code. Raises UnsafeRedis,
    before loading the model, when the start-up checks refuse (see `preflight`)."""
    cpu_compat.apply()
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
            from shared.redis_server import connect

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
        scorer, version, generation = start_model(settings, layout, client, choice)
        warmup(scorer)

        def reload(new_path: str) -> tuple[Scorer, str]:
            fresh, fresh_version = build_scorer(settings, layout, new_path)
            warmup(fresh)
            return fresh, fresh_version

        if not layout.is_leader:
            follow(scorer, faults, reload=reload)
            return 0
        from shared.storage import ObjectStore

        store = ObjectStore.from_settings(settings.storage)
        assert client is not None and choice is not None
        leader = Leader(
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
