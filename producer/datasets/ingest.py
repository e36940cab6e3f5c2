"""Ingest: turn input rows into TeacherRequests (job id `<dataset id>:<row index>`) and submit
them in batches, with backpressure on the queue's pending tokens, recording the position after
every batch (fenced by the dataset lease) so that a crashed or repeated ingest resumes there."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from producer.client import TeacherClient
from producer.datasets.io import RawRow, iter_rows, open_input
from producer.datasets.lease import Lease
from producer.datasets.records import (
    ROW_FIELDS,
    DatasetRecord,
    DatasetSpec,
    row_job_id,
    unknown_fields_message,
)
from producer.datasets.rq_plumbing import continue_step, enqueue_step
from producer.datasets.track import Tracker
from shared import keys
from shared.errors import InvalidJob
from shared.log import get_logger
from shared.messages import (
    OPTION_FIELDS,
    Limits,
    RequestOptions,
    TeacherRequest,
    check_limits,
    parse_request,
)

log = get_logger("teacherq.datasets")


def row_request(row: Mapping[str, Any], *, options: RequestOptions, job_id: str) -> TeacherRequest:
    """The request for one row: the dataset options, overridden by the row's own non-null
    values. Raises InvalidJob naming what is wrong with the row."""
    if row.get("input_ids") is None:
        raise InvalidJob("row has no input_ids")
    data: dict[str, Any] = options.option_values()
    for name in OPTION_FIELDS:
        if row.get(name) is not None:
            data[name] = row[name]
    data["input_ids"] = row["input_ids"]
    if row.get("label_token_ids") is not None:
        data["label_token_ids"] = row["label_token_ids"]
    meta = row.get("metadata")
    if isinstance(meta, str):  # Parquet files often carry metadata as a JSON string
        try:
            meta = json.loads(meta)
        except ValueError:
            raise InvalidJob("metadata is a string but not JSON") from None
    if meta is not None:
        if not isinstance(meta, dict):
            raise InvalidJob(f"metadata must be a JSON object, got {type(meta).__name__}")
        data["metadata"] = meta
    data["job_id"] = job_id
    return parse_request(data)


@dataclass
class PreparedBatch:
    """A batch of rows split into valid requests and rejected rows (index, reason);
    `resubmitted` rows failed validation now but were enqueued by an earlier attempt."""

    valid: list[tuple[int, TeacherRequest]]
    rejected: list[tuple[int, str]]
    ignored_fields: set[str]
    resubmitted: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        """Tokens of the valid requests."""
        return sum(req.num_tokens for _, req in self.valid)


def prepare_rows(
    rows: Sequence[RawRow],
    *,
    dataset_id: str,
    options: RequestOptions,
    limits: Limits,
    keep_fields: Iterable[str] = (),
) -> PreparedBatch:
    """Validate rows against the request schema and the queue's limits. A field outside
    ROW_FIELDS and `keep_fields` rejects its row, naming the field (as `submit` would)."""
    out = PreparedBatch([], [], set())
    keep = frozenset(keep_fields)
    for row in rows:
        if row.fields is None:
            out.rejected.append((row.index, row.error or "unreadable row"))
            continue
        unknown = [k for k in row.fields if k not in ROW_FIELDS and k not in keep]
        if unknown:
            out.rejected.append((row.index, unknown_fields_message(unknown)))
            continue
        out.ignored_fields.update(k for k in row.fields if k in keep)
        try:
            req = row_request(row.fields, options=options, job_id=row_job_id(dataset_id, row.index))
            check_limits(req, limits)
        except InvalidJob as exc:
            out.rejected.append((row.index, str(exc)))
            continue
        out.valid.append((row.index, req))
    return out


def ingest_slice(client: TeacherClient, lease: Lease, rec: DatasetRecord) -> dict[str, Any]:
    """Submit the dataset's rows from the recorded position for one slice; at the end of the
    input mark it `ingested` and enqueue the finalize job. Returns the rq job's result."""
    spec = rec.spec
    deadline = time.monotonic() + spec.slice_s
    tracker = Tracker(client, rec)
    if rec.ingest_started_at is None:
        rec.ingest_started_at = time.time()
        lease.write({"ingest_started_at": rec.ingest_started_at})
    with open_input(spec.input, client.settings.storage) as f:
        rows = iter_rows(
            f,
            spec.format,
            start_row=rec.next_row,
            start_byte=rec.byte_offset,
            batch_rows=spec.batch_rows,
        )
        for batch in _batched(rows, spec.batch_rows):
            if not _wait_for_room(client, spec, lease, tracker, deadline):
                return continue_step(client, "ingest", rec, next_row=rec.next_row)
            _record_batch(lease, rec, batch, _submit_batch(client, spec, batch))
            tracker.poll(block_ms=None)
            if time.monotonic() > deadline:
                return continue_step(client, "ingest", rec, next_row=rec.next_row)
    # Finalize first: it waits for our lease. Were we to die between the two, our retry reads
    # nothing more and comes back here, whereas a dataset marked ingested without a finalize
    # job would wait forever.
    job_id = enqueue_step(client.r, "finalize", spec)
    now = time.time()
    lease.write(
        {"state": "ingested", "total_rows": rec.next_row, "ingested_at": now, "updated_at": now}
    )
    log.info(
        "dataset.ingested",
        dataset=rec.dataset_id,
        rows=rec.next_row,
        queued=rec.rows_queued,
        rejected=rec.rows_rejected,
    )
    return {
        "status": "ingested",
        "rows": rec.next_row,
        "rejected": rec.rows_rejected,
        "next_job": job_id,
    }


def _record_batch(
    lease: Lease, rec: DatasetRecord, batch: list[RawRow], prepared: PreparedBatch
) -> None:
    """Advance the recorded position past `batch` (fenced by the lease). Counts are absolute,
    from the last recorded ones, so a batch submitted again after a crash is not counted twice.
    """
    rec.next_row = batch[-1].index + 1
    rec.byte_offset = batch[-1].offset if rec.spec.format == "jsonl" else 0
    rec.rows_queued += len(prepared.valid) + len(prepared.resubmitted)
    rec.rows_rejected += len(prepared.rejected)
    rec.tokens_queued += prepared.tokens
    rec.ignored_fields = sorted(set(rec.ignored_fields) | prepared.ignored_fields)
    fields = {
        "next_row": rec.next_row,
        "byte_offset": rec.byte_offset,
        "rows_queued": rec.rows_queued,
        "rows_rejected": rec.rows_rejected,
        "tokens_queued": rec.tokens_queued,
        "updated_at": time.time(),
        "ignored_fields": json.dumps(rec.ignored_fields),
    }
    lease.write(fields, prepared.rejected)


def _batched(rows: Iterator[RawRow], n: int) -> Iterator[list[RawRow]]:
    batch: list[RawRow] = []
    for row in rows:
        batch.append(row)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _wait_for_room(
    client: TeacherClient, spec: DatasetSpec, lease: Lease, tracker: Tracker, deadline: float
) -> bool:
    """Block on the done stream while the queue holds too many pending tokens; False if the
    slice ran out first."""
    while client.streams.pending_tokens() >= spec.max_pending_tokens:
        if time.monotonic() > deadline:
            return False
        lease.refresh()
        tracker.poll(block_ms=1000)
    return True


def _submit_batch(client: TeacherClient, spec: DatasetSpec, batch: list[RawRow]) -> PreparedBatch:
    prepared = prepare_rows(
        batch,
        dataset_id=spec.dataset_id,
        options=spec.options,
        limits=client.limits(),
        keep_fields=spec.keep_fields,
    )
    try:
        client.submit([req for _, req in prepared.valid])
    except InvalidJob:
        # The limits changed since prepare_rows (a consumer advertised its vocabulary):
        # submit one by one so only the offending rows are rejected.
        still_valid = []
        for index, req in prepared.valid:
            try:
                client.submit([req])
                still_valid.append((index, req))
            except InvalidJob as exc:
                prepared.rejected.append((index, str(exc).removeprefix("request 0: ")))
        prepared.valid = still_valid
    _keep_already_submitted(client, spec.dataset_id, prepared)
    return prepared


def _keep_already_submitted(
    client: TeacherClient, dataset_id: str, prepared: PreparedBatch
) -> None:
    """A row rejected now but enqueued by an earlier attempt (before a consumer advertised the
    vocabulary, say) is in the stream and will get a result: count it as queued."""
    if not prepared.rejected:
        return
    pipe = client.r.pipeline(transaction=False)
    for index, _ in prepared.rejected:
        pipe.exists(keys.submitted_key(client.queue, row_job_id(dataset_id, index)))
    flags = pipe.execute()
    prepared.resubmitted = [i for (i, _), was in zip(prepared.rejected, flags, strict=True) if was]
    prepared.rejected = [
        (i, why) for (i, why), was in zip(prepared.rejected, flags, strict=True) if not was
    ]
