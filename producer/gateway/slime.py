"""slime's Megatron teacher-server dialect (its megatron_utils/server/megatron_server.py).

`POST /generate` (label-token log-probs, per-position samples), `POST
/update_weights_from_disk`, `GET /get_loads`, `/healthz`, `/info`. Fields keep slime's names
and its coercions: `sample_n` goes through `int()` (so `"3"` is 3 and 2.5 is 2; booleans are
refused), label ids too (`"5"` is 5). Outputs use the server-wide `gateway.temperature`
(slime's `--rollout-temperature`) unless a request names its own `temperature`.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from aiohttp import web

from producer.gateway.common import HttpError, positive
from producer.gateway.core import Core, new_job_id
from shared import weights
from shared.errors import InvalidCheckpoint, InvalidJob, WeightUpdateFailed
from shared.messages import OPTION_FIELDS, TeacherRequest, TeacherResult, parse_request

# teacherq's own /generate fields, accepted beside slime's: every request option (sample_n is
# slime's too, coerced its way below), the job id and metadata.
OWN_FIELDS = (*(f for f in OPTION_FIELDS if f != "sample_n"), "job_id", "metadata")


def routes(gw: Core) -> list[web.RouteDef]:
    """slime's routes besides `/generate` (shared with SGLang's dialect: generate.py)."""

    async def update(request: web.Request) -> web.StreamResponse:
        return web.json_response(await update_weights(gw, await gw.body(request, empty_ok=True)))

    async def loads(_request: web.Request) -> web.StreamResponse:
        return web.json_response(await get_loads(gw))

    async def healthz(_request: web.Request) -> web.StreamResponse:
        problem = await gw.redis_ok()
        if problem:
            return web.json_response({"ok": False, "error": problem}, status=503)
        return web.json_response({"ok": True, "consumers_ready": await gw.consumers_ready()})

    async def info(_request: web.Request) -> web.StreamResponse:
        return web.json_response(await get_info(gw))

    return [
        web.post("/update_weights_from_disk", gw.route("slime", update)),
        web.get("/get_loads", gw.route("slime", loads)),
        web.get("/healthz", gw.route("slime", healthz)),
        web.get("/info", gw.route("slime", info)),
    ]


# -- /generate ----------------------------------------------------------------------------------


async def generate(gw: Core, request: web.Request, payload: dict[str, Any]) -> web.Response:
    """One job for a slime `/generate` payload; slime's response fields (L-1 rows)."""
    req, own_id, width = await _request(gw, payload)
    [res] = await gw.score(
        request,
        [req],
        span_name="generate",
        timeout_s=positive(payload.get("timeout_s"), "timeout_s"),
        own_ids=frozenset([req.job_id or ""]) if own_id else frozenset(),
    )
    out = _response(req.job_id or "", res, req.num_tokens - 1)
    if width == 0:  # zero-width labels: slime answers one empty row per position
        out["label_token_log_probs"] = [[] for _ in range(req.num_tokens - 1)]
    return gw.respond(request, out)


async def _request(gw: Core, payload: dict[str, Any]) -> tuple[TeacherRequest, bool, int]:
    """The queue request for a payload, whether the caller named the job id, and the label
    width (-1: no labels)."""
    if "input_ids" not in payload:
        raise HttpError(400, "missing input_ids")
    ids = payload["input_ids"]
    if not isinstance(ids, list):
        raise HttpError(400, "input_ids must be a list of token ids")
    limit = (await gw.limits()).max_input_tokens
    if gw.g.max_length:
        limit = min(limit, gw.g.max_length)
    if len(ids) > limit:
        raise HttpError(
            413,
            f"input_ids length {len(ids)} exceeds configured maximum {limit}",
            input_length=len(ids),
            max_length=limit,
        )
    labels = _labels(payload.get("label_token_ids"), len(ids) - 1)
    width = -1 if labels is None else (len(labels[0]) if labels else 0)
    fields: dict[str, Any] = {
        "input_ids": ids,
        "label_token_ids": labels if width > 0 else None,
        "sample_n": sample_n(payload.get("sample_n", 0)),
        "temperature": gw.g.temperature,
    }
    fields.update({k: payload[k] for k in OWN_FIELDS if payload.get(k) is not None})
    own_id = "job_id" in fields
    fields.setdefault("job_id", new_job_id())
    try:
        return parse_request(fields), own_id, width
    except InvalidJob as exc:
        raise HttpError(400, str(exc)) from None


def sample_n(value: Any) -> int:
    """slime's rule (`_parse_sample_n`): `int(value)`, >= 0, booleans refused; so a numeric
    string counts and a float is truncated (2.5 is 2)."""
    if value is None:
        return 0
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise HttpError(400, "sample_n must be an integer >= 0")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise HttpError(400, "sample_n must be an integer >= 0") from None
    if n < 0:
        raise HttpError(400, "sample_n must be >= 0")
    return n


def _labels(value: Any, rows: int) -> list[list[int]] | None:
    """slime's `_normalize_label_token_ids`: a [L-1][W] list of lists of one width, each id
    through `int()` (numeric strings count); W may be 0."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        raise HttpError(400, "label_token_ids must be a 2D list with shape [len(input_ids) - 1, W]")
    if len(value) != rows:
        raise HttpError(
            400,
            f"label_token_ids has {len(value)} rows; expected len(input_ids) - 1 = {rows} "
            "(row j labels position j + 1)",
        )
    widths = {len(row) for row in value}
    if len(widths) > 1:
        raise HttpError(
            400, f"label_token_ids rows are ragged (widths {sorted(widths)}); expected one W"
        )
    try:
        return [[_label_id(t) for t in row] for row in value]
    except (TypeError, ValueError, OverflowError):
        raise HttpError(400, "label_token_ids must contain integers") from None


def _label_id(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("a boolean is not a token id")
    return int(value)


def _response(job_id: str, res: TeacherResult, rows: int) -> dict[str, Any]:
    """slime's response fields (cropped to L-1 rows), then teacherq's own."""

    def rows_of(arr: Any) -> Any:
        return None if arr is None else arr[:rows]

    out: dict[str, Any] = {"request_id": job_id, "log_probs": rows_of(res.logprobs)}
    for ours, theirs in (
        ("label_logprobs", "label_token_log_probs"),
        ("sampled_token_ids", "sampled_token_ids"),
        ("sampled_logprobs", "sampled_log_probs"),
        ("topk_token_ids", "topk_token_ids"),
        ("topk_logprobs", "topk_logprobs"),
        ("topk_rest_logprob", "topk_rest_logprob"),
        ("entropy", "entropy"),
    ):
        value = getattr(res, ours)
        if value is not None:
            out[theirs] = rows_of(value)
    out.update(model_version=res.model_version, model_generation=res.model_generation)
    return out


# -- /update_weights_from_disk ------------------------------------------------------------------


async def update_weights(gw: Core, payload: dict[str, Any]) -> dict[str, Any]:
    """slime's semantics on the queue's weight-update path: a path every consumer already
    serves is skipped, the same path in progress coalesces, another path in progress is
    refused (409). "Already serves": the last update, to that path, is done (every live
    consumer loaded it; their heartbeats can say so a beat later), or the heartbeats say so."""
    raw = payload.get("model_path") or payload.get("path") or payload.get("load")
    if not raw:
        raise HttpError(400, "missing model_path")
    path = str(raw)
    state = await gw.weights_state()
    loaded = state.state == "done" and state.path == path
    if loaded or (state.state != "updating" and await gw.served_paths() == {path}):
        return {"ok": True, "model_path": path, "skipped": True}
    timeout = positive(payload.get("timeout_s"), "timeout_s") or gw.g.update_timeout_s
    check = payload.get("check", True)
    if not isinstance(check, bool):
        raise HttpError(400, "check must be true or false")
    before = await get_loads(gw)
    try:
        if state.state == "updating" and state.path == path:
            # The same path in progress: join that generation. Asking the queue again could
            # start a second, redundant update if this one finished in the meantime.
            req = await asyncio.to_thread(join_update, gw, state, timeout)
        else:
            req = await asyncio.to_thread(
                gw.client.update_weights, path, wait=True, timeout=timeout, check=check
            )
    except InvalidCheckpoint as exc:
        raise HttpError(400, str(exc)) from None
    except weights.UpdateInProgress as exc:
        raise HttpError(409, str(exc)) from None
    except WeightUpdateFailed as exc:
        raise HttpError(500, str(exc), generation=exc.generation) from None
    except TimeoutError as exc:
        raise HttpError(503, str(exc)) from None
    out: dict[str, Any] = {
        "ok": True,
        "model_path": path,
        "before_loads": before,
        "after_loads": await get_loads(gw),
        "update_result": {"generation": req.generation, "request_id": req.request_id},
    }
    if req.coalesced:
        out["coalesced"] = True
    return out


def join_update(gw: Core, running: weights.Served, timeout: float) -> weights.UpdateRequest:
    """Wait for the `running` update's generation (raising as `update_weights` does)."""
    weights.wait_done(gw.client.r, gw.client.queue, running.generation, timeout_s=timeout)
    return weights.UpdateRequest(
        request_id=running.request_id or "", generation=running.generation, coalesced=True
    )


# -- GET endpoints ------------------------------------------------------------------------------


async def get_loads(gw: Core) -> dict[str, Any]:
    """slime's load figures, from the queue's status snapshot (plus teacherq's own)."""
    snap = await asyncio.to_thread(gw.client.status)
    alive = {n: c for n, c in snap["consumers"].items() if c["alive"]}
    tp = snap["throughput"]
    return {
        "queue_size": snap["queued"],
        "inflight_size": snap["in_flight"],
        "pending_tokens": snap["pending_tokens"],
        "running_by_worker": {n: c["entries"] for n, c in snap["in_flight_by_consumer"].items()},
        "total_finished_reqs": snap["results_announced"],
        # Tokens scored by every consumer on record (their heartbeat counters).
        "total_finished_tokens": sum(int(c.get("tokens") or 0) for c in snap["consumers"].values()),
        "queue": snap["queue"],
        "dead_letters": snap["dead_letters"],
        "consumers": len(alive),
        "consumers_ready": sum(c.get("state") in ("ready", "busy") for c in alive.values()),
        "jobs_per_s": tp["jobs_per_s"],
        "tokens_per_s": tp["tokens_per_s"],
        # The shard's replicas, and result writes waiting for (or going without) their acks.
        "replication": snap["replication"],
        # This gateway's submit calls and the jobs they carried (coalescing at work).
        "gateway_submits": gw.jobs.submits if gw.jobs else 0,
        "gateway_jobs": gw.jobs.submitted if gw.jobs else 0,
    }


async def get_info(gw: Core) -> dict[str, Any]:
    """What is served (by the consumers, not the gateway's own settings) and how the gateway
    is set (no secrets)."""
    from importlib.metadata import PackageNotFoundError, version

    served = await gw.weights_state()
    model = await gw.model_record()
    try:
        ours = version("teacherq")
    except PackageNotFoundError:
        ours = "unknown"
    load = await gw.served_path()
    args = {
        "load": load,
        "rollout_temperature": gw.g.temperature,
        "megatron_server_max_length": gw.g.max_length,
        "max_input_tokens": gw.settings.queue.max_input_tokens,
        "queue": gw.queue,
    }
    return {
        "args": args,
        "server_type": "teacherq",
        "version": ours,
        "model": {
            "path": load,
            "version": model.get("version") or None,
            "vocab_size": int(model["vocab_size"]) if model.get("vocab_size") else None,
            "generation": served.generation,
            "update_state": served.state,
        },
    }
