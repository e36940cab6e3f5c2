"""Versioned payloads that cross processes: requests, results, and their wire forms.

A job travels as one Redis stream entry whose fields are: `v` (schema version), `job_id`,
`meta` (JSON of the scalar options) and one field per array holding the binary codec
(`shared.codec`): little-endian data with a dtype + shape header, never JSON lists, never pickle.

Row j of every per-position result array scores position j+1 of `input_ids`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shared.codec import CodecError, decode_array, encode_array
from shared.errors import InvalidJob

SCHEMA_VERSION = 1


# Longest input a queue accepts while neither its settings nor a live consumer says otherwise.
DEFAULT_MAX_INPUT_TOKENS = 8192


@dataclass(frozen=True)
class Limits:
    """What a queue accepts; both submit and the consumer check jobs against these."""

    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS
    max_label_width: int = 64
    max_top_k: int = 256
    max_sample_n: int = 64
    vocab_size: int | None = None  # None: not known here, the consumer checks it
    # Where max_input_tokens comes from, named in the error of a job that exceeds it.
    max_input_source: str = "queue.max_input_tokens"

    @classmethod
    def for_queue(
        cls, queue: Any, *, vocab_size: int | None, model_max_tokens: int | None
    ) -> Limits:
        """The limits of a queue's settings (`QueueSettings`) for a model that takes at most
        `model_max_tokens` positions (None: not known). An unset `queue.max_input_tokens`
        means the model's limit, or DEFAULT_MAX_INPUT_TOKENS while no model is known; a set
        one above the model's limit is capped to it."""
        setting = queue.max_input_tokens
        if model_max_tokens is not None and (setting is None or setting > model_max_tokens):
            limit, source = model_max_tokens, "the model's max_position_embeddings"
        else:
            limit = DEFAULT_MAX_INPUT_TOKENS if setting is None else setting
            source = "queue.max_input_tokens"
        return cls(
            max_input_tokens=limit,
            max_label_width=queue.max_label_width,
            max_top_k=queue.max_top_k,
            max_sample_n=queue.max_sample_n,
            vocab_size=vocab_size,
            max_input_source=source,
        )


def inverse_temperature(temperature: float) -> float:
    """1 / temperature as the head multiplies by it (a float32 value), after checking the
    temperature: finite, > 0, and not so small that its float32 reciprocal overflows. Raises
    ValueError naming the value. Submit and the consumer both check requests with this rule
    (through `RequestOptions`), and the consumer computes the head's reciprocals with it."""
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    with np.errstate(over="ignore"):
        inv = np.float32(1.0 / temperature)
    if not np.isfinite(inv):
        raise ValueError(
            f"temperature {temperature} is too small: 1/temperature overflows float32 "
            f"(use a temperature >= {_MIN_TEMPERATURE:.3g})"
        )
    return float(inv)


# Smallest float64 temperature whose float32 reciprocal is finite (named in the error above).
_MIN_TEMPERATURE = 1.0 / float(np.finfo(np.float32).max)


class RequestOptions(BaseModel):
    """The scalar options of a request: the one list of them.

    `TeacherRequest` is built on it (a request is its options plus its arrays and bookkeeping);
    a dataset applies one to every row (a row's own value wins); the stream entry's `meta`, the
    content job id (`content_job_id`) and the consumer's batch columns
    (`consumer.forward.batch.BatchTensors`, one `<option>_J` tensor per option) are derived from
    its fields, in this order. A new option is a field here, with its validator; the guard test
    `tests/unit/test_messages.py::test_every_option_travels` checks that it reaches the
    consumer and enters the job id.

    A wrong field (an unknown name, a bad value) raises `InvalidJob` naming each problem."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise InvalidJob(_validation_message(exc)) from None

    sample_n: int = 0
    """Samples drawn from the teacher at each scored position."""
    top_k: int = 0
    """Top-k token ids (with full-vocabulary log-probs) at each scored position."""
    return_entropy: bool = False
    """Return the entropy of the teacher distribution at each scored position."""
    temperature: float = 1.0
    """Applied once to every output: softmax(logits / temperature)."""
    seed: int = 0
    """Sampling seed; the same seed gives the same samples whatever the batch or TP size."""

    @field_validator("sample_n", "top_k")
    @classmethod
    def _non_negative(cls, v: int, info: Any) -> int:
        if v < 0:
            raise ValueError(f"{info.field_name} must be >= 0, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        inverse_temperature(v)
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int) -> int:
        if not 0 <= v < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {v}")
        return v

    def option_values(self) -> dict[str, Any]:
        """The options by name, in OPTION_FIELDS order (what `meta` and the job id carry)."""
        return {k: getattr(self, k) for k in OPTION_FIELDS}


OPTION_FIELDS: tuple[str, ...] = tuple(RequestOptions.model_fields)
"""The names of the request options, in declaration order."""
REQUEST_ARRAYS = ("input_ids", "label_token_ids")
"""The arrays of a request, each a field of its stream entry in the binary codec."""


class TeacherRequest(RequestOptions):
    """One sequence to score: its options (`RequestOptions`), its arrays and bookkeeping.
    Arrays may be given as lists or numpy arrays.

    A wrong field (an unknown name, a bad value) raises `InvalidJob` naming each problem, as
    `TeacherClient.submit` does: one exception family whichever way a request is built."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, extra="forbid")

    input_ids: Any
    """Token ids [L], L >= 2."""
    label_token_ids: Any | None = None
    """Optional [L-1, W] token ids whose log-probs are wanted at each scored position."""
    job_id: str | None = None
    """Idempotency key; unset: a content hash of the request and queue."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Free-form JSON metadata returned untouched with the result."""
    min_model_generation: int | None = None
    """Only a consumer serving at least this model generation may compute the job (each
    `update-weights` increments the queue's generation; results carry the one that computed
    them). Older replicas leave the job for newer ones."""
    trace: dict[str, str] = Field(default_factory=dict)
    """Trace carrier (trace_id, parent span) set by the client."""
    prefix_id: str | None = None
    """Jobs with the same prefix_id share a prompt (e.g. the responses of one GRPO group):
    a consumer computes their longest common prefix once for all of them. Results do not
    depend on it."""

    @field_validator("input_ids", mode="before")
    @classmethod
    def _ids(cls, v: Any) -> np.ndarray:
        arr = _int_array(v, "input_ids")
        if arr.ndim != 1:
            raise ValueError(f"input_ids must be 1-D, got shape {list(arr.shape)}")
        if arr.size == 0:
            raise ValueError("input_ids is empty; expected at least 2 token ids")
        if arr.size < 2:
            raise ValueError("input_ids has 1 token; expected at least 2 (one position to score)")
        return arr

    @field_validator("label_token_ids", mode="before")
    @classmethod
    def _labels(cls, v: Any) -> np.ndarray | None:
        if v is None:
            return None
        if isinstance(v, list | tuple) and v and isinstance(v[0], list | tuple):
            widths = {len(row) for row in v}
            if len(widths) > 1:
                raise ValueError(
                    f"label_token_ids rows are ragged (widths {sorted(widths)}); "
                    "expected every row to have the same width W"
                )
        arr = _int_array(v, "label_token_ids")
        if arr.ndim != 2:
            raise ValueError(f"label_token_ids must be 2-D [L-1, W], got shape {list(arr.shape)}")
        return arr

    def model_post_init(self, __context: Any) -> None:
        labels = self.label_token_ids
        if labels is not None and labels.shape[0] != len(self.input_ids) - 1:
            raise ValueError(
                f"label_token_ids has {labels.shape[0]} rows; expected len(input_ids) - 1 = "
                f"{len(self.input_ids) - 1} (row j labels position j + 1)"
            )

    @property
    def num_tokens(self) -> int:
        """Length of input_ids."""
        return int(self.input_ids.shape[0])

    @property
    def label_width(self) -> int:
        """W of label_token_ids (0 when absent)."""
        return 0 if self.label_token_ids is None else int(self.label_token_ids.shape[1])


def _int_array(v: Any, name: str) -> np.ndarray:
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold integers, got dtype {v.dtype}")
        return v.astype(np.int64, copy=False)
    try:
        arr = np.asarray(v)
    except ValueError as exc:  # ragged nested lists
        raise ValueError(f"{name} is ragged; expected a rectangular array of ints") from exc
    if arr.dtype == object:
        raise ValueError(f"{name} is ragged or mixed; expected a rectangular array of ints")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got {arr.dtype} values")
    return arr.astype(np.int64)


def check_limits(req: TeacherRequest, limits: Limits) -> None:
    """Raise InvalidJob if the request exceeds the queue's limits or the vocabulary."""
    n = req.num_tokens
    if n > limits.max_input_tokens:
        raise InvalidJob(
            f"input_ids has {n} tokens; the maximum is {limits.max_input_tokens} "
            f"({limits.max_input_source})"
        )
    for name, value, cap in (
        ("sample_n", req.sample_n, limits.max_sample_n),
        ("top_k", req.top_k, limits.max_top_k),
        ("label width W", req.label_width, limits.max_label_width),
    ):
        if value > cap:
            raise InvalidJob(f"{name} is {value}; the maximum is {cap}")
    if limits.vocab_size is not None:
        v = limits.vocab_size
        if req.top_k > v:
            raise InvalidJob(f"top_k is {req.top_k}; it cannot exceed the vocabulary size {v}")
        for name, arr in (("input_ids", req.input_ids), ("label_token_ids", req.label_token_ids)):
            if arr is None or arr.size == 0:
                continue
            bad = (arr < 0) | (arr >= v)
            if bad.any():
                idx = np.argwhere(bad)[0]
                raise InvalidJob(
                    f"{name}{list(int(i) for i in idx)} = {int(arr[tuple(idx)])} is outside "
                    f"the vocabulary [0, {v})"
                )


def parse_request(data: dict[str, Any] | TeacherRequest) -> TeacherRequest:
    """Validate a request from a dict, raising InvalidJob with every problem named."""
    if isinstance(data, TeacherRequest):
        return data
    if not isinstance(data, dict):
        raise InvalidJob(f"expected a JSON object of request fields, got {type(data).__name__}")
    try:
        return TeacherRequest(**data)
    except TypeError as exc:
        raise InvalidJob(str(exc)) from None


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def content_job_id(
    req: TeacherRequest, *, queue: str, teacher: str | None, generation: int = 0
) -> str:
    """Idempotent job id: a hash of the arrays, the options, the queue, the teacher and the
    queue's weight generation (so the same tokens after `update-weights` are a new job,
    computed by the new weights; generation 0 hashes as before generations existed)."""
    h = hashlib.sha256()
    h.update(f"v{SCHEMA_VERSION}|{queue}|{teacher or ''}|".encode())
    if generation:
        h.update(f"g{int(generation)}|".encode())
    h.update(json.dumps(req.option_values(), sort_keys=True).encode())
    h.update(encode_array(req.input_ids))
    if req.label_token_ids is not None:
        h.update(encode_array(req.label_token_ids))
    return "j-" + h.hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Wire form of a job (stream entry fields)


# What a job's `meta` carries besides its options (and `submitted_at`, popped on decode).
_META_FIELDS = ("metadata", "min_model_generation", "trace", "prefix_id")


def encode_job(req: TeacherRequest, *, job_id: str, submitted_at: float | None = None) -> dict:
    """Stream entry fields for a validated request."""
    meta = req.option_values()
    meta.update(
        metadata=req.metadata,
        min_model_generation=req.min_model_generation,
        trace=req.trace,
        submitted_at=submitted_at if submitted_at is not None else time.time(),
    )
    if req.prefix_id is not None:  # absent when unset, so older consumers still accept the job
        meta["prefix_id"] = req.prefix_id
    fields: dict[str, Any] = {
        "v": str(SCHEMA_VERSION),
        "job_id": job_id,
        "meta": json.dumps(meta),
        "input_ids": encode_array(
            req.input_ids.astype(np.int32 if _fits32(req.input_ids) else np.int64)
        ),
    }
    if req.label_token_ids is not None:
        fields["label_token_ids"] = encode_array(req.label_token_ids)
    return fields


def _fits32(arr: np.ndarray) -> bool:
    return arr.size == 0 or (int(arr.min()) >= 0 and int(arr.max()) < 2**31)


@dataclass(frozen=True)
class Job:
    """A job as the consumer sees it: the request plus its stream identity."""

    job_id: str
    entry_id: str
    request: TeacherRequest
    submitted_at: float
    counted_tokens: int = 0  # what the submit script added to the pending-token counter
    fields: dict[bytes, bytes] = field(default_factory=dict, repr=False)  # the raw entry


def entry_tokens(fields: dict[bytes, bytes]) -> int:
    """The token count the submit script recorded on an entry (0 if absent or unreadable)."""
    raw = fields.get(b"n_tokens", b"0")
    try:
        return max(0, int(raw))
    except ValueError:
        return 0


def decode_job(entry_id: str, fields: dict[bytes, bytes], *, limits: Limits) -> Job:
    """Parse one stream entry; raise InvalidJob naming what is wrong (missing field, bad
    type, truncated array, limits...). Never raises anything else for bad input."""

    def text(name: str) -> str:
        raw = fields.get(name.encode())
        if raw is None:
            raise InvalidJob(
                f"stream entry has no {name!r} field; expected {sorted(REQUIRED_FIELDS)}"
            )
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise InvalidJob(f"field {name!r} is not UTF-8 text") from None

    version = text("v")
    if version != str(SCHEMA_VERSION):
        raise InvalidJob(f"schema version {version!r} is not supported; expected {SCHEMA_VERSION}")
    job_id = text("job_id")
    try:
        meta = json.loads(text("meta"))
    except json.JSONDecodeError as exc:
        raise InvalidJob(f"field 'meta' is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise InvalidJob(f"field 'meta' must be a JSON object, got {type(meta).__name__}")
    raw_ids = fields.get(b"input_ids")
    if raw_ids is None:
        raise InvalidJob("stream entry has no 'input_ids' field")
    # A bound on what decoding may allocate, well above the limit so that a job slightly too
    # long decodes and check_limits names the limit and where it comes from.
    max_el = 4 * limits.max_input_tokens
    try:
        ids = decode_array(raw_ids, name="input_ids", expect_ndim=1, max_elements=max_el)
        labels_raw = fields.get(b"label_token_ids")
        labels = None
        if labels_raw is not None:
            labels = decode_array(
                labels_raw,
                name="label_token_ids",
                expect_ndim=2,
                max_elements=max_el * max(limits.max_label_width, 1),
            )
    except CodecError as exc:
        raise InvalidJob(str(exc)) from None
    submitted_at = meta.pop("submitted_at", None)
    unknown = set(meta) - set(OPTION_FIELDS) - set(_META_FIELDS)
    if unknown:
        raise InvalidJob(f"field 'meta' has unknown keys {sorted(unknown)}")
    req = parse_request({"input_ids": ids, "label_token_ids": labels, "job_id": job_id, **meta})
    check_limits(req, limits)
    return Job(
        job_id=job_id,
        entry_id=entry_id,
        request=req,
        submitted_at=float(submitted_at) if isinstance(submitted_at, int | float) else 0.0,
        counted_tokens=entry_tokens(fields),
        fields=fields,
    )


REQUIRED_FIELDS = ("v", "job_id", "meta", "input_ids")  # of a job's stream entry


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class ResultArray:
    """One per-position result array: its name (a `TeacherResult` field, the record's
    `a:<name>` field, the export's column), its rank and element kind."""

    name: str
    dims: int  # 1: [L-1]; 2: [L-1, X]
    kind: str  # "float": float32 log-probs and entropies; "int": int64 token ids


RESULT_TABLE = (
    ResultArray("logprobs", 1, "float"),
    ResultArray("label_logprobs", 2, "float"),
    ResultArray("sampled_token_ids", 2, "int"),
    ResultArray("sampled_logprobs", 2, "float"),
    ResultArray("topk_token_ids", 2, "int"),
    ResultArray("topk_logprobs", 2, "float"),
    ResultArray("topk_rest_logprob", 1, "float"),
    ResultArray("entropy", 1, "float"),
)
"""Every result array, in the order records, exports and responses list them. Storage
(`shared/results.py`), the Parquet export (`producer/datasets/export.py`) and the gateway read
it; a new output is a row here and a field of `TeacherResult`."""
RESULT_ARRAYS: tuple[str, ...] = tuple(a.name for a in RESULT_TABLE)
"""The names of RESULT_TABLE."""


@dataclass
class TeacherResult:
    """Teacher outputs for one job; row j of each array scores position j + 1 of input_ids.

    Arrays not requested are None. A failed job has `error` set and no arrays.
    """

    job_id: str
    model_version: str = ""
    model_generation: int = 0  # the queue's weight generation that computed it
    logprobs: np.ndarray | None = None  # [L-1]
    label_logprobs: np.ndarray | None = None  # [L-1, W]
    sampled_token_ids: np.ndarray | None = None  # [L-1, n]
    sampled_logprobs: np.ndarray | None = None  # [L-1, n]
    topk_token_ids: np.ndarray | None = None  # [L-1, k]
    topk_logprobs: np.ndarray | None = None  # [L-1, k]
    topk_rest_logprob: np.ndarray | None = None  # [L-1] log of the mass outside the top-k
    entropy: np.ndarray | None = None  # [L-1]
    metadata: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    # False: stored while the queue's shard lacked the replicas `redis.min_replicas_acked`
    # asks for (redis.replica_ack_policy=degrade); a failover before a replica caught up
    # could lose this record, and the job would then be computed again.
    replicated: bool = True

    @property
    def ok(self) -> bool:
        """True when the job succeeded."""
        return self.error is None

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays present, by name."""
        return {k: v for k in RESULT_ARRAYS if (v := getattr(self, k)) is not None}

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (arrays as lists) for CLI output."""
        out: dict[str, Any] = {"job_id": self.job_id, "model_version": self.model_version}
        for k in RESULT_ARRAYS:
            v = getattr(self, k)
            out[k] = None if v is None else v.tolist()
        out.update(metadata=self.metadata, error=self.error, replicated=self.replicated)
        return out
