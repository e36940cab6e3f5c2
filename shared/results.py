"""The Redis result record: how a job's outputs are stored and read back.

A record is a Redis hash at `keys.result_key(queue, job_id)`:

- `v`: schema version; `status`: `ok` or `failed`;
- `meta`: JSON with job_id, model_version, metadata, timings, error, and `object`
  (`{"key", "checksum"}`) when the arrays live in object storage;
- `a:<name>`: an inline array in the binary codec, when the arrays are small.

Small results stay inline (one round trip to read); larger ones go to object storage as one
safetensors blob whose checksum is recorded here and verified on read.

Token ids (`RESULT_TABLE`'s "int" arrays) are int64 in a `TeacherResult` and stored as int32
where every value fits (any vocabulary, and the head's sentinel id 2**31 - 1, does): with top-k
64 and 8 samples that is 588 bytes a scored token instead of 876, a third less to hash, write,
keep and read back. Both widths are self-described (safetensors, the codec's header), so a
reader widens what it finds to int64 and reads records written either way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from shared.codec import decode_array, encode_array
from shared.messages import RESULT_ARRAYS, RESULT_TABLE, TeacherResult
from shared.storage import ObjectStore, bulk_object_key, compute_checksum

RECORD_VERSION = "1"
_ID_ARRAYS = frozenset(a.name for a in RESULT_TABLE if a.kind == "int")
_INT32 = np.iinfo(np.int32)


def _stored(name: str, arr: np.ndarray) -> np.ndarray:
    """`arr` as the record stores it: token ids as int32 where they fit, else as they are."""
    narrow = name in _ID_ARRAYS and arr.dtype == np.int64 and arr.size > 0
    if narrow and _INT32.min <= arr.min() and arr.max() <= _INT32.max:
        return arr.astype(np.int32)
    return arr


def encode_record(
    result: TeacherResult,
    *,
    queue: str,
    store: ObjectStore | None,
    inline_max_bytes: int,
) -> dict[str, bytes | str]:
    """Hash fields for a result; uploads the arrays first when they exceed inline_max_bytes.

    The upload happens before the record exists, so a reader never sees a pointer to a
    missing object; re-uploading the same job writes the same key with the same bytes.
    """
    arrays = {name: _stored(name, arr) for name, arr in result.arrays().items()}
    meta: dict[str, Any] = {
        "job_id": result.job_id,
        "model_version": result.model_version,
        "model_generation": result.model_generation,
        "metadata": result.metadata,
        "timings": result.timings,
        "error": result.error,
        "object": None,
    }
    fields: dict[str, bytes | str] = {
        "v": RECORD_VERSION,
        "status": "ok" if result.ok else "failed",
    }
    total = sum(a.nbytes for a in arrays.values())
    if arrays and store is not None and total > inline_max_bytes:
        blob = st_save({k: np.ascontiguousarray(v) for k, v in arrays.items()})
        # Content-addressed: a recomputation that differs in the last bit (another batch
        # composition) writes its own object, so a record never points at another's bytes.
        digest = compute_checksum(blob)
        key = f"{bulk_object_key(queue, result.job_id)}.{digest.split(':')[-1][:16]}"
        store.put_with_retry(key, blob, checksum=digest)
        meta["object"] = {"key": key, "checksum": digest, "bytes": len(blob)}
    else:
        for name, arr in arrays.items():
            fields[f"a:{name}"] = encode_array(arr)
    fields["meta"] = json.dumps(meta)
    return fields


def record_object(fields: dict[bytes, bytes]) -> dict[str, Any] | None:
    """The object-storage pointer of a record (`{"key", "checksum", ...}`), None when its
    arrays are inline; lets an asyncio reader fetch the blob itself before `decode_record`."""
    obj = json.loads(fields[b"meta"]).get("object")
    return obj or None


READ_THREADS = 8
"""Objects `decode_records` fetches at once: a GET from S3 waits tens of milliseconds on the
network, so a trainer reading a batch of results one after another would wait on each."""


def decode_records(
    records: Sequence[dict[bytes, bytes] | None], *, store: ObjectStore | None
) -> list[TeacherResult | None]:
    """`decode_record` over `records` in order (None stays None), the ones whose arrays are in
    object storage fetched and verified on up to READ_THREADS threads at once. An error
    raises as `decode_record`'s would, for the first record (in order) that has one."""
    metas = [json.loads(fields[b"meta"]) if fields else None for fields in records]

    def one(fields: dict[bytes, bytes] | None, meta: dict[str, Any] | None):
        return decode_record(fields, store=store, meta=meta) if fields else None

    bulk = sum(1 for meta in metas if meta and meta.get("object"))
    if bulk < 2:
        return [one(f, m) for f, m in zip(records, metas, strict=True)]
    with ThreadPoolExecutor(min(READ_THREADS, bulk), thread_name_prefix="tq-read") as pool:
        return list(pool.map(one, records, metas))


def decode_record(
    fields: dict[bytes, bytes],
    *,
    store: ObjectStore | None,
    blob: bytes | None = None,
    meta: dict[str, Any] | None = None,
) -> TeacherResult:
    """A TeacherResult from hash fields, fetching (and verifying) bulk arrays if needed.
    `blob`: the record's object, already fetched and verified by the caller; `meta`: its
    `meta` field, already parsed by the caller."""
    if meta is None:
        meta = json.loads(fields[b"meta"])
    result = TeacherResult(
        job_id=meta["job_id"],
        model_version=meta.get("model_version", ""),
        model_generation=int(meta.get("model_generation", 0)),
        metadata=meta.get("metadata") or {},
        timings=meta.get("timings") or {},
        error=meta.get("error"),
        # Marked by a consumer writing without its replica acknowledgement (replica_ack.py).
        replicated=fields.get(b"replicated") != b"0",
    )
    obj = meta.get("object")
    if obj:
        if blob is None:
            if store is None:
                raise ValueError(f"result {result.job_id} is in object storage but no store is set")
            blob = store.get(obj["key"], checksum=obj["checksum"])
        arrays = st_load(blob)
    else:
        arrays = {
            k.decode()[2:]: decode_array(v, name=k.decode()[2:])
            for k, v in fields.items()
            if k.startswith(b"a:")
        }
    for name in RESULT_ARRAYS:
        if name in arrays:
            arr = arrays[name]
            narrow = name in _ID_ARRAYS and arr.dtype == np.int32  # as `_stored` wrote it
            setattr(result, name, arr.astype(np.int64) if narrow else arr)
    return result
