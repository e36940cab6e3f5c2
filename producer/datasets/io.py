"""Reading a dataset's input rows: JSONL or Parquet, a local file or an s3:// object, from a
recorded position (byte offset for JSONL, row index for Parquet)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from producer.datasets.records import ROW_FIELDS, DatasetError
from shared.settings import StorageSettings
from shared.storage import ObjectStore, StorageError


@dataclass(frozen=True)
class RawRow:
    """One input row: its fields, or why it could not be read; `offset` is where the next row
    starts (bytes for JSONL, rows for Parquet)."""

    index: int
    fields: dict[str, Any] | None
    error: str | None
    offset: int


def detect_format(location: str, head: bytes) -> Literal["jsonl", "parquet"]:
    """Parquet by suffix or magic bytes, JSONL otherwise."""
    suffix = location.rsplit(".", 1)[-1].lower()
    if suffix in ("parquet", "pq") or head[:4] == b"PAR1":
        return "parquet"
    return "jsonl"


def iter_jsonl(f: BinaryIO, *, start_row: int = 0, start_byte: int = 0) -> Iterator[RawRow]:
    """Rows of a JSONL stream from a byte offset; blank lines are skipped and do not count."""
    f.seek(start_byte)
    offset, index = start_byte, start_row
    for line in f:
        offset += len(line)
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            yield RawRow(index, None, f"not valid JSON: {exc}", offset)
        else:
            if isinstance(obj, dict):
                yield RawRow(index, obj, None, offset)
            else:
                yield RawRow(
                    index, None, f"expected a JSON object, got {type(obj).__name__}", offset
                )
        index += 1


def iter_parquet(f: BinaryIO, *, start_row: int = 0, batch_rows: int = 1024) -> Iterator[RawRow]:
    """Rows of a Parquet file from a row index, reading only the known columns and starting at
    the row group that holds `start_row`."""
    pf = pq.ParquetFile(f)
    md = pf.metadata
    group, group_start = 0, 0
    while group < md.num_row_groups and group_start + md.row_group(group).num_rows <= start_row:
        group_start += md.row_group(group).num_rows
        group += 1
    if group >= md.num_row_groups:
        return
    columns = [c for c in pf.schema_arrow.names if c in ROW_FIELDS]
    index = group_start
    for batch in pf.iter_batches(
        batch_size=batch_rows, row_groups=range(group, md.num_row_groups), columns=columns
    ):
        for row in batch.to_pylist():
            if index >= start_row:
                yield RawRow(index, row, None, index + 1)
            index += 1


def iter_rows(
    f: BinaryIO, fmt: str, *, start_row: int, start_byte: int, batch_rows: int
) -> Iterator[RawRow]:
    """Rows of either format from a recorded position."""
    if fmt == "parquet":
        return iter_parquet(f, start_row=start_row, batch_rows=batch_rows)
    return iter_jsonl(f, start_row=start_row, start_byte=start_byte)


class _ReaderFile(io.RawIOBase):
    """A standard binary file over obstore's ReadableFile (which returns Bytes and lacks the
    `closed`/`readinto` that pyarrow and io.BufferedReader need)."""

    def __init__(self, reader: Any) -> None:
        self._r = reader

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = memoryview(self._r.read(len(buf)))
        memoryview(buf).cast("B")[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return int(self._r.seek(offset, whence))

    def tell(self) -> int:
        return int(self._r.tell())

    def close(self) -> None:
        if not self.closed:
            self._r.close()
        super().close()


def object_store(url: str, storage: StorageSettings) -> ObjectStore:
    """The object store at `url`, with the S3 settings from `storage`."""
    return ObjectStore.from_settings(storage, url=url)


@contextmanager
def open_input(location: str, storage: StorageSettings) -> Iterator[BinaryIO]:
    """A seekable binary file for a local path or an s3:// object (ranged reads through
    obstore, S3 settings from `storage`)."""
    if not location.startswith("s3://"):
        with open(location, "rb") as fh:
            yield fh
        return
    import obstore

    bucket, _, key = location[len("s3://") :].partition("/")
    store = object_store(f"s3://{bucket}", storage)
    # ObjectStore has no ranged/streaming read yet; its wrapped obstore store is used directly.
    reader = obstore.open_reader(store._store, key)
    with io.BufferedReader(_ReaderFile(reader), buffer_size=1 << 20) as fh:
        yield fh  # type: ignore[misc]  # BufferedReader is a BinaryIO in practice


@dataclass(frozen=True)
class InputInfo:
    """What a quick look at the input tells: format, row count (Parquet), column names."""

    format: Literal["jsonl", "parquet"]
    total_rows: int | None
    columns: list[str] | None


def probe_input(location: str, storage: StorageSettings) -> InputInfo:
    """Open the input and check it looks usable; raise DatasetError naming what is wrong."""
    try:
        with open_input(location, storage) as f:
            fmt = detect_format(location, f.read(4))
            f.seek(0)
            if fmt == "jsonl":
                return InputInfo("jsonl", None, None)
            pf = pq.ParquetFile(f)
            names = list(pf.schema_arrow.names)
            if "input_ids" not in names:
                raise DatasetError(f"{location}: Parquet file has no input_ids column ({names})")
            return InputInfo("parquet", pf.metadata.num_rows, names)
    except (OSError, StorageError, pa.ArrowException) as exc:
        raise DatasetError(f"cannot read {location}: {exc}") from None
