"""Submitting a dataset: create its record (or resume an existing one) and enqueue its next
rq job. Idempotent: the same input and options again resume, re-export or do nothing."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from producer.client import TeacherClient
from producer.datasets.io import InputInfo, open_input, probe_input
from producer.datasets.records import (
    ROW_FIELDS,
    DatasetError,
    DatasetRecord,
    DatasetSpec,
    Entries,
    RequestOptions,
    check_dataset_id,
    derive_dataset_id,
    load_record,
    normalize_location,
    unknown_fields_message,
)
from producer.datasets.rq_plumbing import enqueue_step, step_alive
from shared import keys
from shared.log import get_logger

log = get_logger("teacherq.datasets")

# KEYS: record, index. ARGV: dataset id, time, record field/values. Creates it only if absent.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""


@dataclass(frozen=True)
class Submitted:
    """What submit_dataset did: `created`, `resumed`, `exporting`, `running` (its job is
    queued or running already) or `already done`."""

    dataset_id: str
    action: str
    rq_job: str | None
    record: DatasetRecord


def submit_dataset(
    client: TeacherClient,
    *,
    input: str,
    output: str,
    options: RequestOptions | None = None,
    dataset_id: str | None = None,
    **knobs: Any,
) -> Submitted:
    """Create (or resume) a dataset on the client's queue and enqueue its next rq job.

    Idempotent: submitting the same input and options again resumes an unfinished dataset,
    re-exports a finished one whose output changed, and otherwise does nothing. `knobs` are
    DatasetSpec's run settings (batch_rows, max_pending_tokens, shard_rows, slice_s,
    retry_intervals). Raises DatasetError if the input cannot be read or the id is taken by
    another input.
    """
    options = options or RequestOptions()
    location = normalize_location(input)
    info = probe_input(location, client.settings.storage)
    check_fields(location, info, client, keep_fields=knobs.get("keep_fields", ()))
    ds = (
        check_dataset_id(dataset_id)
        if dataset_id
        else derive_dataset_id(location, queue=client.queue, options=options)
    )
    out = output if output.startswith("s3://") else normalize_location(output)
    spec = DatasetSpec(
        dataset_id=ds,
        input=location,
        format=info.format,
        queue=client.queue,
        options=options,
        output=out,
        **knobs,
    )
    now = time.time()
    fresh = DatasetRecord(
        spec=spec, state="ingesting", total_rows=info.total_rows, created_at=now, updated_at=now
    )
    # Parquet columns are known up front (JSONL keys are collected while reading).
    fresh.ignored_fields = [c for c in info.columns or [] if c not in ROW_FIELDS]

    # Completions are read from the done stream from this point on (earlier ones by sweeps).
    last = cast(Entries, client.r.xrevrange(client.streams.done, count=1))
    fresh.done_cursor = last[0][0].decode() if last else "0-0"
    key = keys.dataset_key(client.queue, ds)
    flat = [x for kv in fresh.to_hash().items() for x in kv]
    if client.r.eval(_CREATE, 2, key, keys.datasets_index_key(client.queue), ds, now, *flat):
        job = enqueue_step(client.r, "ingest", spec)
        log.info("dataset.submitted", dataset=ds, input=location, rq_job=job)
        return Submitted(ds, "created", job, fresh)
    rec = load_record(client.r, client.queue, ds)
    assert rec is not None
    return _resubmit(client, rec, spec)


# Lines of a JSONL input read at submit time to catch a misspelled field before anything runs
# (a later row with an unknown field is rejected on its own, naming the field).
CHECK_LINES = 1000


def check_fields(
    location: str, info: InputInfo, client: TeacherClient, *, keep_fields: Iterable[str]
) -> None:
    """Refuse (DatasetError naming the line and the field) an input whose columns, or whose
    first CHECK_LINES lines, carry a field that is neither a request field nor kept."""
    keep = set(keep_fields)
    hint = " (pass --keep-field NAME for a column to carry along unused)"
    if info.format == "parquet":
        unknown = [c for c in info.columns or [] if c not in ROW_FIELDS and c not in keep]
        if unknown:
            raise DatasetError(f"{location}: {unknown_fields_message(unknown)}{hint}")
        return
    with open_input(location, client.settings.storage) as f:
        for n, line in enumerate(itertools.islice(f, CHECK_LINES), 1):
            try:
                row = json.loads(line) if line.strip() else None
            except ValueError:
                continue  # an unreadable row is rejected on its own
            if isinstance(row, dict):
                unknown = [k for k in row if k not in ROW_FIELDS and k not in keep]
                if unknown:
                    raise DatasetError(f"{location}:{n}: {unknown_fields_message(unknown)}{hint}")


def _resubmit(client: TeacherClient, rec: DatasetRecord, spec: DatasetSpec) -> Submitted:
    """Submitting an existing dataset again: new run settings, and resume if it stopped."""
    ds, key = spec.dataset_id, keys.dataset_key(client.queue, spec.dataset_id)
    if rec.spec.identity() != spec.identity():
        raise DatasetError(
            f"dataset {ds} already exists for {rec.spec.input} with options "
            f"{rec.spec.options.model_dump()}; choose another --dataset-id"
        )
    output_changed = rec.spec.output != spec.output
    client.r.hset(key, mapping={"spec": spec.model_dump_json(), "updated_at": time.time()})
    rec.spec = spec
    if rec.state == "done" and not output_changed:
        return Submitted(ds, "already done", None, rec)
    if rec.state in ("ingesting", "ingested", "exporting") and step_alive(client.r, rec.rq_job):
        return Submitted(ds, "running", rec.rq_job, rec)
    state = "ingesting" if rec.ingested_at is None else "ingested"
    client.r.hset(key, mapping={"state": state, "error": ""})
    job = enqueue_step(client.r, "ingest" if state == "ingesting" else "finalize", spec)
    action = "resumed" if state == "ingesting" else "exporting"
    log.info("dataset.resubmitted", dataset=ds, action=action, rq_job=job)
    return Submitted(ds, action, job, rec)
