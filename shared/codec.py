"""Binary codec for numpy arrays that travel between processes.

Arrays cross process boundaries (Redis payloads, result objects in object storage) as plain
bytes in a small self-describing format, so that no side ever has to unpickle untrusted data or
parse JSON number lists.

Layout, all integers little-endian::

    offset  size      field
    0       4         magic  b"TQAR"
    4       1         format version (currently 1)
    5       1         dtype code (see ``DTYPE_CODES``)
    6       1         ndim (0..MAX_NDIM)
    7       1         reserved, must be 0
    8       8 * ndim  shape, one uint64 per dimension
    ...     rest      raw element data, little-endian, C order

The header is always a multiple of 8 bytes long, so the payload of an 8-byte dtype starts
aligned whenever the buffer itself is.
"""

from __future__ import annotations

import math
import struct
from typing import Final

import numpy as np

__all__ = [
    "DTYPE_CODES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_NDIM",
    "SUPPORTED_DTYPES",
    "CodecError",
    "decode_array",
    "encode_array",
    "encoded_size",
]

MAGIC: Final = b"TQAR"
FORMAT_VERSION: Final = 1
MAX_NDIM: Final = 8

# Codes are part of the wire format: never renumber, only append.
DTYPE_CODES: Final[dict[str, int]] = {
    "bool": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "uint8": 6,
    "uint16": 7,
    "uint32": 8,
    "float16": 9,
    "float32": 10,
    "float64": 11,
}
_CODE_TO_NAME: Final[dict[int, str]] = {code: name for name, code in DTYPE_CODES.items()}
SUPPORTED_DTYPES: Final[tuple[str, ...]] = tuple(DTYPE_CODES)

_FIXED = struct.Struct("<4sBBBB")
_FIXED_SIZE: Final = _FIXED.size  # 8
_DIM = 8
# numpy indexes with signed 64-bit integers; anything at or beyond this cannot be an array.
_MAX_BYTES: Final = 2**63 - 1


class CodecError(ValueError):
    """Raised when an array cannot be encoded or a byte string is not a valid encoded array."""


def _supported_list() -> str:
    return ", ".join(SUPPORTED_DTYPES)


def _canonical_dtype_name(dtype: np.dtype) -> str | None:
    """Return our name for ``dtype`` (any byte order), or None when it is not supported."""
    # Compare by kind/itemsize rather than by name so that e.g. '>f4' maps to float32, while
    # structured, object, datetime and string dtypes (which can share an itemsize) fall out.
    if dtype.fields is not None or dtype.subdtype is not None:
        return None
    name = dtype.newbyteorder("=").name
    return name if name in DTYPE_CODES else None


def encoded_size(shape: tuple[int, ...], dtype: str) -> int:
    """Return the number of bytes ``encode_array`` produces for an array of this shape and dtype.

    Useful for sizing buffers and for deciding up front whether a result goes multipart.
    """
    if dtype not in DTYPE_CODES:
        raise CodecError(f"unsupported dtype {dtype!r}; supported dtypes: {_supported_list()}")
    itemsize = np.dtype(dtype).itemsize
    return _FIXED_SIZE + _DIM * len(shape) + math.prod(shape) * itemsize


def encode_array(arr: np.ndarray, *, name: str = "array") -> bytes:
    """Encode ``arr`` as header + little-endian C-order data.

    Big-endian, Fortran-ordered and non-contiguous inputs are converted first; the input is never
    modified. Raises ``CodecError`` for non-arrays, unsupported dtypes or too many dimensions.
    """
    if not isinstance(arr, np.ndarray):
        raise CodecError(f"{name}: expected a numpy.ndarray, got {type(arr).__name__}")
    dtype_name = _canonical_dtype_name(arr.dtype)
    if dtype_name is None:
        raise CodecError(
            f"{name}: unsupported dtype {arr.dtype.str!r} ({arr.dtype}); "
            f"supported dtypes: {_supported_list()}"
        )
    if arr.ndim > MAX_NDIM:
        raise CodecError(f"{name}: ndim {arr.ndim} exceeds the maximum of {MAX_NDIM}")

    little = np.dtype(dtype_name).newbyteorder("<")
    # asarray drops ndarray subclasses and only copies when the byte order or the memory layout
    # has to change (np.ascontiguousarray would also turn 0-d arrays into 1-d ones).
    data = np.asarray(arr, dtype=little, order="C")
    header = _FIXED.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype_name], data.ndim, 0)
    shape = struct.pack(f"<{data.ndim}Q", *data.shape)
    # A flat uint8 view lets bytes.join copy the payload exactly once, 0-d arrays included.
    payload = data.reshape(-1).view(np.uint8).data
    return b"".join((header, shape, payload))


def decode_array(
    data: bytes | bytearray | memoryview,
    *,
    max_elements: int | None = None,
    expect_dtype: str | None = None,
    expect_ndim: int | None = None,
    name: str = "array",
) -> np.ndarray:
    """Decode bytes produced by ``encode_array`` into a new, writable, native-endian array.

    ``max_elements`` bounds the element count declared by the header, so a corrupted or hostile
    header cannot make the reader trust an absurd shape; ``expect_dtype`` / ``expect_ndim`` check
    the decoded array against what the caller needs. Every failure raises ``CodecError`` whose
    message starts with ``name`` so the user can tell which array was wrong.
    """
    if expect_dtype is not None and expect_dtype not in DTYPE_CODES:
        # A programming error in the caller, not bad data: plain ValueError.
        raise ValueError(
            f"expect_dtype {expect_dtype!r} is not a supported dtype; "
            f"supported: {_supported_list()}"
        )
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"{name}: expected bytes, got {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise CodecError(f"{name}: buffer is not contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view

    dtype_name, shape, header_size = _read_header(view, name)
    itemsize = np.dtype(dtype_name).itemsize
    count = math.prod(shape)
    ndim = len(shape)
    # numpy rejects shapes whose non-zero extents overflow int64 even when another extent is 0.
    nonzero_extent = math.prod(d for d in shape if d != 0)
    if nonzero_extent * itemsize > _MAX_BYTES:
        raise CodecError(f"{name}: shape {shape} is too large to represent as an array")
    if max_elements is not None and count > max_elements:
        raise CodecError(
            f"{name}: element count {count} (shape {shape}) exceeds max_elements={max_elements}"
        )
    expected_payload = count * itemsize
    got_payload = len(view) - header_size
    if got_payload != expected_payload:
        what = "truncated" if got_payload < expected_payload else "trailing bytes"
        raise CodecError(
            f"{name}: payload length mismatch ({what}): shape {shape} of {dtype_name} needs "
            f"{expected_payload} bytes, got {got_payload}"
        )
    if expect_dtype is not None and dtype_name != expect_dtype:
        raise CodecError(f"{name}: dtype is {dtype_name}, expected {expect_dtype}")
    if expect_ndim is not None and ndim != expect_ndim:
        raise CodecError(f"{name}: ndim is {ndim} (shape {shape}), expected {expect_ndim}")

    little = np.dtype(dtype_name).newbyteorder("<")
    flat = np.frombuffer(view, dtype=little, count=count, offset=header_size)
    if dtype_name == "bool" and count and int(flat.view(np.uint8).max()) > 1:
        # numpy would happily build bools from byte 2..255, which then compare unequal to True.
        raise CodecError(f"{name}: bool payload contains byte values other than 0 and 1")
    # astype copies, which detaches the result from the caller's buffer and makes it writable.
    return flat.astype(np.dtype(dtype_name), copy=True).reshape(shape)


def _read_header(view: memoryview, name: str) -> tuple[str, tuple[int, ...], int]:
    """(dtype name, shape, header size) of an encoded array; CodecError names what is wrong."""
    total = len(view)
    if total < _FIXED_SIZE:
        raise CodecError(
            f"{name}: {total} bytes is too short for an array header (needs at least {_FIXED_SIZE})"
        )
    magic, version, code, ndim, reserved = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(
            f"{name}: bad magic {bytes(magic)!r} (expected {MAGIC!r}); "
            "not an encoded array, or corrupted"
        )
    if version != FORMAT_VERSION:
        raise CodecError(
            f"{name}: unknown format version {version} (this reader understands {FORMAT_VERSION})"
        )
    dtype_name = _CODE_TO_NAME.get(code)
    if dtype_name is None:
        raise CodecError(
            f"{name}: unknown dtype code {code}; known codes: "
            + ", ".join(f"{c}={n}" for c, n in _CODE_TO_NAME.items())
        )
    if ndim > MAX_NDIM:
        raise CodecError(f"{name}: ndim {ndim} exceeds the maximum of {MAX_NDIM}")
    if reserved != 0:
        raise CodecError(f"{name}: reserved header byte is {reserved}, expected 0")
    header_size = _FIXED_SIZE + _DIM * ndim
    if total < header_size:
        raise CodecError(
            f"{name}: truncated header: a {ndim}-d shape needs {header_size} header bytes, "
            f"got {total}"
        )
    return dtype_name, struct.unpack_from(f"<{ndim}Q", view, _FIXED_SIZE), header_size
