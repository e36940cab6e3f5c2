"""Tests for shared.codec: round trips, every rejection path, and fuzzing for stray exceptions."""

from __future__ import annotations

import struct
from typing import Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared.codec import (
    DTYPE_CODES,
    FORMAT_VERSION,
    MAGIC,
    MAX_NDIM,
    SUPPORTED_DTYPES,
    CodecError,
    decode_array,
    encode_array,
    encoded_size,
)

SHAPES = [(), (0,), (1,), (7,), (0, 5), (5, 0), (3, 4), (2, 3, 4), (1,) * MAX_NDIM]


def _sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic data that exercises sign bits and non-trivial values for each dtype."""
    n = int(np.prod(shape))
    rng = np.random.default_rng(n + len(dtype))
    if dtype == "bool":
        return rng.integers(0, 2, size=n).astype(bool).reshape(shape)
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    if info is not None:
        return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype).reshape(shape)
    return (rng.standard_normal(n) * 1e3).astype(dtype).reshape(shape)


def _header(
    *,
    magic: bytes = MAGIC,
    version: int = FORMAT_VERSION,
    code: int = DTYPE_CODES["float32"],
    shape: tuple[int, ...] = (2,),
    ndim: int | None = None,
    reserved: int = 0,
) -> bytes:
    nd = len(shape) if ndim is None else ndim
    return struct.pack("<4sBBBB", magic, version, code, nd, reserved) + struct.pack(
        f"<{len(shape)}Q", *shape
    )


def _assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert b.dtype == a.dtype.newbyteorder("=")
    assert b.shape == a.shape
    # Bitwise comparison (after the byte swap, if any) so that NaN payloads and -0.0 count too.
    expected = np.ascontiguousarray(a.astype(b.dtype)).reshape(-1).view(np.uint8)
    np.testing.assert_array_equal(b.reshape(-1).view(np.uint8), expected)


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    arr = _sample(dtype, shape)
    blob = encode_array(arr)
    assert isinstance(blob, bytes)
    assert len(blob) == encoded_size(shape, dtype)
    out = decode_array(blob, expect_dtype=dtype, expect_ndim=len(shape))
    _assert_same(arr, out)
    assert out.flags.writeable and out.flags.c_contiguous
    assert out.dtype.isnative


def test_layout_is_documented_little_endian_header_then_data() -> None:
    arr = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int16)
    blob = encode_array(arr)
    assert blob[:4] == MAGIC
    assert blob[4:8] == bytes([FORMAT_VERSION, DTYPE_CODES["int16"], 2, 0])
    assert struct.unpack("<2Q", blob[8:24]) == (2, 3)
    assert blob[24:] == struct.pack("<6h", 1, 2, 3, 4, 5, 6)


@pytest.mark.parametrize(
    "dtype", ["int16", "int32", "int64", "uint16", "uint32", "float16", "float32", "float64"]
)
def test_big_endian_input_encodes_identically_to_little_endian(dtype: str) -> None:
    arr = _sample(dtype, (4, 3))
    big = arr.astype(np.dtype(dtype).newbyteorder(">"))
    assert encode_array(big) == encode_array(arr)
    out = decode_array(encode_array(big))
    assert out.dtype.isnative
    np.testing.assert_array_equal(out, arr)


def test_non_contiguous_and_fortran_inputs_are_encoded_in_c_order() -> None:
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    for view in (base[::2, 1::3], base.T, np.asfortranarray(base), base[:, ::-1]):
        assert not view.flags.c_contiguous
        out = decode_array(encode_array(view))
        np.testing.assert_array_equal(out, view)
        assert out.flags.c_contiguous


def test_encode_does_not_modify_input_and_decode_copies_buffer() -> None:
    arr = np.arange(5, dtype=">i4")
    before = arr.copy()
    blob = bytearray(encode_array(arr))
    np.testing.assert_array_equal(arr, before)
    assert arr.dtype == np.dtype(">i4")
    out = decode_array(blob)
    blob[-4:] = b"\xff\xff\xff\xff"  # mutating the source buffer must not reach the array
    np.testing.assert_array_equal(out, [0, 1, 2, 3, 4])
    out[0] = 42  # and the array is writable


def test_decode_accepts_memoryview_and_bytearray() -> None:
    arr = np.linspace(0, 1, 9, dtype=np.float64).reshape(3, 3)
    blob = encode_array(arr)
    for data in (bytearray(blob), memoryview(blob)):
        np.testing.assert_array_equal(decode_array(data), arr)


def test_special_float_values_survive() -> None:
    arr = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45, np.finfo(np.float32).max], np.float32)
    _assert_same(arr, decode_array(encode_array(arr)))


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from(SUPPORTED_DTYPES).map(np.dtype),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6),
    ),
    st.sampled_from(["<", ">"]),
    st.booleans(),
)
def test_property_round_trip(
    arr: np.ndarray, byteorder: Literal["<", ">"], transpose: bool
) -> None:
    src = arr.astype(arr.dtype.newbyteorder(byteorder))
    if transpose:
        src = src.T
    out = decode_array(encode_array(src), expect_dtype=arr.dtype.name, expect_ndim=src.ndim)
    _assert_same(src, out)


# --- encode errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arr",
    [
        np.zeros(3, dtype=np.complex64),
        np.zeros(3, dtype=np.uint64),
        np.zeros(3, dtype=object),
        np.array(["a", "b"]),
        np.zeros(2, dtype="datetime64[s]"),
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]),
    ],
    ids=lambda a: str(a.dtype),
)
def test_encode_rejects_unsupported_dtype_naming_it_and_the_supported_ones(arr: np.ndarray) -> None:
    with pytest.raises(CodecError) as info:
        encode_array(arr, name="logits")
    msg = str(info.value)
    assert msg.startswith("logits: unsupported dtype")
    assert str(arr.dtype) in msg
    assert "float32" in msg and "bool" in msg and "uint32" in msg


def test_encode_rejects_non_arrays_and_too_many_dims() -> None:
    with pytest.raises(CodecError, match="expected a numpy.ndarray, got list"):
        encode_array([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(CodecError, match=f"ndim {MAX_NDIM + 1} exceeds the maximum of {MAX_NDIM}"):
        encode_array(np.zeros((1,) * (MAX_NDIM + 1), dtype=np.int8))


# --- decode errors ---------------------------------------------------------------------------


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(CodecError, match=r"^ids: expected bytes, got str$"):
        decode_array("TQAR", name="ids")  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="expected bytes, got ndarray"):
        decode_array(np.zeros(4, np.uint8))  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, 1, 7])
def test_decode_rejects_data_too_short_for_header(n: int) -> None:
    with pytest.raises(CodecError, match=rf"^ids: {n} bytes is too short for an array header"):
        decode_array(encode_array(np.zeros(3, np.int32))[:n], name="ids")


def test_decode_rejects_bad_magic() -> None:
    blob = _header(magic=b"NOPE") + bytes(8)
    with pytest.raises(CodecError, match=r"^ids: bad magic b'NOPE' \(expected b'TQAR'\)"):
        decode_array(blob, name="ids")


def test_decode_rejects_unknown_version() -> None:
    blob = _header(version=FORMAT_VERSION + 1) + bytes(8)
    with pytest.raises(CodecError, match=f"unknown format version {FORMAT_VERSION + 1}"):
        decode_array(blob)


@pytest.mark.parametrize("code", [0, 12, 200, 255])
def test_decode_rejects_unknown_dtype_code(code: int) -> None:
    with pytest.raises(CodecError, match=rf"^ids: unknown dtype code {code};"):
        decode_array(_header(code=code) + bytes(8), name="ids")


def test_decode_rejects_ndim_above_cap() -> None:
    blob = _header(shape=(1,) * (MAX_NDIM + 1)) + bytes(4)
    with pytest.raises(CodecError, match=f"ndim {MAX_NDIM + 1} exceeds the maximum of {MAX_NDIM}"):
        decode_array(blob)
    # The cap applies before the shape is even read, so a huge ndim with no shape bytes is fine.
    with pytest.raises(CodecError, match="ndim 255 exceeds"):
        decode_array(_header(shape=(), ndim=255))


def test_decode_rejects_nonzero_reserved_byte() -> None:
    with pytest.raises(CodecError, match="reserved header byte is 3, expected 0"):
        decode_array(_header(reserved=3) + bytes(8))


def test_decode_rejects_truncated_shape() -> None:
    blob = _header(shape=(2, 3))[:-4]
    with pytest.raises(CodecError, match="truncated header: a 2-d shape needs 24 header bytes"):
        decode_array(blob)


def test_decode_rejects_absurd_element_count_naming_count_and_limit() -> None:
    # The header claims 2**40 float32s but only 8 bytes follow: must not try to allocate.
    blob = _header(shape=(2**20, 2**20)) + bytes(8)
    with pytest.raises(CodecError) as info:
        decode_array(blob, max_elements=10_000_000, name="logprobs")
    msg = str(info.value)
    assert msg.startswith("logprobs: element count 1099511627776")
    assert "max_elements=10000000" in msg
    # Without a limit, the length check still refuses it rather than allocating.
    with pytest.raises(CodecError, match="payload length mismatch"):
        decode_array(blob)


def test_decode_max_elements_is_inclusive() -> None:
    blob = encode_array(np.zeros((2, 5), np.float32))
    assert decode_array(blob, max_elements=10).shape == (2, 5)
    with pytest.raises(CodecError, match=r"element count 10 \(shape \(2, 5\)\) exceeds"):
        decode_array(blob, max_elements=9)


def test_decode_rejects_unrepresentable_shape_even_when_empty() -> None:
    blob = _header(shape=(0, 2**62, 2**62))
    with pytest.raises(CodecError, match="too large to represent"):
        decode_array(blob)


def test_decode_reports_truncated_payload_expected_vs_got() -> None:
    blob = encode_array(np.zeros((2, 3), np.float32))[:-5]
    with pytest.raises(CodecError) as info:
        decode_array(blob, name="logprobs")
    msg = str(info.value)
    assert msg.startswith("logprobs: payload length mismatch (truncated)")
    assert "needs 24 bytes, got 19" in msg


def test_decode_reports_trailing_bytes_expected_vs_got() -> None:
    blob = encode_array(np.zeros((2, 3), np.float32)) + b"\x00\x01"
    with pytest.raises(CodecError, match=r"\(trailing bytes\).*needs 24 bytes, got 26"):
        decode_array(blob)


def test_decode_rejects_wrong_dtype_and_ndim() -> None:
    blob = encode_array(np.zeros((2, 3), np.float16))
    with pytest.raises(CodecError, match=r"^logprobs: dtype is float16, expected float32$"):
        decode_array(blob, expect_dtype="float32", name="logprobs")
    with pytest.raises(CodecError, match=r"^logprobs: ndim is 2 \(shape \(2, 3\)\), expected 1$"):
        decode_array(blob, expect_ndim=1, name="logprobs")


def test_decode_rejects_non_canonical_bool_bytes() -> None:
    blob = bytearray(encode_array(np.array([True, False, True])))
    blob[-1] = 2
    with pytest.raises(CodecError, match="bool payload contains byte values other than 0 and 1"):
        decode_array(bytes(blob))


def test_decode_bad_expect_dtype_argument_is_a_caller_error() -> None:
    with pytest.raises(
        ValueError, match="expect_dtype 'float128' is not a supported dtype"
    ) as info:
        decode_array(encode_array(np.zeros(1, np.float32)), expect_dtype="float128")
    assert not isinstance(info.value, CodecError)


def test_codec_error_is_a_value_error() -> None:
    assert issubclass(CodecError, ValueError)


# --- fuzzing: corrupt input only ever raises CodecError --------------------------------------

_FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_codec_error(data: bytes, **kwargs: object) -> None:
    try:
        out = decode_array(data, **kwargs)  # type: ignore[arg-type]
    except CodecError:
        return
    # Whatever decodes must be a consistent array: re-encoding reproduces the input exactly.
    assert encode_array(out) == data


@_FUZZ
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_or_codec_error(data)


@_FUZZ
@given(st.binary(max_size=200), st.sampled_from(SUPPORTED_DTYPES), st.integers(0, MAX_NDIM + 2))
def test_fuzz_random_bytes_after_valid_prefix(tail: bytes, dtype: str, ndim: int) -> None:
    # Random bytes rarely get past the magic; a valid-looking prefix pushes the fuzzer deeper.
    prefix = struct.pack("<4sBBBB", MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], ndim, 0)
    _decode_or_codec_error(prefix + tail, max_elements=1000)
    _decode_or_codec_error(prefix + tail)


_valid_arrays = hnp.arrays(
    dtype=st.sampled_from(SUPPORTED_DTYPES).map(np.dtype),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
)


@_FUZZ
@given(_valid_arrays, st.data())
def test_fuzz_truncations(arr: np.ndarray, data: st.DataObject) -> None:
    blob = encode_array(arr)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CodecError):
        decode_array(blob[:cut])


@_FUZZ
@given(_valid_arrays, st.data())
def test_fuzz_bit_flips(arr: np.ndarray, data: st.DataObject) -> None:
    blob = bytearray(encode_array(arr))
    flips = data.draw(st.lists(st.integers(0, len(blob) * 8 - 1), min_size=1, max_size=4))
    for bit in flips:
        blob[bit // 8] ^= 1 << (bit % 8)
    _decode_or_codec_error(bytes(blob))
    _decode_or_codec_error(bytes(blob), max_elements=64, expect_dtype="float32", expect_ndim=2)
