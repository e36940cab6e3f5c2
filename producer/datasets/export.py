"""Finalize and export: follow completions until every submitted row has a result, then write
the results in input order as Parquet shards and, last, manifest.json to the output."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from producer.client import TeacherClient
from producer.datasets.io import object_store
from producer.datasets.lease import Lease
from producer.datasets.records import DatasetRecord, row_job_id
from producer.datasets.rq_plumbing import continue_step
from producer.datasets.track import RESULTS_CHUNK, SWEEP_INTERVAL_S, Tracker
from shared import keys
from shared.log import get_logger
from shared.messages import RESULT_TABLE, TeacherResult
from shared.storage import StorageError

log = get_logger("teacherq.datasets")

# Result arrays as columns: (name, dims, element type), from shared.messages.RESULT_TABLE.
# Row j of each scores position j + 1 of input_ids.
_ELEMENT_TYPES = {"float": pa.float32(), "int": pa.int64()}
_ARRAY_COLUMNS = tuple((a.name, a.dims, _ELEMENT_TYPES[a.kind]) for a in RESULT_TABLE)
EXPORT_SCHEMA = pa.schema(
    [
        ("row_index", pa.int64()),
        ("job_id", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("model_version", pa.string()),
    ]
    + [
        (name, pa.list_(pa.list_(t)) if dims == 2 else pa.list_(t))
        for name, dims, t in _ARRAY_COLUMNS
    ]
    + [("metadata", pa.string())]
)


# ---------------------------------------------------------------------------------------------
# Finalize: the rq step that waits for the rows, then exports


def finalize_slice(client: TeacherClient, lease: Lease, rec: DatasetRecord) -> dict[str, Any]:
    """Follow completions for one slice; once every submitted row has a result, export and
    mark the dataset `done`. Returns the rq job's result."""
    if rec.state == "ingested":
        finished = _wait_finished(client, lease, rec)
        if finished is not None:
            return continue_step(client, "finalize", rec, finished=finished)
        rec.export_started_at = time.time()
        lease.write(
            {
                "state": "exporting",
                "export_started_at": rec.export_started_at,
                "updated_at": rec.export_started_at,
            }
        )
    elif rec.export_started_at is None:
        rec.export_started_at = time.time()
    manifest = export_dataset(client, rec, refresh=lease.refresh)
    now = time.time()
    lease.write({"state": "done", "done_at": now, "updated_at": now, "error": ""})
    log.info("dataset.done", dataset=rec.dataset_id, **manifest["rows"])
    return {"status": "done", **manifest["rows"]}


def _wait_finished(client: TeacherClient, lease: Lease, rec: DatasetRecord) -> int | None:
    """Follow completions until every submitted row has a result (None), or the slice ends
    (the rows finished so far)."""
    deadline = time.monotonic() + rec.spec.slice_s
    tracker = Tracker(client, rec)
    tracker.sweep(rec.next_row)
    last_sweep = time.monotonic()
    while (finished := tracker.counts()[0]) < rec.rows_queued:
        if time.monotonic() > deadline:
            return finished
        lease.refresh()
        tracker.poll(block_ms=1000)
        if time.monotonic() - last_sweep > SWEEP_INTERVAL_S:
            tracker.sweep(rec.next_row)
            last_sweep = time.monotonic()
    return None


# ---------------------------------------------------------------------------------------------
# Rows to Parquet


@dataclass(frozen=True)
class ExportRow:
    """One output row: `status` is ok, failed (the teacher could not score it) or rejected
    (refused at ingest)."""

    row_index: int
    job_id: str
    status: Literal["ok", "failed", "rejected"]
    error: str | None
    result: TeacherResult | None


def _list_array(values: Sequence[np.ndarray | None], dims: int, typ: pa.DataType) -> pa.Array:
    """A (nested) list column from per-row numpy arrays, None for null, without going through
    Python lists."""
    dtype = typ.to_pandas_dtype()
    present = [np.asarray(v, dtype=dtype) for v in values if v is not None]
    mask = pa.array([v is None for v in values], type=pa.bool_())
    lengths = [0 if v is None else int(np.shape(v)[0]) for v in values]
    outer = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat = pa.array(
        np.concatenate([a.reshape(-1) for a in present]) if present else np.empty(0, dtype),
        type=typ,
    )
    if dims == 1:
        return pa.ListArray.from_arrays(outer, flat, mask=mask)
    widths = [np.full(a.shape[0], a.shape[1]) for a in present]
    inner_len = np.concatenate(widths) if widths else np.empty(0, np.int64)
    inner = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(inner_len)]).astype(np.int32)), flat
    )
    return pa.ListArray.from_arrays(outer, inner, mask=mask)


def rows_table(rows: Sequence[ExportRow]) -> pa.Table:
    """The export table for rows, in EXPORT_SCHEMA."""
    results = [r.result if r.status == "ok" else None for r in rows]
    columns: list[pa.Array] = [
        pa.array([r.row_index for r in rows], type=pa.int64()),
        pa.array([r.job_id for r in rows], type=pa.string()),
        pa.array([r.status for r in rows], type=pa.string()),
        pa.array([r.error for r in rows], type=pa.string()),
        pa.array([res.model_version if res else None for res in results], type=pa.string()),
    ]
    for name, dims, typ in _ARRAY_COLUMNS:
        columns.append(
            _list_array([getattr(res, name) if res else None for res in results], dims, typ)
        )
    columns.append(
        pa.array([json.dumps(res.metadata) if res else None for res in results], type=pa.string())
    )
    return pa.Table.from_arrays(columns, schema=EXPORT_SCHEMA)


# ---------------------------------------------------------------------------------------------
# The manifest


# The most failures manifest.json lists one by one (the rest are only counted).
MAX_MANIFEST_FAILURES = 10_000


@dataclass
class ExportStats:
    """What the manifest reports, accumulated row by row."""

    counts: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    failures_omitted: int = 0
    model_versions: Counter[str] = field(default_factory=Counter)
    job_timings: dict[str, list[float]] = field(default_factory=dict)

    def add(self, row: ExportRow) -> None:
        """Count one exported row."""
        self.counts[row.status] += 1
        if row.status != "ok":
            if len(self.failures) < MAX_MANIFEST_FAILURES:
                self.failures.append(
                    {
                        "row_index": row.row_index,
                        "job_id": row.job_id,
                        "stage": "ingest" if row.status == "rejected" else "teacher",
                        "reason": row.error,
                    }
                )
            else:
                self.failures_omitted += 1
        if row.result is not None and row.status == "ok":
            self.model_versions[row.result.model_version] += 1
            for k, v in row.result.timings.items():
                self.job_timings.setdefault(k, []).append(float(v))


def _summary(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values)
    return {
        "mean": round(float(arr.mean()), 3),
        "p50": round(float(np.percentile(arr, 50)), 3),
        "p95": round(float(np.percentile(arr, 95)), 3),
        "max": round(float(arr.max()), 3),
    }


def build_manifest(
    rec: DatasetRecord, stats: ExportStats, shards: list[dict[str, Any]], *, exported_at: float
) -> dict[str, Any]:
    """manifest.json: counts, failures with reasons, model versions, shards, timings."""
    spec = rec.spec

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    total = sum(stats.counts.values())
    return {
        "version": 1,
        "dataset_id": spec.dataset_id,
        "queue": spec.queue,
        "input": spec.input,
        "output": spec.output,
        "options": spec.options.model_dump(),
        "rows": {
            "total": total,
            "ok": stats.counts["ok"],
            "failed": stats.counts["failed"],
            "rejected": stats.counts["rejected"],
        },
        "failures": stats.failures,
        "failures_omitted": stats.failures_omitted,
        "ignored_fields": sorted(rec.ignored_fields),
        "model_versions": dict(stats.model_versions),
        "shards": shards,
        "columns": {f.name: str(f.type) for f in EXPORT_SCHEMA},
        "timings": {
            "created_at": rec.created_at,
            "ingest_started_at": rec.ingest_started_at,
            "ingested_at": rec.ingested_at,
            "export_started_at": rec.export_started_at,
            "exported_at": exported_at,
            "ingest_s": span(rec.ingest_started_at, rec.ingested_at),
            "until_all_finished_s": span(rec.ingest_started_at, rec.export_started_at),
            "export_s": span(rec.export_started_at, exported_at),
            "total_s": span(rec.created_at, exported_at),
            "per_job_ms": {k: _summary(v) for k, v in sorted(stats.job_timings.items())},
        },
    }


# ---------------------------------------------------------------------------------------------
# Writing the output


def _read_results(client: TeacherClient, job_ids: list[str]) -> list[TeacherResult | None | str]:
    """Results by job id; a result whose bulk object cannot be read comes back as the reason,
    so one damaged object fails its row, not the export."""
    try:
        return list(client.results(job_ids, strict=False))
    except StorageError:
        out: list[TeacherResult | None | str] = []
        for job_id in job_ids:
            try:
                out.append(client.results([job_id], strict=False)[0])
            except StorageError as exc:
                out.append(f"result unreadable: {exc}")
        return out


def _export_rows(
    client: TeacherClient, rec: DatasetRecord, start: int, stop: int, rejected: Mapping[int, str]
) -> list[ExportRow]:
    ds = rec.dataset_id
    indices = [i for i in range(start, stop) if i not in rejected]
    fetched = dict(
        zip(indices, _read_results(client, [row_job_id(ds, i) for i in indices]), strict=True)
    )
    rows = []
    for i in range(start, stop):
        job_id = row_job_id(ds, i)
        res = fetched.get(i)
        if i in rejected:
            rows.append(ExportRow(i, job_id, "rejected", rejected[i], None))
        elif isinstance(res, str):
            rows.append(ExportRow(i, job_id, "failed", res, None))
        elif res is None:
            rows.append(ExportRow(i, job_id, "failed", "no result record (expired?)", None))
        else:
            rows.append(ExportRow(i, job_id, "ok" if res.ok else "failed", res.error, res))
    return rows


def export_dataset(
    client: TeacherClient, rec: DatasetRecord, *, refresh: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """Write the dataset's Parquet shards (input order, `shard_rows` rows each) and then
    manifest.json to the output; returns the manifest. Rewriting is idempotent."""
    spec = rec.spec
    store = object_store(spec.output, client.settings.storage)
    total = rec.total_rows if rec.total_rows is not None else rec.next_row
    raw = cast(
        dict[bytes, bytes],
        client.r.hgetall(keys.dataset_rejected_key(spec.queue, spec.dataset_id)),
    )
    rejected = {int(k): v.decode() for k, v in raw.items()}
    stats, shards = ExportStats(), []
    # No manifest while shards are rewritten (a re-export after a replay): readers wait for it.
    store.delete("manifest.json")
    for shard_no, first in enumerate(range(0, max(total, 1), spec.shard_rows)):
        last = min(first + spec.shard_rows, total)
        buf = pa.BufferOutputStream()
        with pq.ParquetWriter(buf, EXPORT_SCHEMA, compression="zstd") as writer:
            for start in range(first, last, RESULTS_CHUNK):
                refresh()
                rows = _export_rows(client, rec, start, min(start + RESULTS_CHUNK, last), rejected)
                for row in rows:
                    stats.add(row)
                writer.write_table(rows_table(rows))
        data = buf.getvalue().to_pybytes()
        path = f"part-{shard_no:05d}.parquet"
        checksum = store.put(path, data)
        shards.append(
            {
                "path": path,
                "first_row": first,
                "rows": last - first,
                "bytes": len(data),
                "checksum": checksum,
            }
        )
        log.info("dataset.export.shard", dataset=spec.dataset_id, path=store.url_for(path))
    manifest = build_manifest(rec, stats, shards, exported_at=time.time())
    # Written last: a manifest present means every shard it lists is complete.
    store.put("manifest.json", json.dumps(manifest, indent=2).encode())
    return manifest
