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

DEFAULT_HOME = Path(".teacherq")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class RedisSettings(_Section):
    url: str | None = None
    """Redis/Valkey URL (redis:// or rediss://, password in the URL). Unset: the embedded
    valkey-server under `home`, started on first use and shared by every local process."""

    home: Path = DEFAULT_HOME
    """Directory of the embedded server (data, AOF, pid file, log)."""

    socket_timeout_s: float = 30.0
    """Client socket timeout; blocking reads use shorter BLOCK times than this."""

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

    max_input_tokens: int = Field(default=8192, ge=2)
    """Longest accepted input_ids; longer jobs are rejected at submit with both lengths."""

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

    backpressure: Literal["block", "raise"] = "block"
    """What submit does above max_pending_tokens: block until there is room, or raise."""

    backpressure_timeout_s: float = Field(default=600.0, gt=0)
    """How long a blocked submit waits for room before raising."""

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
    checkpoint. Unset: the built-in tiny random-init preset (fixed seed)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype. float32 on CPU; bfloat16 is the usual choice on GPUs."""

    vocab_size: int | None = Field(default=None, ge=2)
    """Vocabulary size producers validate token ids against. Unset: taken from the model
    the consumers advertise, or the tiny preset's when no consumer has started."""

    seed: int = 1234
    """Seed of random-init weights (the tiny preset)."""


class ParallelSettings(_Section):
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree (ranks per replica)."""

    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel degree (only 1 is supported)."""


class StorageSettings(_Section):
    url: str = "file://.teacherq/objects"
    """Object store for bulk results: file://PATH, s3://BUCKET/PREFIX or memory://."""

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
    """Consumer name in the Redis group; unset: hostname-pid-dp<rank>."""

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

    job_timeout_s: float = Field(default=600.0, gt=0)
    """A batch running longer than this is considered hung: the consumer stops refreshing its
    entries and exits (a supervisor restarts it), so the entries are redelivered elsewhere."""

    prefetch_batches: int = Field(default=1, ge=0)
    """Batches read ahead while the device computes (0: no overlap)."""

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

    cuda_graphs: int = Field(default=4, ge=0)
    """Packed batch layouts whose forward is kept as a CUDA graph (CUDA at TP = 1 only), the
    most recently used; a layout is recorded the second time it comes. 0: always eager."""

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
    """Minimum log level."""

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
    `--megatron-server-max-length`); 0: only queue.max_input_tokens applies."""

    request_timeout_s: float = Field(default=3600.0, gt=0)
    """How long `/generate` waits for its job before answering 504."""

    update_timeout_s: float = Field(default=3600.0, gt=0)
    """How long `/update_weights_from_disk` waits for every replica (a request's `timeout_s`
    overrides it) before answering 503."""


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
        if self.parallel.pp != 1:
            raise ValueError(
                f"parallel.pp={self.parallel.pp}: pipeline parallelism is not supported; use pp=1"
            )
        return self

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

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise SettingsError(
                f"{path}: expected a mapping of sections, got {type(data).__name__}"
            )
        return data


class SettingsError(ValueError):
    """Settings could not be built; the message names each bad field and what is allowed."""


def load_settings(**overrides: Any) -> Settings:
    """Build the settings tree from the environment (and TEACHERQ_CONFIG), with overrides.

    Raises SettingsError whose message lists every bad field as `TEACHERQ_SECTION__FIELD`.
    """
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = "__".join(str(p) for p in err["loc"]).upper()
            where = f"TEACHERQ_{loc}" if loc else "settings"
            lines.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
        raise SettingsError("invalid teacherq settings:\n  " + "\n  ".join(lines)) from None


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
            shown = "unset" if default is None else f"`{default}`"
            doc = " ".join((field.description or "").split())
            rows.append(f"| `{env}` | {shown} | {doc} |")
    return "\n".join(rows)
