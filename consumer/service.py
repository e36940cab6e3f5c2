"""Build a consumer from settings and run it: the body of `python -m consumer`."""

from __future__ import annotations

import structlog
import torch

from consumer import cpu_compat
from consumer.batching import batch_from_jobs, broadcast_text
from consumer.faults import FaultInjector
from consumer.follower import follow
from consumer.graphs import GraphedForward
from consumer.leader import Leader
from consumer.model import TINY, build_model
from consumer.parallel import ParallelLayout, init_parallel, shutdown
from consumer.preflight import UnsafeRedis, preflight
from consumer.scoring import Scorer
from consumer.stop import StopFlag
from shared.messages import Job, TeacherRequest
from shared.settings import Settings

log = structlog.get_logger("teacherq.consumer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(setting: str) -> torch.device:
    """The device this rank computes on."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def build_scorer(
    settings: Settings, layout: ParallelLayout, path: str | None = None
) -> tuple[Scorer, str]:
    """Load the teacher on this rank — `path` if given (a weight update), else the configured
    one; returns the scorer and the model version."""
    device = pick_device(settings.consumer.device)
    dtype = _DTYPES[settings.model.dtype]
    path = path or settings.model.path
    if path is None:
        from consumer.checkpoints import check_parallel

        spec = TINY
        check_parallel(spec, layout.tp)
        model = build_model(
            spec, layout, params_dtype=dtype, device=device, seed=settings.model.seed
        )
        version = f"tiny-random-seed{settings.model.seed}"
    else:
        from consumer.checkpoints import load_teacher

        model, spec, version = load_teacher(path, layout, params_dtype=dtype, device=device)
    scorer = Scorer(
        model=model,
        spec=spec,
        layout=layout,
        device=device,
        chunk_rows=settings.consumer.head_chunk_rows,
        graphs=graphed_forward(model, settings, layout, device),
    )
    return scorer, version


def graphed_forward(
    model: torch.nn.Module, settings: Settings, layout: ParallelLayout, device: torch.device
) -> GraphedForward | None:
    """CUDA graphs for the forward where they apply (see consumer/graphs.py)."""
    graphs = settings.consumer.cuda_graphs
    if device.type != "cuda" or layout.tp != 1 or graphs == 0:
        return None
    return GraphedForward(model, max_graphs=graphs)


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


def run(settings: Settings) -> int:
    """Serve the queue until stopped; returns the process exit code. Raises UnsafeRedis,
    before loading the model, when the start-up checks refuse (see `preflight`)."""
    cpu_compat.apply()
    stop = StopFlag()
    stop.install()
    layout = init_parallel(tp=settings.parallel.tp, pp=settings.parallel.pp)
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
        client, served = None, None
        verdict = ""
        if layout.is_leader:
            from shared.redis_server import connect

            client = connect(settings.redis)
            verdict = preflight(client, settings)
        # Start-up checks come before the model loads (minutes for a large teacher), and every
        # rank of the group learns their verdict: all exit with the configuration code.
        verdict = broadcast_text(verdict, src=layout.leader_rank, group=layout.tp_group)
        if verdict:
            raise UnsafeRedis(verdict)
        if layout.is_leader:
            from shared import weights

            assert client is not None
            control_cursor = last_control_id(client, settings.queue.name)
            served = weights.current(client, settings.queue.name)
        # The queue may have moved to other weights (update-weights): every rank loads those.
        path = broadcast_text(
            (served.path or "") if served else "", src=layout.leader_rank, group=layout.tp_group
        )
        scorer, version = build_scorer(settings, layout, path or None)
        warmup(scorer)

        def reload(new_path: str) -> tuple[Scorer, str]:
            fresh, fresh_version = build_scorer(settings, layout, new_path)
            warmup(fresh)
            return fresh, fresh_version

        if not layout.is_leader:
            follow(scorer, faults, reload=reload)
            return 0
        from shared.storage import ObjectStore

        st = settings.storage
        store = ObjectStore.from_url(
            st.url,
            endpoint=st.endpoint,
            region=st.region,
            access_key_id=st.access_key_id,
            secret_access_key=st.secret_access_key,
        )
        assert client is not None and served is not None
        leader = Leader(
            settings=settings,
            scorer=scorer,
            client=client,
            store=store,
            model_version=version,
            stop=stop,
            faults=faults,
            reload=reload,
            generation=served.generation,
            control_cursor=control_cursor,
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
