"""Storing and reading back result records, token ids as int32 against int64, side by side.

Workload: batches of `--tokens` scored tokens cut into documents of uniform length in
`--lengths` MIN:MAX (a new draw every batch), every job asking for `--top-k` top-k and
`--samples` samples with the entropy (what `bench/gpu_e2e.py` calls every output), or with
`--label-only` for next-token log-probs alone. Each job's record is written the way a consumer
writes it (`shared.results.encode_record`: bulk arrays to the object store at `--store`, a
`file://` folder by default) and read back the way a client reads it (`decode_record`: fetch,
verify the checksum, parse).

Both variants run the same code, interleaved batch by batch: "int32" as it ships (token ids
stored narrow where they fit), "int64" with that narrowing turned off for the run
(`shared.results._stored` replaced by the identity), which is how records were stored before.
Printed: bytes stored per scored token, median milliseconds per batch to encode and to decode,
and int64/int32 ratios. The host's CPU is the whole cost here: run it where the consumer and
the client run.

Then reading: `--read-jobs` results written once, read back the way `TeacherClient.results`
did before (one record after another, each object fetched in turn) and the way it does now
(`shared.results.decode_records`: objects fetched on up to READ_THREADS threads), interleaved,
`--read-rounds` times; printed: median milliseconds each and the ratio. What threads win grows
with the store's latency per request: `--moto` runs this against moto's S3 server on loopback
(tests/s3_server.py; it needs the `dev` extra), which answers in a few milliseconds on a CPU
it shares with the bench; a store across a network waits longer per object.

    .venv/bin/python bench/result_record.py
    .venv/bin/python bench/result_record.py --moto
    .venv/bin/python bench/result_record.py --store s3://bucket/prefix   # with S3 settings
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shared import results  # noqa: E402 - repo on path
from shared.messages import TeacherResult  # noqa: E402 - repo on path
from shared.settings import Settings  # noqa: E402 - repo on path
from shared.storage import ObjectStore  # noqa: E402 - repo on path

VOCAB = 151_936  # Qwen2.5's


@contextlib.contextmanager
def moto(args: argparse.Namespace) -> Iterator[dict | None]:
    """With `--moto`: a moto S3 server on loopback with a bucket, as `ObjectStore.from_url`'s
    keyword arguments; else None."""
    if not args.moto:
        yield None
        return
    from tests.s3_server import S3Server

    server = S3Server()
    server.start()
    try:
        server.client().create_bucket(Bucket="bench-records")
        yield server.store_kwargs()
    finally:
        server.stop()


def batch(rng: np.random.Generator, args: argparse.Namespace, tag: str) -> list[TeacherResult]:
    """One batch's results: documents of random lengths until `args.tokens` are scored."""
    lo, hi = args.lengths
    out: list[TeacherResult] = []
    left = args.tokens
    while left > 1:
        rows = min(int(rng.integers(lo, hi + 1)), left) - 1
        left -= rows + 1
        res = TeacherResult(job_id=f"{tag}-{len(out)}")
        res.logprobs = -rng.exponential(size=rows).astype(np.float32)
        if not args.label_only:
            res.topk_token_ids = rng.integers(0, VOCAB, (rows, args.top_k))
            res.topk_logprobs = -rng.exponential(size=(rows, args.top_k)).astype(np.float32)
            res.topk_rest_logprob = -rng.exponential(size=rows).astype(np.float32)
            res.sampled_token_ids = rng.integers(0, VOCAB, (rows, args.samples))
            res.sampled_logprobs = -rng.exponential(size=(rows, args.samples)).astype(np.float32)
            res.entropy = rng.exponential(size=rows).astype(np.float32)
        out.append(res)
    return out


def as_read(record: dict) -> dict[bytes, bytes]:
    """An encoded record as Redis hands it back (HGETALL)."""
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in record.items()}


def round_trip(jobs: list[TeacherResult], store: ObjectStore, inline_max: int) -> tuple:
    """Seconds to encode every record, seconds to decode them all, bytes stored."""
    started = time.perf_counter()
    records = [
        results.encode_record(r, queue="bench", store=store, inline_max_bytes=inline_max)
        for r in jobs
    ]
    encoded = time.perf_counter()
    fields = [as_read(rec) for rec in records]
    back = [results.decode_record(f, store=store) for f in fields]
    decoded = time.perf_counter()
    for want, got in zip(jobs, back, strict=True):  # the same values, int64 ids either way
        for name, arr in want.arrays().items():
            assert np.array_equal(getattr(got, name), arr) and getattr(got, name).dtype == arr.dtype
    stored = sum(len(v) for f in fields for k, v in f.items() if k.startswith(b"a:"))
    stored += sum(
        (results.record_object(f) or {}).get("bytes", 0) for f in fields
    )  # the bulk objects
    return encoded - started, decoded - encoded, stored


def read_side_by_side(store: ObjectStore, args: argparse.Namespace) -> None:
    """Reading `args.read_jobs` records one by one against `decode_records`, interleaved."""
    rng = np.random.default_rng(1)
    jobs: list[TeacherResult] = []
    while len(jobs) < args.read_jobs:
        jobs += batch(rng, args, f"read{len(jobs)}")
    jobs = jobs[: args.read_jobs]
    records = [
        as_read(results.encode_record(j, queue="bench-read", store=store, inline_max_bytes=0))
        for j in jobs
    ]
    ways = {
        "one by one": lambda: [results.decode_record(f, store=store) for f in records],
        "side by side": lambda: results.decode_records(records, store=store),
    }
    took: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.read_rounds + 1):  # the first round warms up
        for name, read in ways.items():
            started = time.perf_counter()
            read()
            took[name].append(time.perf_counter() - started)
    mb = sum(len(f[b"meta"]) for f in records) / 1e6
    mb += sum((results.record_object(f) or {}).get("bytes", 0) for f in records) / 1e6
    print(f"reading {len(records)} results ({mb:.1f} MB), {args.read_rounds} rounds, medians:")
    medians = {name: statistics.median(t[1:]) * 1e3 for name, t in took.items()}
    for name, ms in medians.items():
        print(f"  {name}: {ms:7.1f} ms")
    print(f"  one by one / side by side: {medians['one by one'] / medians['side by side']:.2f}x")


def report(times: dict, tokens: dict, args: argparse.Namespace, url: str) -> None:
    """The int32 and int64 variants' sizes and times, and their ratios."""
    what = "label only" if args.label_only else f"top-k {args.top_k}, {args.samples} samples"
    print(f"{args.batches} batches of {args.tokens} tokens, {what}, lengths {args.lengths}, {url}")
    summary = {}
    for name, runs in times.items():
        enc = statistics.median(r[0] for r in runs) * 1e3
        dec = statistics.median(r[1] for r in runs) * 1e3
        per_token = sum(r[2] for r in runs) / tokens[name]
        summary[name] = (per_token, enc, dec)
        took = f"encode {enc:6.1f} ms  decode {dec:6.1f} ms"
        print(f"  ids {name}: {per_token:7.1f} bytes/token  {took}")
    (b64, e64, d64), (b32, e32, d32) = summary["int64"], summary["int32"]
    print(
        f"  int64/int32: bytes {b64 / b32:.2f}x  encode {e64 / e32:.2f}x  decode {d64 / d32:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="scored tokens a batch")
    parser.add_argument("--lengths", type=lambda s: tuple(map(int, s.split(":"))),
                        default=(512, 4096), help="document lengths, MIN:MAX")  # fmt: skip
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--label-only", action="store_true", help="next-token log-probs only")
    parser.add_argument("--batches", type=int, default=30, help="batches per variant")
    parser.add_argument("--store", default=None, help="object store URL (default: a temp dir)")
    parser.add_argument("--moto", action="store_true", help="moto's S3 server on loopback")
    parser.add_argument("--read-jobs", type=int, default=64, help="results read back at once")
    parser.add_argument("--read-rounds", type=int, default=10)
    args = parser.parse_args()

    settings = Settings()
    with tempfile.TemporaryDirectory(prefix="tq-bench-records-") as tmp, moto(args) as s3:
        url = args.store or ("s3://bench-records" if s3 else f"file://{tmp}")
        if s3:
            store = ObjectStore.from_url(url, **s3)
        else:
            store = ObjectStore.from_settings(settings.storage, url=url)
        inline_max = settings.queue.inline_max_bytes
        narrow = results._stored
        variants = {"int32": narrow, "int64": lambda _name, arr: arr}
        times: dict[str, list[tuple]] = {name: [] for name in variants}
        tokens: dict[str, int] = dict.fromkeys(variants, 0)
        rng = np.random.default_rng(0)
        try:
            for b in range(args.batches + 1):  # batch 0 warms up (imports, first writes)
                jobs = batch(rng, args, f"b{b}")
                for name, stored in variants.items():
                    results._stored = stored
                    took = round_trip(jobs, store, inline_max)
                    if b:
                        times[name].append(took)
                        tokens[name] += sum(len(j.logprobs) for j in jobs)
        finally:
            results._stored = narrow
        report(times, tokens, args, url)
        read_side_by_side(store, args)


if __name__ == "__main__":
    main()
