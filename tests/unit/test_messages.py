"""Requests, validation messages, the job wire form, job ids and stream keys."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from shared import keys
from shared.codec import encode_array
from shared.errors import InvalidJob
from shared.messages import (
    Limits,
    TeacherRequest,
    TeacherResult,
    check_limits,
    content_job_id,
    decode_job,
    encode_job,
    parse_request,
)

LIMITS = Limits(max_input_tokens=16, max_label_width=4, max_top_k=8, max_sample_n=4, vocab_size=100)


def invalid(data: dict, limits: Limits = LIMITS) -> str:
    with pytest.raises(InvalidJob) as info:
        check_limits(parse_request(data), limits)
    return str(info.value)


def test_valid_request_normalises_arrays() -> None:
    req = parse_request({"input_ids": [1, 2, 3], "label_token_ids": [[1, 2], [3, 4]], "top_k": 2})
    assert req.input_ids.dtype == np.int64 and req.input_ids.tolist() == [1, 2, 3]
    assert req.label_token_ids.shape == (2, 2) and req.label_width == 2
    check_limits(req, LIMITS)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"input_ids": []}, "input_ids is empty"),
        ({"input_ids": [5]}, "expected at least 2"),
        ({"input_ids": [[1, 2]]}, "must be 1-D"),
        ({"input_ids": [1.5, 2.0]}, "must hold integers"),
        ({"input_ids": [1, 2, 3], "label_token_ids": [[1], [2], [3]]}, "has 3 rows; expected"),
        ({"input_ids": [1, 2, 3], "label_token_ids": [[1, 2], [3]]}, "ragged"),
        ({"input_ids": [1, 2, 3], "label_token_ids": [1, 2]}, "must be 2-D"),
        ({"input_ids": [1, 2], "sample_n": -1}, "sample_n must be >= 0, got -1"),
        ({"input_ids": [1, 2], "top_k": -3}, "top_k must be >= 0, got -3"),
        ({"input_ids": [1, 2], "temperature": 0}, "temperature must be a finite number > 0"),
        ({"input_ids": [1, 2], "temperature": -1.0}, "got -1.0"),
        ({"input_ids": [1, 2], "temperature": float("nan")}, "temperature"),
        ({"input_ids": [1, 2], "bogus": 1}, "bogus"),
    ],
)
def test_each_validation_error_is_specific(data: dict, expected: str) -> None:
    assert expected in invalid(data)


def test_limits_name_both_numbers() -> None:
    assert "has 17 tokens; the maximum is 16" in invalid({"input_ids": list(range(17))})
    assert "top_k is 9; the maximum is 8" in invalid({"input_ids": [1, 2], "top_k": 9})
    assert "sample_n is 5; the maximum is 4" in invalid({"input_ids": [1, 2], "sample_n": 5})
    msg = invalid({"input_ids": [1, 2], "label_token_ids": [[1] * 5]})
    assert "label width W is 5; the maximum is 4" in msg


def test_ids_outside_vocabulary_are_located() -> None:
    assert "input_ids[2] = 100 is outside the vocabulary [0, 100)" in invalid(
        {"input_ids": [1, 2, 100]}
    )
    assert "input_ids[0] = -1" in invalid({"input_ids": [-1, 2]})
    msg = invalid({"input_ids": [1, 2, 3], "label_token_ids": [[0, 1], [7, 250]]})
    assert "label_token_ids[1, 1] = 250" in msg
    # Without a known vocabulary the producer cannot check; the consumer will.
    check_limits(parse_request({"input_ids": [1, 10**6]}), Limits(vocab_size=None))


def test_job_wire_round_trip() -> None:
    req = TeacherRequest(
        input_ids=[3, 1, 4, 1, 5],
        label_token_ids=np.arange(8).reshape(4, 2),
        sample_n=2,
        top_k=3,
        return_entropy=True,
        temperature=0.7,
        seed=99,
        metadata={"row": 7},
        trace={"trace_id": "t", "span_id": "s"},
    )
    fields = encode_job(req, job_id="job-1", submitted_at=123.0)
    assert isinstance(fields["input_ids"], bytes)  # arrays travel binary
    wire = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}
    job = decode_job("1-0", wire, limits=LIMITS)
    assert job.job_id == "job-1" and job.entry_id == "1-0" and job.submitted_at == 123.0
    got = job.request
    assert got.input_ids.tolist() == [3, 1, 4, 1, 5]
    assert got.label_token_ids.tolist() == np.arange(8).reshape(4, 2).tolist()
    assert (got.sample_n, got.top_k, got.return_entropy, got.temperature, got.seed) == (
        2,
        3,
        True,
        0.7,
        99,
    )
    assert got.metadata == {"row": 7} and got.trace == {"trace_id": "t", "span_id": "s"}


def _wire(**override) -> dict[bytes, bytes]:
    base = {
        b"v": b"1",
        b"job_id": b"j",
        b"meta": b'{"top_k": 0}',
        b"input_ids": encode_array(np.array([1, 2, 3], dtype=np.int32)),
    }
    for k, v in override.items():
        if v is None:
            base.pop(k.encode())
        else:
            base[k.encode()] = v
    return base


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"v": b"9"}, "schema version '9' is not supported"),
        ({"job_id": None}, "no 'job_id' field"),
        ({"meta": b"{not json"}, "'meta' is not valid JSON"),
        ({"meta": b"[1]"}, "must be a JSON object"),
        ({"meta": b'{"evil": 1}'}, "unknown keys ['evil']"),
        ({"meta": b'{"top_k": "many"}'}, "top_k"),
        ({"input_ids": None}, "no 'input_ids' field"),
        ({"input_ids": encode_array(np.array([1, 2, 3]))[:-3]}, "input_ids"),
        ({"input_ids": encode_array(np.zeros((2, 2), dtype=np.int32))}, "input_ids"),
        ({"input_ids": encode_array(np.array([1.0, 2.0]))}, "integers"),
        ({"input_ids": encode_array(np.arange(40))}, "40"),
        ({"input_ids": encode_array(np.array([1, 2, 999]))}, "outside the vocabulary"),
        ({"job_id": b"\xff\xfe"}, "not UTF-8"),
    ],
)
def test_bad_stream_entries_raise_invalid_job(override: dict, expected: str) -> None:
    with pytest.raises(InvalidJob) as info:
        decode_job("1-0", _wire(**override), limits=LIMITS)
    assert expected in str(info.value)


def test_content_job_id_is_stable_and_sensitive() -> None:
    a = TeacherRequest(input_ids=[1, 2, 3], top_k=2)
    same = TeacherRequest(input_ids=np.array([1, 2, 3]), top_k=2, metadata={"x": 1})
    assert content_job_id(a, queue="q", teacher=None) == content_job_id(
        same, queue="q", teacher=None
    )
    others = [
        TeacherRequest(input_ids=[1, 2, 4], top_k=2),
        TeacherRequest(input_ids=[1, 2, 3], top_k=3),
        TeacherRequest(input_ids=[1, 2, 3], top_k=2, temperature=0.5),
    ]
    base = content_job_id(a, queue="q", teacher=None)
    assert all(content_job_id(o, queue="q", teacher=None) != base for o in others)
    assert content_job_id(a, queue="other", teacher=None) != base
    assert content_job_id(a, queue="q", teacher="/ckpt") != base


def test_keys_share_the_queue_hash_tag() -> None:
    assert keys.jobs_stream("q") == "teacherq:{q}:jobs"
    assert keys.done_stream("q") == "teacherq:{q}:done"
    assert keys.dead_stream("q") == "teacherq:{q}:dead"
    for k in (
        keys.result_key("q", "j"),
        keys.submitted_key("q", "j"),
        keys.consumers_key("q"),
        keys.model_key("q"),
    ):
        assert k.startswith("teacherq:{q}:")


def test_result_json_form() -> None:
    res = TeacherResult(job_id="j", model_version="m", logprobs=np.array([-1.0, -2.0], np.float32))
    out = res.to_json()
    assert out["logprobs"] == [-1.0, -2.0] and out["entropy"] is None and out["error"] is None
    assert res.ok and not TeacherResult(job_id="j", error="boom").ok


@given(
    st.dictionaries(
        st.sampled_from([b"v", b"job_id", b"meta", b"input_ids", b"label_token_ids", b"n_tokens"]),
        st.one_of(
            st.binary(max_size=64),
            st.just(b"1"),
            st.just(b'{"top_k": 2, "seed": 1}'),
            st.builds(lambda n: encode_array(np.arange(n, dtype=np.int32)), st.integers(0, 40)),
        ),
    )
)
@hsettings(max_examples=300, deadline=None)
def test_any_stream_entry_decodes_or_raises_invalid_job(fields: dict) -> None:
    """Whatever bytes a stream entry holds, decoding either succeeds or raises InvalidJob."""
    try:
        job = decode_job("1-0", fields, limits=LIMITS)
    except InvalidJob as exc:
        assert str(exc)
    else:
        assert 2 <= job.request.num_tokens <= LIMITS.max_input_tokens
