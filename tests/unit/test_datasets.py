"""The pure parts of dataset jobs: reading JSONL/Parquet rows (and resuming mid-file), rows to
requests, dataset ids, the record's hash form, the export table and the manifest, the ETA."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import obstore
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from obstore.store import LocalStore

from producer import datasets as D
from shared.errors import InvalidJob
from shared.messages import Limits, TeacherResult


def _jsonl(lines: list[str]) -> io.BytesIO:
    return io.BytesIO("".join(line + "\n" for line in lines).encode())


def test_jsonl_rows_errors_and_offsets() -> None:
    f = _jsonl(['{"input_ids": [1, 2]}', "", "not json", "[1, 2]", '{"input_ids": [3, 4]}', "  "])
    rows = list(D.iter_jsonl(f))
    assert [r.index for r in rows] == [0, 1, 2, 3]  # blank lines do not count as rows
    assert rows[0].fields == {"input_ids": [1, 2]} and rows[0].error is None
    assert rows[1].fields is None and rows[1].error.startswith("not valid JSON")
    assert rows[2].error == "expected a JSON object, got list"
    assert rows[3].fields == {"input_ids": [3, 4]}
    data = f.getvalue()
    for row in rows:  # each offset is where the next row's line starts (after its newline)
        assert data[row.offset - 1 : row.offset] == b"\n"


def test_jsonl_resumes_from_a_recorded_offset() -> None:
    f = _jsonl([json.dumps({"input_ids": [i, i + 1]}) for i in range(10)])
    full = list(D.iter_jsonl(f))
    resumed = list(D.iter_jsonl(f, start_row=full[3].index + 1, start_byte=full[3].offset))
    assert resumed == full[4:]


def _parquet(path: Path, n: int, *, row_group_size: int) -> None:
    table = pa.table(
        {
            "input_ids": pa.array([[i, i + 1, i + 2] for i in range(n)], pa.list_(pa.int64())),
            "top_k": pa.array([i % 3 or None for i in range(n)], pa.int64()),
            "text": pa.array([f"row {i}" for i in range(n)]),
        }
    )
    pq.write_table(table, path, row_group_size=row_group_size)


def test_parquet_rows_known_columns_nulls_and_resume(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    _parquet(path, 25, row_group_size=7)
    with open(path, "rb") as f:
        full = list(D.iter_parquet(f, batch_rows=4))
    assert [r.index for r in full] == list(range(25))
    assert full[4].fields == {"input_ids": [4, 5, 6], "top_k": 1}
    assert full[3].fields == {"input_ids": [3, 4, 5], "top_k": None}  # "text" is not read
    assert [r.offset for r in full] == list(range(1, 26))
    for start in (0, 6, 7, 13, 24, 25):  # group edges and mid-group
        with open(path, "rb") as f:
            assert list(D.iter_parquet(f, start_row=start, batch_rows=4)) == full[start:]


def test_format_detection() -> None:
    assert D.detect_format("x.parquet", b"") == "parquet"
    assert D.detect_format("s3://b/data", b"PAR1") == "parquet"
    assert D.detect_format("x.jsonl", b'{"in') == "jsonl"


def test_obstore_reader_adapter_serves_jsonl_and_parquet(tmp_path: Path) -> None:
    """What s3:// inputs go through (obstore's reader), here on obstore's local store."""
    _parquet(tmp_path / "rows.parquet", 20, row_group_size=6)
    (tmp_path / "rows.jsonl").write_bytes(
        _jsonl([json.dumps({"input_ids": [i, 1]}) for i in range(5)]).getvalue()
    )
    store = LocalStore(prefix=tmp_path)

    def opened(key: str) -> io.BufferedReader:
        return io.BufferedReader(D._ReaderFile(obstore.open_reader(store, key)), buffer_size=8)

    with opened("rows.parquet") as f, open(tmp_path / "rows.parquet", "rb") as local:
        assert list(D.iter_parquet(f, start_row=8)) == list(D.iter_parquet(local, start_row=8))
    with opened("rows.jsonl") as f:
        rows = list(D.iter_jsonl(f))
        assert [r.fields["input_ids"][0] for r in rows] == [0, 1, 2, 3, 4]
        tail = list(D.iter_jsonl(f, start_row=2, start_byte=rows[1].offset))
        assert tail == rows[2:]


def test_row_request_options_and_overrides() -> None:
    options = D.RequestOptions(top_k=3, sample_n=1, return_entropy=True, temperature=0.5, seed=9)
    req = D.row_request({"input_ids": [1, 2, 3]}, options=options, job_id="ds:0")
    assert (req.top_k, req.sample_n, req.return_entropy, req.temperature, req.seed) == (
        3,
        1,
        True,
        0.5,
        9,
    )
    assert req.job_id == "ds:0" and req.input_ids.tolist() == [1, 2, 3]
    row = {
        "input_ids": [1, 2, 3],
        "top_k": 7,
        "seed": None,
        "temperature": 2.0,
        "label_token_ids": [[1], [2]],
        "metadata": '{"a": 1}',
    }
    req = D.row_request(row, options=options, job_id="ds:1")
    assert (req.top_k, req.seed, req.temperature) == (7, 9, 2.0)  # null: the option applies
    assert req.label_token_ids.shape == (2, 1) and req.metadata == {"a": 1}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"top_k": 1}, "row has no input_ids"),
        ({"input_ids": []}, "input_ids is empty"),
        ({"input_ids": [1, 2], "temperature": 0}, "temperature must be a finite number > 0"),
        ({"input_ids": [1, 2], "metadata": "{oops"}, "metadata is a string but not JSON"),
        ({"input_ids": [1, 2], "metadata": [1]}, "metadata must be a JSON object"),
        ({"input_ids": [1, 2, 3], "label_token_ids": [[1], [2, 3]]}, "ragged"),
    ],
)
def test_row_request_refuses_bad_rows(row: dict, message: str) -> None:
    with pytest.raises(InvalidJob, match=message):
        D.row_request(row, options=D.RequestOptions(), job_id="ds:0")


def test_prepare_rows_splits_valid_and_rejected() -> None:
    rows = [
        D.RawRow(0, {"input_ids": [1, 2, 3], "text": "x"}, None, 1),
        D.RawRow(1, None, "not valid JSON: x", 2),
        D.RawRow(2, {"input_ids": [1, 5000]}, None, 3),
        D.RawRow(3, {"input_ids": [4, 5], "top_k": 9}, None, 4),
        D.RawRow(4, {"input_ids": [4, 5], "topk": 2}, None, 5),
    ]
    out = D.prepare_rows(
        rows,
        dataset_id="ds",
        options=D.RequestOptions(),
        limits=Limits(vocab_size=1000, max_top_k=8),
        keep_fields=["text"],
    )
    assert [i for i, _ in out.valid] == [0] and out.valid[0][1].job_id == "ds:0"
    assert out.tokens == 3
    reasons = dict(out.rejected)
    assert reasons[1] == "not valid JSON: x"
    assert "outside the vocabulary [0, 1000)" in reasons[2]
    assert reasons[3] == "top_k is 9; the maximum is 8"
    # A misspelled field rejects its row, naming it, as `submit` would (not silently ignored).
    assert reasons[4] == "unknown field 'topk' (did you mean 'top_k'?)"
    assert out.ignored_fields == {"text"}


def test_dataset_ids_are_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    loc = D.normalize_location("data/in.jsonl")
    assert loc == (tmp_path / "data/in.jsonl").as_posix()
    assert D.normalize_location(f"file://{loc}") == loc
    assert D.normalize_location("s3://b/x/in.parquet/") == "s3://b/x/in.parquet"
    opts = D.RequestOptions(top_k=2)
    a = D.derive_dataset_id(loc, queue="q", options=opts)
    assert a == D.derive_dataset_id(loc, queue="q", options=D.RequestOptions(top_k=2))
    assert a.startswith("ds-") and len(a) == 19
    assert a != D.derive_dataset_id(loc, queue="other", options=opts)
    assert a != D.derive_dataset_id(loc, queue="q", options=D.RequestOptions(top_k=3))
    assert a != D.derive_dataset_id(loc + "x", queue="q", options=opts)
    assert D.row_job_id(a, 12) == f"{a}:12"
    assert D.check_dataset_id("run-7.v2") == "run-7.v2"
    for bad in ("", "a:b", "-x", "a b", "x" * 65):
        with pytest.raises(D.DatasetError):
            D.check_dataset_id(bad)


def _spec(**kw) -> D.DatasetSpec:
    base = dict(dataset_id="ds-1", input="/in.jsonl", format="jsonl", queue="q", output="/out")
    return D.DatasetSpec(**{**base, **kw})


def test_record_hash_round_trip() -> None:
    rec = D.DatasetRecord(
        spec=_spec(options=D.RequestOptions(seed=3)),
        state="ingesting",
        total_rows=None,
        next_row=40,
        byte_offset=1234,
        rows_queued=38,
        rows_rejected=2,
        ignored_fields=["text"],
        created_at=1.5,
    )
    raw = {k.encode(): v.encode() for k, v in rec.to_hash().items()}
    assert D.DatasetRecord.from_hash(raw) == rec
    with pytest.raises(ValueError, match="batch_rows"):
        _spec(batch_rows=0)


def _result(job_id: str, n: int, *, k: int = 0, w: int = 0, version: str = "v1") -> TeacherResult:
    rng = np.random.default_rng(n)
    return TeacherResult(
        job_id=job_id,
        model_version=version,
        logprobs=rng.standard_normal(n).astype(np.float32),
        label_logprobs=rng.standard_normal((n, w)).astype(np.float32) if w else None,
        topk_token_ids=rng.integers(0, 1000, (n, k)) if k else None,
        topk_logprobs=rng.standard_normal((n, k)).astype(np.float32) if k else None,
        entropy=rng.random(n).astype(np.float32),
        metadata={"n": n},
        timings={"queue_wait_ms": float(n)},
    )


def test_rows_table_round_trips_exactly_through_parquet() -> None:
    rows = [
        D.ExportRow(0, "ds:0", "ok", None, _result("ds:0", 5, k=3, w=2)),
        D.ExportRow(1, "ds:1", "rejected", "input_ids is empty", None),
        D.ExportRow(2, "ds:2", "ok", None, _result("ds:2", 1)),
        D.ExportRow(3, "ds:3", "failed", "boom", TeacherResult(job_id="ds:3", error="boom")),
        D.ExportRow(4, "ds:4", "ok", None, _result("ds:4", 7, k=1, w=4)),
    ]
    buf = pa.BufferOutputStream()
    pq.write_table(D.rows_table(rows), buf)
    table = pq.read_table(pa.BufferReader(buf.getvalue()))
    assert table.schema.equals(D.EXPORT_SCHEMA)
    assert table.column("status").to_pylist() == ["ok", "rejected", "ok", "failed", "ok"]
    assert table.column("error").to_pylist() == [None, "input_ids is empty", None, "boom", None]
    for row in rows:
        got = {name: table.column(name)[row.row_index].as_py() for name in table.column_names}
        if row.status != "ok":
            assert got["logprobs"] is None and got["model_version"] is None
            continue
        res = row.result
        assert got["model_version"] == "v1" and json.loads(got["metadata"]) == res.metadata
        for name, want in res.arrays().items():
            assert np.array_equal(np.array(got[name], dtype=want.dtype).reshape(want.shape), want)
        for name in ("label_logprobs", "topk_token_ids", "sampled_token_ids"):
            if getattr(res, name) is None:
                assert got[name] is None


def test_manifest_counts_failures_versions_and_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D.export, "MAX_MANIFEST_FAILURES", 2)
    stats = D.ExportStats()
    stats.add(D.ExportRow(0, "ds:0", "ok", None, _result("ds:0", 4, version="a")))
    stats.add(D.ExportRow(1, "ds:1", "rejected", "input_ids is empty", None))
    stats.add(D.ExportRow(2, "ds:2", "ok", None, _result("ds:2", 6, version="b")))
    bad = TeacherResult(job_id="ds:3", model_version="a", error="outside the vocabulary")
    stats.add(D.ExportRow(3, "ds:3", "failed", bad.error, bad))
    stats.add(D.ExportRow(4, "ds:4", "failed", "no result record (expired?)", None))
    rec = D.DatasetRecord(
        spec=_spec(),
        state="exporting",
        ignored_fields=["text"],
        created_at=10.0,
        ingest_started_at=11.0,
        ingested_at=12.5,
        export_started_at=20.0,
    )
    shards = [{"path": "part-00000.parquet", "first_row": 0, "rows": 5}]
    m = D.build_manifest(rec, stats, shards, exported_at=21.0)
    assert m["rows"] == {"total": 5, "ok": 2, "failed": 2, "rejected": 1}
    assert m["failures"] == [
        {"row_index": 1, "job_id": "ds:1", "stage": "ingest", "reason": "input_ids is empty"},
        {"row_index": 3, "job_id": "ds:3", "stage": "teacher", "reason": "outside the vocabulary"},
    ]
    assert m["failures_omitted"] == 1
    assert m["model_versions"] == {"a": 1, "b": 1}  # of the rows exported ok
    assert m["ignored_fields"] == ["text"] and m["shards"] == shards
    t = m["timings"]
    assert (t["ingest_s"], t["until_all_finished_s"], t["export_s"], t["total_s"]) == (
        1.5,
        9.0,
        1.0,
        11.0,
    )
    assert t["per_job_ms"]["queue_wait_ms"]["max"] == 6.0
    json.dumps(m)  # JSON-ready


def test_eta_from_recent_samples() -> None:
    assert D.estimate_eta([], remaining=10) == (None, None)
    assert D.estimate_eta([(100.0, 5)], remaining=10) == (None, None)
    rate, eta = D.estimate_eta([(110.0, 50), (100.0, 0), (105.0, 20)], remaining=100)
    assert rate == pytest.approx(5.0) and eta == pytest.approx(20.0)
    # Only the window counts: a slow start long ago does not drag the rate down.
    rate, _ = D.estimate_eta([(0.0, 0), (500.0, 10), (510.0, 110)], remaining=None, window_s=60)
    assert rate == pytest.approx(10.0)
    assert D.estimate_eta([(0.0, 5), (10.0, 5)], remaining=3) == (0.0, None)
