"""One settings tree for every teacherq process.

Read from the environment (prefix `TEACHERQ_`, nested delimiter `__`, e.g. `TEACHERQ_REDIS__URL`)
and optionally from a YAML/JSON file named by `TEACHERQ_CONFIG` (see configs/). Environment
variables win over the file. Every section is frozen: built once in `main()` and passed down.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from shared.errors import TeacherqError

HOME_DIR_NAME = ".teacherq"
# A directory holding one of these is a project root: its .teacherq/ is the project's home.
PROJECT_MARKERS = ("pyproject.toml", ".git")


def default_home(start: Path | None = None) -> Path:
    """Where the embedded server and local results live when `redis.home` is not set: one
    place per project or per user, never per current directory.

    Walking up from `start` (the current directory): the nearest existing `.teacherq/`, else
    `.teacherq/` beside the nearest `pyproject.toml` or `.git`; outside any project, the
    per-user `$XDG_STATE_HOME/teacherq` (`~/.local/state/teacherq`). Absolute.
    """
    here = (start or Path.cwd()).resolve()
    chain = [here, *here.parents]
    for d in chain:
        if (d / HOME_DIR_NAME).is_dir():
            return d / HOME_DIR_NAME
    for d in chain:
        if any((d / m).exists() for m in PROJECT_MARKERS):
            return d / HOME_DIR_NAME
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state).resolve() / "teacherq"


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class RedisSettings(_Section):
    url: str | None = None
    """Redis/Valkey URL (redis:// or rediss://, password in the URL). Unset: the embedded
    valkey-server under `home`, started on first use and shared by every local process."""

    home: Path = Field(default_factory=default_home)
    """Directory of the embedded server (data, AOF, pid file, log). Unset: the project's
    `.teacherq/` (found by walking up to an existing `.teacherq/`, a `pyproject.toml` or a
    `.git`), else the per-user `$XDG_STATE_HOME/teacherq` (`~/.local/state/teacherq`)."""

    socket_timeout_s: float = 30.0
    """Client socket timeout; blocking reads use shorter BLOCK times than this."""

    mode: Literal["standalone", "cluster", "sentinel"] = "standalone"
    """How `url` is read: `standalone` (one server), `cluster` (a Redis/Valkey Cluster; the
    URL names any node, the others are discovered), `sentinel` (the URL names one sentinel;
    the master of the service `sentinel_master` is looked up there and followed over
    failovers). Each queue lives on one shard: all its keys share the `{queue}` hash tag."""

    sentinel_master: str = "mymaster"
    """With mode `sentinel`: the service name the sentinels monitor."""

    min_replicas_acked: int = Field(default=0, ge=0)
    """Replicas that must hold a write before it counts (WAIT): submit returns, and a
    consumer finishes a job, only after its write reached this many replicas, so a failover
    loses no acknowledged job. 0: do not wait (a failover may lose the last second of work)."""

    replica_ack_timeout_s: float = Field(default=10.0, gt=0)
    """With min_replicas_acked: how long to wait for the replicas before the write is
    reported as not replicated (submit raises; a consumer follows `replica_ack_policy`)."""

    replica_ack_policy: Literal["wait", "degrade"] = "wait"
    """What a consumer does when its writes cannot reach `min_replicas_acked` replicas within
    `replica_ack_timeout_s` (the queue's shard lost its replicas, e.g. after a failover):
    `wait` (durability first) holds the results and retries until a replica is back;
    `degrade` writes them without the acknowledgement, marked (`TeacherResult.replicated` is
    False), logged and counted, and goes back to acknowledged writes as soon as the shard has
    the replicas again. Submits always wait (they raise NotReplicated)."""

    @model_validator(mode="after")
    def _mode_needs_url(self) -> RedisSettings:
        if self.mode != "standalone" and self.url is None:
            raise ValueError(
                f"redis.mode={self.mode} needs TEACHERQ_REDIS__URL (the embedded server is "
                "standalone)"
            )
        return self

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"must start with redis://, rediss:// or unix://, got {v!r}")
        return v


class QueueSettings(_Section):
    name: str = "default"
    """Queue name; every key of a queue shares the `{name}` hash tag."""

    group: str = "consumers"
    """Redis consumer group the consumers of this queue join."""

    max_input_tokens: int | None = Field(default=None, ge=2)
    """Longest accepted input_ids; longer jobs are rejected at submit with both lengths.
    Unset: the limit the live consumers advertise (their model's max_position_embeddings,
    extended by its RoPE scaling), or 8192 before any consumer has started. A consumer
    refuses a job longer than its model's limit whatever this says."""

    max_label_width: int = Field(default=64, ge=0)
    """Largest W of label_token_ids [L-1, W]."""

    max_top_k: int = Field(default=256, ge=0)
    """Largest top_k a job may ask for."""

    max_sample_n: int = Field(default=64, ge=0)
    """Largest sample_n a job may ask for."""

    inline_max_bytes: int = Field(default=64 * 1024, ge=0)
    """Result arrays up to this many bytes in total are stored inline in Redis; larger go to
    object storage with a checksum."""

    result_ttl_s: int = Field(default=7 * 24 * 3600, ge=60)
    """How long result records stay in Redis."""

    max_pending_tokens: int = Field(default=50_000_000, ge=1)
    """Backpressure: submit waits (or raises) while the queue holds more tokens than this."""

    max_memory_fraction: float = Field(default=0.85, gt=0, le=1)
    """Backpressure on memory: submit waits (or raises) while Redis uses more than this
    fraction of its maxmemory (no effect without maxmemory). Keep it below
    consumer.memory_pause_fraction so results always have room to be stored."""

    backpressure: Literal["block", "raise"] = "block"
    """What submit does above max_pending_tokens or max_memory_fraction: block until there is
    room, or raise QueueFull."""

    backpressure_timeout_s: float = Field(default=600.0, gt=0)
    """How long a blocked submit waits for room before raising."""

    trace_ttl_s: int = Field(default=3 * 24 * 3600, ge=60)
    """How long span records (`teacherq trace`) stay in Redis; shorter than result_ttl_s
    by default, since traces are for diagnosis, not an archive."""

    trace_sample_rate: float = Field(default=1.0, ge=0, le=1)
    """Share of traces recorded (decided from the trace id, so every process a job crosses
    agrees); 0 records none. Traces are most of a small job's memory (docs/deploy.md)."""

    delete_result_on_read: bool = False
    """Delete a result record from Redis once the client has read it (`wait`/`results`):
    for trainers that read each result once; bulk arrays stay in object storage."""

    max_replays: int = Field(default=3, ge=0)
    """How often one job may be replayed from the dead-letter stream (stops endless
    re-poisoning); `--force` overrides."""

    @field_validator("name", "group")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or any(c in v for c in "{}: \t\n"):
            raise ValueError(f"must be non-empty without braces, colons or spaces, got {v!r}")
        return v


class ModelSettings(_Section):
    path: str | None = None
    """Teacher checkpoint: a Hugging Face safetensors directory or a Megatron torch_dist
    checkpoint. Unset: the built-in tiny random-init preset (fixed seed). After a done
    `teacherq update-weights` a starting consumer serves the queue's updated weights instead
    (logged as `model.selected`); `update-weights --reset` returns to this one."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype. auto: bfloat16 on a CUDA device, float32 on the CPU."""

    fp8: Literal["auto", "dequantize"] = "auto"
    """FP8 block-quantized checkpoints (`quantization_config`, as DeepSeek-V3 publishes): auto:
    where the device runs block-scaled FP8 GEMMs (sm90+, CUDA 12.9+, 128x128 blocks) the
    tensor-parallel linears (attention, dense MLPs) and the routed MoE experts keep FP8
    weights and multiply in FP8, the rest is dequantized; elsewhere all is dequantized.
    dequantize: always expand the weights at load to `model.dtype` (bf16: twice the FP8
    bytes). The log says which (`checkpoint.fp8_*`)."""

    prefetch: bool = False
    """Read the checkpoint's files into the page cache once torch is imported, and warm up
    on zero weights meanwhile, loading them after (a local Hugging Face directory that fits
    in half the memory available; one rank per machine). Off by default: on an H100 host it
    gained nothing, the warm-up's own disk reads waiting behind it (docs/benchmarks.md)."""

    vocab_size: int | None = Field(default=None, ge=2)
    """Vocabulary size producers validate token ids against. Unset: taken from the model
    the consumers advertise, or the tiny preset's when no consumer has started."""

    seed: int = 1234
    """Seed of random-init weights (the tiny preset)."""


class ParallelSettings(_Section):
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree (ranks per TP group; a replica is max(tp, ep) x pp ranks)."""

    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel degree: a replica spans pp stages of max(tp, ep) ranks, each holding
    a consecutive slice of the layers (the first num_layers % pp stages one more)."""

    microbatches: int = Field(default=0, ge=0)
    """At pp > 1, micro-batches each batch is cut into (at document boundaries) so that the
    stages work on different ones at once; 0: pp + 1, the fewest with no stage idle."""

    ep: int = Field(default=1, ge=1)
    """Expert-parallel degree for mixture-of-experts teachers: experts split `ep` ways over a
    replica of max(tp, ep) ranks (the smaller must divide the larger); 1 for dense teachers."""


class StorageSettings(_Section):
    url: str = ""
    """Object store for bulk results: file://PATH, s3://BUCKET/PREFIX or memory://. Unset:
    `file://<redis.home>/objects`, beside the embedded server."""

    endpoint: str | None = None
    """S3 endpoint URL (MinIO, moto); unset: AWS or the standard AWS_* environment."""

    region: str | None = None
    """S3 region; unset: standard AWS environment."""

    access_key_id: str | None = None
    """S3 access key; unset: standard AWS environment."""

    secret_access_key: str | None = None
    """S3 secret key; unset: standard AWS environment."""


class ConsumerSettings(_Section):
    name: str | None = None
    """Consumer name in the Redis group; keep it stable across restarts (a restarted consumer
    first finishes its own pending entries). Unset: the pod name (HOSTNAME) under Kubernetes,
    else hostname-pid. With DP > 1, `-dp<rank>` is appended."""

    batch_max_jobs: int = Field(default=64, ge=1)
    """At most this many jobs are read from the stream per batch."""

    token_budget: int = Field(default=8192, ge=16)
    """Tokens per forward (packed); a longer job runs alone."""

    block_ms: int = Field(default=1000, ge=1)
    """XREADGROUP BLOCK time; also how often the stop flag is checked when idle."""

    visibility_timeout_s: float = Field(default=300.0, gt=0)
    """An entry idle this long is taken over by another consumer. A live consumer refreshes
    its in-flight entries every heartbeat, so only entries of dead or stuck consumers idle."""

    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    """How often a consumer records its heartbeat and refreshes its in-flight entries."""

    dead_after_beats: int = Field(default=3, ge=2)
    """A consumer whose heartbeat is older than this many intervals is dead: its pending
    entries are taken over at once, and its name and heartbeat are pruned once it holds none."""

    @property
    def live_after_s(self) -> float:
        """A heartbeat younger than this marks a live consumer (`dead_after_beats` intervals)."""
        return self.heartbeat_interval_s * self.dead_after_beats

    memory_pause_fraction: float = Field(default=0.95, gt=0, le=1)
    """Above this fraction of Redis's maxmemory (or while result writes are refused as out
    of memory) consumers take no new work, and resume when there is room."""

    max_queued_writes: int = Field(default=64, ge=1)
    """Results waiting to be stored, at most, per consumer; scoring waits for room."""

    stop_grace_s: float = Field(default=60.0, gt=0)
    """After SIGTERM, results that still cannot be stored this long (Redis full or down) are
    given up unacknowledged, so their entries are redelivered; keep it below the supervisor's
    grace period (docker-compose stop_grace_period)."""

    job_timeout_s: float = Field(default=600.0, gt=0)
    """A batch running longer than this is considered hung: the consumer stops refreshing its
    entries and exits (a supervisor restarts it), so the entries are redelivered elsewhere."""

    prefetch_batches: int = Field(default=1, ge=0)
    """Batches read ahead while the device computes (0: no overlap)."""

    batches_in_flight: int = Field(default=2, ge=1)
    """Batches left queued on the device while the host stores older results and prepares
    the next (a replica of one rank; a replica of several finishes each batch at once). 1
    hides the host's work behind one batch's compute; 2 also absorbs a batch whose host work
    takes longer than that (a CUDA graph recorded, a slow claim), at one more batch of result
    latency under full load."""

    store_threads: int = Field(default=2, ge=1)
    """Background threads that upload results, write records and acknowledge."""

    max_in_flight_total: int | None = Field(default=None, ge=1)
    """If set, the jobs in flight across all live replicas of the queue: each replica reads at
    most ceil(total / live replicas) jobs per batch (never more than batch_max_jobs)."""

    durable_redis: Literal["refuse", "warn"] = "refuse"
    """Start-up check of the Redis server: AOF must be on and maxmemory-policy noeviction;
    refuse to start, or only warn."""

    janitor_interval_s: float = Field(default=60.0, gt=0)
    """How often the leader trims acknowledged entries off the jobs stream."""

    sleep_after_idle_s: float = Field(default=0.0, ge=0)
    """Offload weights to host memory after this long without work (0: never); new work or a
    weight update wakes the consumer."""

    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Port of the Prometheus /metrics and /healthz endpoint (0: off); the leader of
    data-parallel replica d of a launch serves on port + d."""

    crash_at: str | None = None
    """Fault injection for tests only: `<point>:<n>` makes the process exit abruptly
    (os._exit) at the n-th time it reaches point read, compute, stored or acked."""

    poison: str | None = None
    """Fault injection for tests only: `<raise|exit|hang>:<token id>` makes every job holding
    that token fail in that way."""

    raise_at: str | None = None
    """Fault injection for tests only: `<rank>:<n>` makes that global rank raise while checking
    its n-th batch (the group must agree on the failure, not hang)."""

    max_deliveries: int = Field(default=3, ge=1)
    """An entry delivered more often than this goes to the dead-letter stream."""

    min_shared_prefix: int = Field(default=64, ge=0)
    """Jobs read together whose leading tokens agree for at least this many tokens share one
    forward of that prompt (0: only jobs with the same explicit prefix_id share)."""

    head_chunk_rows: int = Field(default=4096, ge=1)
    """Rows of logits the head processes at once: peak extra memory ~ rows x vocab/tp x 2 B on
    the GPU (fused kernels read the bf16 chunk) and a few fp32 copies of it on the CPU."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; auto picks CUDA when available."""

    cuda_graphs: int = Field(default=128, ge=0)
    """CUDA graphs of the forward kept, the most recently used (CUDA at TP = 1, dense teachers
    only: a MoE layer's shapes follow its routing). In 16-bit one graph serves every batch of
    a bucket (token count, segment count and longest segment rounded up), whatever its
    lengths; in fp32 one exact layout. A bucket is recorded the first time it comes, a layout
    the second. 0: always eager."""

    compile_cache_dir: Path | None = None
    """Where compiled kernels are kept across restarts and machines: one subdirectory per
    environment (torch, Triton, CUDA, GPU model, Python, kernel sources), holding Triton's
    TRITON_CACHE_DIR, torch inductor's TORCHINDUCTOR_CACHE_DIR and quack-kernels'
    QUACK_CACHE_DIR (set before anything compiles) and a manifest with a checksum per file,
    written after the warm-up; a corrupt subdirectory is set aside and rebuilt. Unset:
    `<redis.home>/compile-cache`, unless TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR /
    QUACK_CACHE_DIR are set already (then used as they are, not sealed). In a container, point
    it at a volume the consumers share (docs/operations.md)."""

    compile_cache_url: str | None = None
    """An object-store location (`s3://bucket/prefix`, `file:///path`; reached with the
    `storage.*` endpoint and keys) that also keeps each environment's sealed compile cache, as
    one archive: a consumer whose local cache is not sealed (a fresh machine) fetches it,
    checks every file against its manifest and only then uses it; a seal that added kernels
    stores it again. For machines that share no volume (docs/operations.md). Unset: local
    only."""

    compile_cache_seed: Path | None = None
    """A folder of kernels compiled ahead of time, where the image was built and without a
    GPU (`python -m consumer.serve.bake DIR`, for sm90: H100, H200), that fills a compile
    cache not sealed yet, so that a fresh machine's first start compiles no kernel. Each file
    is copied after its checksum is checked; a seed compiled for another Triton, quack-kernels
    or kernel source is not used (docs/operations.md). Unset: none."""

    expert_gemms: Literal["auto", "triton"] = "auto"
    """How a mixture-of-experts teacher's bf16 routed experts multiply on an sm90 GPU (H100,
    H200). auto: through quack-kernels' GEMMs where that package is installed (the `hopper`
    extra) and a check of both GEMMs on the device agrees with torch, else through teacherq's
    Triton kernels; triton: always the Triton kernels (quack is then neither imported nor
    compiled for). FP8 experts and other GPUs always take the Triton kernels
    (docs/moe.md)."""

    precompile: bool = True
    """On CUDA, compile the warm-up's Triton kernels (and quack-kernels' GEMMs, where they
    serve) in parallel worker processes started before torch is imported, so that the warm-up
    finds them in the compile cache (the `compile` phase of `consumer.ready`); off: the
    warm-up compiles them one after another."""

    precompile_workers: int = Field(default=0, ge=0)
    """Worker processes of `precompile` per rank; 0: the host's cores left by its ranks,
    shared among them, at most 8."""

    precompile_timeout_s: float = Field(default=180.0, gt=0)
    """How long a rank waits for its precompile workers before its warm-up (the workers still
    running are stopped; the warm-up compiles what they had not)."""

    warmup: Literal["auto", "full", "minimal"] = "auto"
    """Warm-up before a consumer reports ready: `full` runs every output combination the queue
    limits allow (and, with CUDA graphs, records the graph of a full batch for each
    document-length class), so the first batch of any output runs at warm speed; `minimal`
    runs one small batch (quicker start, slower first batches). auto: full on CUDA, where
    kernels compile, minimal elsewhere."""

    # Teacher-only: a consumer never trains. These exist so that a settings file written for a
    # trainer is refused with a clear reason instead of being half-honoured.
    train: bool = False
    """Must stay false: consumers build no optimizer and keep no gradients."""

    @field_validator("train")
    @classmethod
    def _teacher_only(cls, v: bool) -> bool:
        if v:
            raise ValueError("consumers are teacher-only: training settings are not supported")
        return v


class LogSettings(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Minimum log level of every teacherq process (logs always go to stderr). Unset: info
    for the services (consumer, rq worker), warning for one-shot CLI verbs and for a process
    that did not configure logging, e.g. a trainer using TeacherClient, where the environment
    variable alone counts."""

    format: Literal["auto", "json", "console"] = "auto"
    """auto: pretty on a TTY, JSON lines otherwise."""


class GatewaySettings(_Section):
    host: str = "127.0.0.1"
    """Address `teacherq serve` listens on (0.0.0.0: every interface)."""

    port: int = Field(default=7999, ge=0, le=65535)
    """Port of `teacherq serve` (slime's teacher server default; 0: any free port)."""

    temperature: float = Field(default=1.0, gt=0)
    """Temperature `/generate` applies when a request names none (slime's server-wide
    `--rollout-temperature`)."""

    max_length: int = Field(default=0, ge=0)
    """`/generate` answers 413 for inputs longer than this (slime's
    `--megatron-server-max-length`); 0: only the queue's own input limit applies."""

    request_timeout_s: float = Field(default=3600.0, gt=0)
    """How long `/generate` waits for its job before answering 504."""

    update_timeout_s: float = Field(default=3600.0, gt=0)
    """How long `/update_weights_from_disk` waits for every replica (a request's `timeout_s`
    overrides it) before answering 503."""

    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Largest request body accepted (413 above it); slime's server takes 64 MiB."""

    backlog: int = Field(default=2048, ge=1)
    """Listen backlog: connections a burst may open before the gateway accepts them (the
    kernel caps it at net.core.somaxconn)."""

    coalesce_ms: float = Field(default=1.0, ge=0)
    """Requests arriving within this window of each other are submitted in one batch (one
    set of Redis round trips); 0: those of the same event-loop tick."""

    shutdown_grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM the gateway stops accepting and gives requests in flight this long to be
    answered; those still waiting then are cancelled with their jobs."""


class Settings(BaseSettings):
    """The whole teacherq configuration."""

    model_config = SettingsConfigDict(
        env_prefix="TEACHERQ_", env_nested_delimiter="__", frozen=True, extra="forbid"
    )

    redis: RedisSettings = RedisSettings()
    queue: QueueSettings = QueueSettings()
    model: ModelSettings = ModelSettings()
    parallel: ParallelSettings = ParallelSettings()
    storage: StorageSettings = StorageSettings()
    consumer: ConsumerSettings = ConsumerSettings()
    log: LogSettings = LogSettings()
    gateway: GatewaySettings = GatewaySettings()

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        if self.queue.max_memory_fraction >= self.consumer.memory_pause_fraction:
            raise ValueError(
                f"queue.max_memory_fraction={self.queue.max_memory_fraction} must be below "
                f"consumer.memory_pause_fraction={self.consumer.memory_pause_fraction}: "
                "results need room above what submit may fill"
            )
        if not self.storage.url:
            # A value derived from another section: set once here, while the tree is built
            # (frozen models have no other way in).
            derived = self.storage.model_copy(update={"url": f"file://{self.redis.home}/objects"})
            object.__setattr__(self, "storage", derived)
        return self

    def with_queue(self, name: str) -> Settings:
        """These settings with `name` as the queue name (the same object when it already is)."""
        if self.queue.name == name:
            return self
        return self.model_copy(update={"queue": self.queue.model_copy(update={"name": name})})

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _FileSource(settings_cls))


class _FileSource(PydanticBaseSettingsSource):
    """Values from the file named by TEACHERQ_CONFIG (YAML or JSON), below the environment."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("TEACHERQ_CONFIG")
        if not path:
            return {}
        p = Path(path)
        if not p.is_file():
            raise SettingsError(f"TEACHERQ_CONFIG={path!r}: no such file")
        text = p.read_text()
        if p.suffix in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f":{mark.line + 1}" if mark is not None else ""
                problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
                raise SettingsError(
                    f"TEACHERQ_CONFIG={path}{where}: not valid YAML ({problem})"
                ) from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SettingsError(
                    f"TEACHERQ_CONFIG={path}:{exc.lineno}: not valid JSON ({exc.msg})"
                ) from None
        if not isinstance(data, dict):
            raise SettingsError(
                f"{path}: expected a mapping of sections, got {type(data).__name__}"
            )
        return data


class SettingsError(TeacherqError, ValueError):
    """Settings could not be built; the message names each bad field and what is allowed."""


def load_settings(**overrides: Any) -> Settings:
    """Build the settings tree from the environment (and TEACHERQ_CONFIG), with overrides.

    Raises SettingsError whose message lists every bad field as `TEACHERQ_SECTION__FIELD`.
    """
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        config = os.environ.get("TEACHERQ_CONFIG")
        lines = []
        for err in exc.errors():
            loc = "__".join(str(p) for p in err["loc"]).upper()
            env = f"TEACHERQ_{loc}"
            if not loc:
                where = "settings"
            elif env in os.environ or not config:
                where = env
            else:  # the value can only have come from the file
                where = f"{config}: {'.'.join(str(p) for p in err['loc'])} (or {env})"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg} (got {err.get('input')!r})")
        raise SettingsError("invalid teacherq settings: " + "; ".join(lines)) from None


def to_env(settings: Settings) -> dict[str, str]:
    """The TEACHERQ_* environment that reproduces `settings` in a child process."""
    env: dict[str, str] = {}
    for section, values in settings.model_dump(mode="json").items():
        for name, value in values.items():
            if value is None:
                continue
            key = f"TEACHERQ_{section}__{name}".upper()
            env[key] = json.dumps(value) if isinstance(value, dict | list) else str(value)
    return env


def settings_reference() -> str:
    """A markdown table of every setting: environment name, default, description."""
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for section, info in Settings.model_fields.items():
        model = info.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        for name, field in model.model_fields.items():
            env = f"TEACHERQ_{section}__{name}".upper()
            default = field.default
            if field.default_factory is not None or default == "":
                shown = "unset"
            else:
                shown = "unset" if default is None else f"`{default}`"
            doc = " ".join((field.description or "").split())
            rows.append(f"| `{env}` | {shown} | {doc} |")
    return "\n".join(rows)
