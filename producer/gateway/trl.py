"""TRL's `trl vllm-serve` dialect for distillation: `POST /get_sequence_logprobs/`, `GET /health/`.

A request carries `sequences` (prompt + completion token ids), `prompt_lengths`,
`top_logprobs` (at most the queue's top-k limit) and `response_format`:

- `json`: `logprobs` / `logprob_token_ids`, per sequence one row per completion position
  (positions prompt_length..L-1): the top tokens by rank, and the actual token after them when
  it is not among them (as vLLM includes it); an empty row for position 0.
- `binary`: base64 of little-endian arrays `logprobs_b64` (float32) and `token_ids_b64`
  (int32) of `shape` [batch, longest completion, top_logprobs], padded with -inf / 0;
  `actual_logprobs_b64` / `actual_token_ids_b64` of [batch, longest completion, 1]; and
  `completion_lengths`.

Log-probs are at T = 1 whatever `temperature` says, as vLLM computes prompt log-probs;
`input_logprob_temperature` applies one.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from aiohttp import web

from producer.gateway.common import (
    HttpError,
    gc_paused,
    input_temperature,
    int_field,
    positive,
    token_ids,
)
from producer.gateway.core import Core, new_job_id
from shared.errors import InvalidJob
from shared.messages import TeacherRequest, TeacherResult, parse_request


def routes(gw: Core) -> list[web.RouteDef]:
    """TRL's routes."""

    async def sequence_logprobs(request: web.Request) -> web.StreamResponse:
        return await _sequence_logprobs(gw, request, await gw.body(request))

    async def health(_request: web.Request) -> web.StreamResponse:
        problem = await gw.redis_ok()
        if problem:
            raise HttpError(503, problem)
        return web.json_response({"status": "ok"})

    return [
        web.post("/get_sequence_logprobs/", gw.route("trl", sequence_logprobs)),
        web.get("/health/", gw.route("trl", health)),
    ]


async def _sequence_logprobs(
    gw: Core, request: web.Request, payload: dict[str, Any]
) -> web.Response:
    seqs = payload.get("sequences")
    lengths = payload.get("prompt_lengths")
    if not isinstance(seqs, list) or not isinstance(lengths, list):
        raise HttpError(400, "sequences and prompt_lengths must be lists")
    if len(seqs) != len(lengths):
        raise HttpError(400, "sequences and prompt_lengths must have the same length")
    limit = (await gw.limits()).max_top_k
    k = int_field(payload.get("top_logprobs"), "top_logprobs", default=100, low=1, high=limit)
    fmt = payload.get("response_format", "json")
    if fmt not in ("json", "binary"):
        raise HttpError(400, f"response_format must be 'json' or 'binary', got {fmt!r}")
    temperature = input_temperature(payload)
    reqs: list[TeacherRequest] = []
    for i, (seq, pl) in enumerate(zip(seqs, lengths, strict=True)):
        ids = token_ids(seq, f"sequences[{i}]")
        pl = int_field(pl, f"prompt_lengths[{i}]", default=0, low=0, high=len(ids))
        try:
            reqs.append(
                parse_request(
                    {
                        "input_ids": ids,
                        "top_k": k,
                        "temperature": temperature,
                        "job_id": new_job_id(),
                    }
                )
            )
        except InvalidJob as exc:
            raise HttpError(400, f"sequences[{i}]: {exc}") from None
    results = await gw.score(
        request,
        reqs,
        span_name="trl.sequence_logprobs",
        timeout_s=positive(payload.get("timeout_s"), "timeout_s"),
    )
    if fmt == "binary":
        return gw.respond(request, _binary(reqs, lengths, results, k))
    with gc_paused():
        body = _json(reqs, lengths, results)
    return gw.respond(request, body)


def _json(
    reqs: list[TeacherRequest], lengths: list[int], results: list[TeacherResult]
) -> dict[str, Any]:
    all_lps, all_ids = [], []
    for req, pl, res in zip(reqs, lengths, results, strict=True):
        assert res.logprobs is not None and res.topk_token_ids is not None
        assert res.topk_logprobs is not None
        ids = req.input_ids.tolist()
        actual = res.logprobs.tolist()
        top_ids, top_lps = res.topk_token_ids.tolist(), res.topk_logprobs.tolist()
        seq_lps: list[list[float | None]] = []
        seq_ids: list[list[int]] = []
        for pos in range(pl, len(ids)):
            if pos == 0:  # nothing predicts the first token
                seq_lps.append([])
                seq_ids.append([])
                continue
            row_ids, row_lps = list(top_ids[pos - 1]), list(top_lps[pos - 1])
            if ids[pos] not in row_ids:  # vLLM includes the actual token, ranked after
                row_ids.append(ids[pos])
                row_lps.append(actual[pos - 1])
            seq_ids.append(row_ids)
            seq_lps.append(row_lps)
        all_lps.append(seq_lps)
        all_ids.append(seq_ids)
    return {"logprobs": all_lps, "logprob_token_ids": all_ids}


def _binary(
    reqs: list[TeacherRequest], lengths: list[int], results: list[TeacherResult], k: int
) -> dict[str, Any]:
    comp = [req.num_tokens - pl for req, pl in zip(reqs, lengths, strict=True)]
    width = max(comp, default=0)
    b = len(reqs)
    lps = np.full((b, width, k), -np.inf, dtype="<f4")
    ids = np.zeros((b, width, k), dtype="<i4")
    act_lps = np.full((b, width, 1), -np.inf, dtype="<f4")
    act_ids = np.zeros((b, width, 1), dtype="<i4")
    for i, (req, pl, res) in enumerate(zip(reqs, lengths, results, strict=True)):
        assert res.logprobs is not None and res.topk_token_ids is not None
        assert res.topk_logprobs is not None
        first = max(pl, 1)  # position 0 has no log-prob: its row stays padding
        t0, rows = first - pl, slice(first - 1, req.num_tokens - 1)
        n = req.num_tokens - first
        lps[i, t0 : t0 + n] = res.topk_logprobs[rows, :k]
        ids[i, t0 : t0 + n] = res.topk_token_ids[rows, :k]
        act_lps[i, t0 : t0 + n, 0] = res.logprobs[rows]
        act_ids[i, t0 : t0 + n, 0] = req.input_ids[first:]
    return {
        "logprobs_b64": _b64(lps),
        "token_ids_b64": _b64(ids),
        "actual_logprobs_b64": _b64(act_lps),
        "actual_token_ids_b64": _b64(act_ids),
        "shape": [b, width, k],
        "completion_lengths": comp,
    }


def _b64(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")
