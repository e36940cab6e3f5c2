"""The dataset record: its spec (what the dataset is and how to run it), the Redis hash that
holds its state and progress, how dataset and row ids are made, and finding datasets."""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import redis
from pydantic import BaseModel, ConfigDict, Field

from shared import keys
from shared.errors import TeacherqError
from shared.messages import OPTION_FIELDS, REQUEST_ARRAYS, RequestOptions

# redis-py's replies, as this package reads them (the client does not decode responses).
Entries = list[tuple[bytes, dict[bytes, bytes]]]
XRead = list[tuple[bytes, Entries]]

# The first retry is immediate: the usual cause is a killed worker, and the new job resumes
# from the recorded offset. Later ones back off for Redis or object-store trouble.
RETRY_INTERVALS_S = (0, 10, 60)
ROW_FIELDS = frozenset({*REQUEST_ARRAYS, *OPTION_FIELDS, "metadata"})
"""The fields a row may carry: the request's arrays, its options (`RequestOptions`) and
metadata."""


def unknown_fields_message(names: Iterable[str]) -> str:
    """'unknown field 'topk' (did you mean 'top_k'?)': how every unknown field is named."""
    parts = []
    for name in sorted(names):
        close = difflib.get_close_matches(name, sorted(ROW_FIELDS), n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown field{'s' if len(parts) > 1 else ''} " + ", ".join(parts)


_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class DatasetError(TeacherqError):
    """A dataset cannot be submitted or found; the message says why."""


class DatasetSpec(BaseModel):
    """What a dataset is (input, queue, options: its identity) and how to run it (the rest)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    v: int = 1
    dataset_id: str
    input: str
    format: Literal["jsonl", "parquet"]
    queue: str
    options: RequestOptions = RequestOptions()
    """Options applied to every row (`shared.messages.RequestOptions`); a row's own value
    wins."""
    output: str
    batch_rows: int = Field(default=256, ge=1, le=2000)
    max_pending_tokens: int = Field(default=4_000_000, ge=1)
    shard_rows: int = Field(default=10_000, ge=1)
    slice_s: float = Field(default=120.0, gt=0)
    retry_intervals: tuple[int, ...] = RETRY_INTERVALS_S
    keep_fields: tuple[str, ...] = ()
    """Fields/columns besides ROW_FIELDS that rows may carry (ignored, listed in the manifest);
    any other unknown field rejects the submission (or its row), as `submit` does."""

    def identity(self) -> tuple[str, str, str, RequestOptions]:
        """The fields an existing dataset id must agree on."""
        return (self.input, self.format, self.queue, self.options)


_INT_FIELDS = (
    "total_rows",
    "next_row",
    "byte_offset",
    "rows_queued",
    "rows_rejected",
    "tokens_queued",
)
_TIME_FIELDS = (
    "created_at",
    "updated_at",
    "ingest_started_at",
    "ingested_at",
    "export_started_at",
    "done_at",
)


@dataclass
class DatasetRecord:
    """A dataset as stored in its Redis hash."""

    spec: DatasetSpec
    state: str
    error: str | None = None
    rq_job: str | None = None
    total_rows: int | None = None
    next_row: int = 0
    byte_offset: int = 0
    rows_queued: int = 0
    rows_rejected: int = 0
    tokens_queued: int = 0
    done_cursor: str = "0-0"
    ignored_fields: list[str] = field(default_factory=list)
    created_at: float | None = None
    updated_at: float | None = None
    ingest_started_at: float | None = None
    ingested_at: float | None = None
    export_started_at: float | None = None
    done_at: float | None = None

    @property
    def dataset_id(self) -> str:
        """The dataset id."""
        return self.spec.dataset_id

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> DatasetRecord:
        """Parse the Redis hash."""
        f = {k.decode(): v.decode() for k, v in raw.items()}
        rec = cls(
            spec=DatasetSpec.model_validate_json(f["spec"]),
            state=f["state"],
            error=f.get("error") or None,
            rq_job=f.get("rq_job") or None,
            done_cursor=f.get("done_cursor", "0-0"),
            ignored_fields=json.loads(f.get("ignored_fields", "[]")),
        )
        for name in _INT_FIELDS:
            if f.get(name, "") != "":
                setattr(rec, name, int(f[name]))
        for name in _TIME_FIELDS:
            if f.get(name, "") != "":
                setattr(rec, name, float(f[name]))
        return rec

    def to_hash(self) -> dict[str, str]:
        """Every field as hash values."""
        out = {
            "spec": self.spec.model_dump_json(),
            "state": self.state,
            "error": self.error or "",
            "rq_job": self.rq_job or "",
            "done_cursor": self.done_cursor,
            "ignored_fields": json.dumps(sorted(self.ignored_fields)),
        }
        for name in (*_INT_FIELDS, *_TIME_FIELDS):
            value = getattr(self, name)
            out[name] = "" if value is None else str(value)
        return out


def load_record(r: redis.Redis, queue: str, dataset_id: str) -> DatasetRecord | None:
    """The dataset's record, or None."""
    raw = cast(dict[bytes, bytes], r.hgetall(keys.dataset_key(queue, dataset_id)))
    return DatasetRecord.from_hash(raw) if raw else None


def dataset_queues(r: redis.Redis) -> list[str]:
    """Queues that have datasets (SCAN for their index keys)."""
    found = set()
    for k in r.scan_iter(match=f"{keys.PREFIX}:{{*}}:datasets", count=1000, _type="zset"):
        text = k.decode()
        found.add(text[text.index("{") + 1 : text.rindex("}")])
    return sorted(found)


def find_dataset(r: redis.Redis, dataset_id: str, queue: str | None = None) -> DatasetRecord:
    """A dataset by id, in `queue` or else in any queue; raises DatasetError if absent."""
    for q in [queue] if queue else dataset_queues(r):
        rec = load_record(r, q, dataset_id)
        if rec is not None:
            return rec
    raise DatasetError(f"no dataset {dataset_id!r}" + (f" in queue {queue!r}" if queue else ""))


# ---------------------------------------------------------------------------------------------
# Identity


def normalize_location(location: str) -> str:
    """An input/output location in the form stored and hashed: s3:// URLs as given (no
    trailing slash), local paths and file:// URLs as absolute paths."""
    if location.startswith("s3://"):
        return location.rstrip("/")
    if location.startswith("file://"):
        location = location[len("file://") :]
    return Path(location).expanduser().resolve().as_posix()


def derive_dataset_id(input_location: str, *, queue: str, options: RequestOptions) -> str:
    """Deterministic dataset id from the normalized input location, queue and options."""
    material = json.dumps(
        {"input": input_location, "queue": queue, "options": options.model_dump()},
        sort_keys=True,
    )
    return "ds-" + hashlib.sha256(material.encode()).hexdigest()[:16]


def check_dataset_id(dataset_id: str) -> str:
    """Validate a caller-chosen dataset id (it prefixes job ids `<id>:<row>`)."""
    if not _ID_RE.match(dataset_id):
        raise DatasetError(
            f"dataset id {dataset_id!r} is invalid: 1-64 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit"
        )
    return dataset_id


def row_job_id(dataset_id: str, index: int) -> str:
    """The job id of row `index`."""
    return f"{dataset_id}:{index}"
