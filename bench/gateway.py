"""The HTTP gateway against the same jobs through AsyncTeacherClient directly, side by side.

One real consumer (the tiny preset, or TEACHERQ_MODEL__PATH) and one real `teacherq serve`
process on a throwaway valkey-server. For each workload the same requests go, in alternating
rounds, (a) straight through one AsyncTeacherClient (`submit` + `wait` per request) and (b)
through the gateway over HTTP/1.1 keep-alive (aiohttp client), both with `--concurrency`
requests in flight. Printed per workload and path: requests/s, latency p50 / p99, and the
gateway's added latency and share of the direct client's requests/s. Workloads:

    small-json    16-token inputs, slime /generate (JSON log-probs)
    4k-json       4,096-token inputs, top-64, SGLang /generate (nested JSON top-logprobs)
    4k-binary     4,096-token inputs, top-64, TRL /get_sequence_logprobs/ binary (base64)

Last, the JSON encoding of one 4k-token top-64 answer alone: stdlib json vs orjson.

    .venv/bin/python bench/gateway.py                       # CPU dev box
    .venv/bin/python bench/gateway.py --requests 64 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_common import child_env  # noqa: E402 - repo on path
from producer.aio import AsyncTeacherClient  # noqa: E402 - repo on path
from shared.messages import TeacherRequest  # noqa: E402 - repo on path
from shared.settings import Settings  # noqa: E402 - repo on path
from tests.conftest import wait_for_consumers  # noqa: E402 - repo on path
from tests.gateway import launch_gateway  # noqa: E402 - repo on path
from tests.processes import Valkey, stop_all  # noqa: E402 - repo on path

WORKLOADS = {
    "small-json": (16, 0),
    "4k-json": (4096, 64),
    "4k-binary": (4096, 64),
}


def _inputs(n: int, length: int, rng: np.random.Generator) -> list[list[int]]:
    return [rng.integers(1, 999, size=length).tolist() for _ in range(n)]


def _http_body(workload: str, ids: list[int], k: int) -> tuple[str, dict[str, Any]]:
    if workload == "small-json":
        return "/generate", {"input_ids": ids}
    if workload == "4k-json":
        return "/generate", {
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": k,
            "sampling_params": {"max_new_tokens": 0},
        }
    return "/get_sequence_logprobs/", {
        "sequences": [ids],
        "prompt_lengths": [1],
        "top_logprobs": k,
        "response_format": "binary",
    }


async def _direct(
    client: AsyncTeacherClient, inputs: list[list[int]], k: int, conc: int
) -> list[float]:
    sem = asyncio.Semaphore(conc)

    async def one(ids: list[int]) -> float:
        async with sem:
            t0 = time.perf_counter()
            req = TeacherRequest(input_ids=ids, top_k=k, job_id=f"b-{uuid.uuid4().hex}")
            [res] = await client.wait(await client.submit([req]), timeout=600)
            assert res.ok, res.error
            return time.perf_counter() - t0

    return list(await asyncio.gather(*(one(i) for i in inputs)))


async def _gateway(
    session: aiohttp.ClientSession,
    url: str,
    workload: str,
    inputs: list[list[int]],
    k: int,
    conc: int,
) -> list[float]:
    sem = asyncio.Semaphore(conc)

    async def one(ids: list[int]) -> float:
        path, body = _http_body(workload, ids, k)
        async with sem:
            t0 = time.perf_counter()
            async with session.post(url + path, json=body) as resp:
                data = await resp.read()
                assert resp.status == 200, data[:300]
                orjson.loads(data)  # a client reads its answer
            return time.perf_counter() - t0

    return list(await asyncio.gather(*(one(i) for i in inputs)))


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1000, q))


async def _run(args: argparse.Namespace, settings: Settings, url: str) -> None:
    rng = np.random.default_rng(0)
    client = AsyncTeacherClient(settings)  # records its submit spans, as the gateway's does
    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=900)
    ) as session:
        # warm both paths (connections, the consumer's first shapes)
        await _direct(client, _inputs(4, 16, rng), 0, 4)
        await _gateway(session, url, "small-json", _inputs(4, 16, rng), 0, 4)
        print(
            f"{'workload':<12} {'path':<8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}"
            f"  {'1-in-flight p50':>15} {'p99':>7}"
        )
        for workload in args.workloads:
            big = WORKLOADS[workload][0] >= 1000
            n = max(args.requests // 8, 8) if big else args.requests
            lat: dict[str, list[float]] = {"direct": [], "gateway": []}
            solo: dict[str, list[float]] = {"direct": [], "gateway": []}
            wall = {"direct": 0.0, "gateway": 0.0}

            async def batch(
                path: str, count: int, conc: int, workload: str = workload
            ) -> list[float]:
                length, k = WORKLOADS[workload]
                inputs = _inputs(count, length, rng)  # never repeated: no cached result
                if path == "direct":
                    return await _direct(client, inputs, k, conc)
                return await _gateway(session, url, workload, inputs, k, conc)

            for _ in range(args.rounds):  # alternate, so drift in machine load hits both
                for path in ("direct", "gateway"):
                    t0 = time.perf_counter()
                    lat[path] += await batch(path, n, args.concurrency)
                    wall[path] += time.perf_counter() - t0
            # One request in flight, the paths alternating request by request: both sample
            # the same consumer (its batch cycle makes single-request latency bimodal).
            for _ in range(args.solo // 8 if big else args.solo):
                for path in ("direct", "gateway"):
                    solo[path] += await batch(path, 1, 1)
            rps = {p: len(lat[p]) / wall[p] for p in lat}
            for p in ("direct", "gateway"):
                print(
                    f"{workload:<12} {p:<8} {rps[p]:8.1f} {_pct(lat[p], 50):8.1f} "
                    f"{_pct(lat[p], 99):8.1f}  {_pct(solo[p], 50):15.1f} {_pct(solo[p], 99):7.1f}"
                )
            share = rps["gateway"] / rps["direct"]
            added50 = _pct(solo["gateway"], 50) - _pct(solo["direct"], 50)
            added99 = _pct(solo["gateway"], 99) - _pct(solo["direct"], 99)
            print(
                f"{workload:<12} ratio    gateway/direct req/s {share:.2f}; added latency "
                f"(1 in flight) p50 {added50:+.1f} ms, p99 {added99:+.1f} ms"
            )
    await client.aclose()


def _encode_bench() -> None:
    """JSON encoding of one 4k-token top-64 SGLang answer: stdlib json vs orjson."""
    rng = np.random.default_rng(1)
    vals = rng.standard_normal((4095, 64)).astype(np.float32)
    idx = rng.integers(0, 150_000, size=(4095, 64))
    rows = [None] + [
        [[v, i, None] for v, i in zip(vr, ir, strict=True)]
        for vr, ir in zip(vals.tolist(), idx.tolist(), strict=True)
    ]
    body = {"meta_info": {"input_top_logprobs": rows}}
    for name, fn in (
        ("json", lambda: json.dumps(body).encode()),
        ("orjson", lambda: orjson.dumps(body)),
    ):
        t0 = time.perf_counter()
        for _ in range(3):
            size = len(fn())
        ms = (time.perf_counter() - t0) / 3 * 1000
        print(f"encode 4k x top-64 answer  {name:<7} {ms:7.1f} ms  {size / 1e6:.1f} MB")


def main() -> None:
    """Start the services, run the workloads, print the table."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=256, help="small requests per round and path")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--solo", type=int, default=64, help="single requests per path (small)")
    ap.add_argument("--coalesce-ms", type=float, default=None, help="gateway.coalesce_ms")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="teacherq-bench-gateway-"))
    (tmp / "valkey").mkdir()
    valkey = Valkey(tmp / "valkey")
    settings = Settings(
        redis={"url": valkey.url, "home": str(tmp / "home")},
        queue={"name": "bench"},
        storage={"url": f"file://{tmp / 'objects'}"},
        consumer={"block_ms": 50, "batch_max_jobs": 256},
        gateway={} if args.coalesce_ms is None else {"coalesce_ms": args.coalesce_ms},
        log={"format": "json", "level": "warning"},
    )
    env = child_env(settings)
    log = open(tmp / "consumer.log", "w")  # noqa: SIM115 - kept open for the process
    consumer = subprocess.Popen(
        [sys.executable, "-m", "consumer"], env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT
    )
    consumer.log_path = tmp / "consumer.log"  # type: ignore[attr-defined]
    procs = [consumer]
    try:
        wait_for_consumers(settings, count=1, proc=consumer)
        gateway, http = launch_gateway(settings, tmp / "gateway.log", cwd=tmp)
        procs.append(gateway)
        print(f"# concurrency {args.concurrency}, {args.rounds} rounds, port {http.port}")
        asyncio.run(_run(args, settings, f"http://127.0.0.1:{http.port}"))
        _encode_bench()
    finally:
        stop_all(procs)
        valkey.stop()


if __name__ == "__main__":
    main()
