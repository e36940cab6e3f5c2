"""Dataset jobs: ingest a JSONL or Parquet file into a queue, export its results to Parquet.

Every step is an rq job (JSON serializer, never pickle; never GPU work: rq forks per job):

- `submit_dataset` writes the dataset record (state `ingesting`) and enqueues `ingest_job`.
- `ingest_job` reads rows from the recorded offset, turns each into a TeacherRequest with job id
  `<dataset id>:<row index>` and submits it through `TeacherClient.submit` (validation and
  idempotency live there), waiting on the done stream while the queue holds more pending tokens
  than the dataset's bound. After every batch it records the next row, byte offset and counts,
  fenced by the dataset lease, so a crashed or repeated ingest resumes where the last batch
  ended; a batch submitted again after a crash is a no-op (submit is idempotent by job id). Bad
  rows are recorded with their reason and never stop the ingest. It runs for a bounded slice,
  then enqueues its own continuation; at the end of the input it marks the dataset `ingested`
  and enqueues `finalize_job`.
- `finalize_job` follows completions (XREAD BLOCK on the done stream, plus sweeps of the result
  records for anything the stream did not show) into per-row bitmaps; once every submitted row
  has a result it exports Parquet shards and `manifest.json` to the output (`exporting` ->
  `done`), otherwise it re-enqueues itself after its slice.
- `replay_dataset` requeues the dataset's failed rq jobs and replays its dead letters.

Only one job works on a dataset at a time: each holds the dataset lease (a key with a short TTL
that it refreshes) and waits for it if another holds it. A killed worker's job is found by rq
(StartedJobRegistry heartbeat expiry, shortened by `DatasetWorker`) and retried with
`Retry(max=3)`; after the last retry the dataset is marked `failed` and the rq job stays in
FailedJobRegistry for `replay_dataset`.

Modules: `records` (the spec and record, ids, lookups), `io` (reading input rows), `lease` (the
dataset lease), `track` (finished/failed bitmaps, rate and ETA, listing), `ingest`, `export`
(finalize: wait for the rows, then Parquet shards and manifest), `submit`, `reopen`, `rq_plumbing`
(rq queues, enqueueing, failure callback, the worker) and `jobs` (the rq entry points). rq finds
the entry points and the failure callback by their names in this package
(`producer.datasets.ingest_job`, see `rq_plumbing.INGEST_JOB`), so keep them exported here.
"""

from __future__ import annotations

from producer.datasets.export import (
    EXPORT_SCHEMA,
    ExportRow,
    ExportStats,
    build_manifest,
    export_dataset,
    rows_table,
)
from producer.datasets.ingest import PreparedBatch, prepare_rows, row_request
from producer.datasets.io import (
    InputInfo,
    RawRow,
    detect_format,
    iter_jsonl,
    iter_parquet,
    iter_rows,
    open_input,
    probe_input,
)
from producer.datasets.io import _ReaderFile as _ReaderFile
from producer.datasets.jobs import finalize_job, ingest_job, with_queue
from producer.datasets.lease import LEASE_REFRESH_S, LEASE_TTL_S, Lease, LeaseLost
from producer.datasets.records import (
    RETRY_INTERVALS_S,
    ROW_FIELDS,
    DatasetError,
    DatasetRecord,
    DatasetSpec,
    RequestOptions,
    check_dataset_id,
    dataset_queues,
    derive_dataset_id,
    find_dataset,
    load_record,
    normalize_location,
    row_job_id,
)
from producer.datasets.reopen import replay_dataset
from producer.datasets.rq_plumbing import (
    EXPORT_QUEUE,
    INGEST_QUEUE,
    DatasetWorker,
    enqueue_step,
    on_job_failure,
    run_worker,
    step_alive,
)
from producer.datasets.submit import Submitted, submit_dataset
from producer.datasets.track import (
    RATE_SAMPLES,
    RESULTS_CHUNK,
    SWEEP_INTERVAL_S,
    Tracker,
    dataset_progress,
    estimate_eta,
    list_datasets,
)

__all__ = [
    "EXPORT_QUEUE",
    "EXPORT_SCHEMA",
    "INGEST_QUEUE",
    "LEASE_REFRESH_S",
    "LEASE_TTL_S",
    "RATE_SAMPLES",
    "RESULTS_CHUNK",
    "RETRY_INTERVALS_S",
    "ROW_FIELDS",
    "SWEEP_INTERVAL_S",
    "DatasetError",
    "DatasetRecord",
    "DatasetSpec",
    "DatasetWorker",
    "ExportRow",
    "ExportStats",
    "InputInfo",
    "Lease",
    "LeaseLost",
    "PreparedBatch",
    "RawRow",
    "RequestOptions",
    "Submitted",
    "Tracker",
    "build_manifest",
    "check_dataset_id",
    "dataset_progress",
    "dataset_queues",
    "derive_dataset_id",
    "detect_format",
    "enqueue_step",
    "estimate_eta",
    "export_dataset",
    "finalize_job",
    "find_dataset",
    "ingest_job",
    "iter_jsonl",
    "iter_parquet",
    "iter_rows",
    "list_datasets",
    "load_record",
    "normalize_location",
    "on_job_failure",
    "open_input",
    "prepare_rows",
    "probe_input",
    "replay_dataset",
    "row_job_id",
    "row_request",
    "rows_table",
    "run_worker",
    "step_alive",
    "submit_dataset",
    "with_queue",
]
