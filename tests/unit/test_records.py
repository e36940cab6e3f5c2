"""Guards of the one-place records: every request option travels from submit to the consumer's
batch and into the job id; every result array reaches storage and the Parquet export; a
request's numbers are refused at submit by the same rule the consumer scores with."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load as st_load

from consumer.forward.batch import BatchTensors
from consumer.group.batching import OPTION_COLUMNS, batch_from_jobs
from producer import datasets as D
from producer.cli_datasets import submit_dataset_cmd
from shared.codec import decode_array, encode_array
from shared.errors import InvalidJob
from shared.messages import (
    OPTION_FIELDS,
    RESULT_ARRAYS,
    RESULT_TABLE,
    Limits,
    RequestOptions,
    TeacherRequest,
    TeacherResult,
    content_job_id,
    decode_job,
    encode_job,
    inverse_temperature,
    parse_request,
)
from shared.results import decode_record, decode_records, encode_record, record_object
from shared.storage import ChecksumMismatch, ObjectStore

LIMITS = Limits(max_input_tokens=16, max_label_width=4, max_top_k=8, max_sample_n=4, vocab_size=100)

# A value other than the default for every option, each valid under LIMITS.
CHANGED = {"sample_n": 3, "top_k": 5, "return_entropy": True, "temperature": 0.7, "seed": 12345}


def test_the_option_table_covers_every_option() -> None:
    """The changed values above name every option, and differ from the defaults (so the tests
    below exercise each one); a new option must be added here, which makes it tested."""
    assert set(CHANGED) == set(OPTION_FIELDS)
    defaults = RequestOptions()
    assert all(getattr(defaults, k) != v for k, v in CHANGED.items())


@pytest.mark.parametrize("name", OPTION_FIELDS)
def test_every_option_travels(name: str) -> None:
    """Each option, set alone, survives the stream entry (encode, decode), reaches the
    consumer's batch column with its value, and changes the content job id."""
    base = TeacherRequest(input_ids=[1, 2, 3, 4])
    req = TeacherRequest(input_ids=[1, 2, 3, 4], **{name: CHANGED[name]})
    fields = {
        k.encode(): v if isinstance(v, bytes) else v.encode()
        for k, v in encode_job(req, job_id="j").items()
    }
    job = decode_job("1-0", fields, limits=LIMITS)
    assert getattr(job.request, name) == CHANGED[name]
    assert job.request.option_values() == req.option_values()

    column, _ = OPTION_COLUMNS[name]
    batch = batch_from_jobs([job])
    assert getattr(batch, column).tolist() == [CHANGED[name]]

    ids = {content_job_id(r, queue="q", teacher="t") for r in (base, req)}
    assert len(ids) == 2


def test_batch_columns_are_the_options() -> None:
    """BatchTensors holds one `<option>_J` column per option, and nothing else takes those
    names; the followers receive exactly these fields."""
    names = {f.name for f in dataclasses.fields(BatchTensors)}
    assert {column for column, _ in OPTION_COLUMNS.values()} <= names
    assert set(OPTION_COLUMNS) == set(OPTION_FIELDS)


def test_dataset_rows_and_cli_take_every_option() -> None:
    """A dataset row may carry every option (and its value wins over the dataset's), and
    `teacherq submit-dataset` has a flag for each."""
    assert set(OPTION_FIELDS) <= D.ROW_FIELDS
    row = {"input_ids": [1, 2, 3], **CHANGED}
    req = D.row_request(row, options=RequestOptions(), job_id="ds:0")
    assert req.option_values() == CHANGED
    params = inspect.signature(submit_dataset_cmd).parameters
    assert set(OPTION_FIELDS) <= set(params)


def _full_result(job_id: str, rows: int = 3) -> TeacherResult:
    """A result with every array of RESULT_TABLE set, of the table's rank and kind."""
    rng = np.random.default_rng(0)
    res = TeacherResult(job_id=job_id, model_version="v1")
    for spec in RESULT_TABLE:
        shape = (rows,) if spec.dims == 1 else (rows, 2)
        value = rng.integers(0, 50, shape) if spec.kind == "int" else rng.normal(size=shape)
        setattr(res, spec.name, value.astype(np.int64 if spec.kind == "int" else np.float32))
    return res


def _fields(record: dict) -> dict[bytes, bytes]:
    """A record as Redis hands it back (HGETALL)."""
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in record.items()}


def _read_back(record: dict, store: ObjectStore | None) -> TeacherResult:
    return decode_record(_fields(record), store=store)


def test_every_result_array_is_stored_and_exported() -> None:
    """Every name of RESULT_TABLE is a TeacherResult field, round-trips through the Redis
    record, and is a column of the Parquet export holding the same values."""
    fields = {f.name for f in dataclasses.fields(TeacherResult)}
    assert set(RESULT_ARRAYS) <= fields
    res = _full_result("ds:0")
    assert set(res.arrays()) == set(RESULT_ARRAYS)

    record = encode_record(res, queue="q", store=None, inline_max_bytes=1 << 20)
    back = _read_back(record, None)
    for name in RESULT_ARRAYS:
        np.testing.assert_array_equal(getattr(back, name), getattr(res, name))

    buf = pa.BufferOutputStream()
    pq.write_table(D.rows_table([D.ExportRow(0, "ds:0", "ok", None, res)]), buf)
    table = pq.read_table(pa.BufferReader(buf.getvalue()))
    for name in RESULT_ARRAYS:
        want = getattr(res, name)
        got = np.array(table.column(name)[0].as_py(), dtype=want.dtype)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("where", ["inline", "object"])
def test_token_ids_are_stored_narrow_and_read_back_as_int64(where: str, tmp_path) -> None:
    """Token ids that fit int32 (every vocabulary, the head's sentinel 2**31 - 1) are stored
    as int32, inline and in object storage, and read back as the int64 they were; ids that do
    not fit stay int64; and a record stored with int64 ids (as before) reads the same."""
    store = ObjectStore.from_url(f"file://{tmp_path}") if where == "object" else None
    inline_max = 1 << 20 if where == "inline" else 0
    res = _full_result("ids:0", rows=50)
    res.topk_token_ids[0, 0] = (1 << 31) - 1  # the sentinel id: fits
    record = encode_record(res, queue="q", store=store, inline_max_bytes=inline_max)
    if where == "inline":
        stored = {k: decode_array(v) for k, v in record.items() if k.startswith("a:")}
    else:
        obj = json.loads(record["meta"])["object"]
        stored = {f"a:{k}": v for k, v in st_load(store.get(obj["key"])).items()}  # type: ignore[union-attr]
    for spec in RESULT_TABLE:
        want = np.int32 if spec.kind == "int" else np.float32
        assert stored[f"a:{spec.name}"].dtype == want, spec.name
    back = _read_back(record, store)
    for name in RESULT_ARRAYS:
        assert getattr(back, name).dtype == getattr(res, name).dtype, name
        np.testing.assert_array_equal(getattr(back, name), getattr(res, name))

    res.sampled_token_ids[1, 1] = 1 << 31  # one id past int32: that array stays int64
    wide = encode_record(res, queue="q2", store=store, inline_max_bytes=inline_max)
    np.testing.assert_array_equal(_read_back(wide, store).sampled_token_ids, res.sampled_token_ids)
    if where == "inline":
        assert decode_array(wide["a:sampled_token_ids"]).dtype == np.int64
        assert decode_array(wide["a:topk_token_ids"]).dtype == np.int32
        old = dict(wide, **{f"a:{n}": encode_array(getattr(res, n)) for n in RESULT_ARRAYS})
        old_back = _read_back(old, store)  # every array as written before: int64 ids
        for name in RESULT_ARRAYS:
            assert getattr(old_back, name).dtype == getattr(res, name).dtype, name
            np.testing.assert_array_equal(getattr(old_back, name), getattr(res, name))


def test_records_read_side_by_side_come_back_in_order(tmp_path) -> None:
    """`decode_records` (what `TeacherClient.results` reads with) returns each record as
    `decode_record` would, in order, None kept, inline and object records mixed; where objects
    are broken, the first broken one in order raises."""
    store = ObjectStore.from_url(f"file://{tmp_path}")
    results = [_full_result(f"r:{i}", rows=40 + i) for i in range(12)]
    records: list[dict[bytes, bytes] | None] = []
    for i, res in enumerate(results):
        inline = 1 << 20 if i % 3 == 0 else 0  # every third inline, the rest objects
        record = encode_record(res, queue="q", store=store, inline_max_bytes=inline)
        records.append(_fields(record))
    records.insert(5, None)  # a job not finished yet
    back = decode_records(records, store=store)
    assert back[5] is None and len(back) == len(records)
    for want, got in zip(results, back[:5] + back[6:], strict=True):
        assert got is not None and got.job_id == want.job_id
        for name in RESULT_ARRAYS:
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))

    broken = [(record_object(r) or {})["key"] for r in (records[8], records[11]) if r]
    for key in broken:
        (tmp_path / key).write_bytes(b"not the bytes that were stored")
    with pytest.raises(ChecksumMismatch, match=re.escape(broken[0].split("/")[-1])):
        decode_records(records, store=store)


def test_tiny_temperature_is_refused_at_submit() -> None:
    """temperature=1e-45 is finite and > 0, but its float32 reciprocal is inf: the request is
    refused when it is built (InvalidJob naming the temperature), not dead-lettered later."""
    with pytest.raises(InvalidJob, match=r"temperature 1e-45 is too small: 1/temperature"):
        TeacherRequest(input_ids=[1, 2], temperature=1e-45)
    with pytest.raises(InvalidJob, match="temperature"):
        parse_request({"input_ids": [1, 2], "temperature": 1e-45})  # what submit calls
    with pytest.raises(InvalidJob, match="temperature"):
        RequestOptions(temperature=1e-45)


def test_tiny_temperature_from_an_old_producer_is_invalid_at_intake() -> None:
    """A stream entry that carries temperature=1e-45 (written by a producer that let it
    through) fails to decode with InvalidJob: the consumer dead-letters it at once instead of
    splitting a batch over it."""
    fields = encode_job(TeacherRequest(input_ids=[1, 2, 3]), job_id="j")
    meta = json.loads(fields["meta"])
    meta["temperature"] = 1e-45
    fields["meta"] = json.dumps(meta)
    raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
    with pytest.raises(InvalidJob, match="1/temperature overflows float32"):
        decode_job("1-0", raw, limits=LIMITS)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), 1e-39, 1e-45])
def test_submit_and_head_share_the_temperature_rule(temperature: float) -> None:
    """What submit refuses, the consumer's reciprocal refuses too (the same function), and
    what it accepts has a finite float32 reciprocal."""
    with pytest.raises(ValueError, match="temperature"):
        inverse_temperature(temperature)
    for ok in (1e-38, 0.5, 1.0, 7.0, 1e30):
        inv = inverse_temperature(ok)
        assert np.isfinite(np.float32(inv)) and inv == np.float32(1.0 / ok)
