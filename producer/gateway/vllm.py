"""vLLM's OpenAI-compatible dialect for scoring token ids: `POST /v1/completions`, `GET /v1/models`,
and `POST /inference/v1/generate` as prime-rl calls it.

- `/v1/completions`: `prompt` (or `prompt_token_ids`) is one list of token ids or a list of
  them (text is refused: teacherq has no tokenizer); `max_tokens` 0 or 1 (trainers send 1 to
  read prompt log-probs; no token is generated, each choice has `text: ""`); `n` 1.
  `prompt_logprobs: k` answers `choices[i].prompt_logprobs` as vLLM does: null for the first
  token, then per position `{token_id: {logprob, rank, decoded_token}}` with the actual token
  first and the k best after it. `echo: true` with `logprobs: k` answers `choices[i].logprobs`
  over the prompt (`tokens` as `token_id:<id>`, as vLLM's `return_tokens_as_token_ids`).
- `/inference/v1/generate`: `token_ids` and `sampling_params.prompt_logprobs`; answers a
  top-level `prompt_logprobs` of the same form (prime-rl reads the actual token's entry).

Log-probs are at T = 1 whatever `temperature` says (vLLM computes prompt log-probs from the
raw logits); `input_logprob_temperature` applies one. vLLM writes -inf as -9999.0, so does
this. `rank` is exact inside the top k; an actual token outside it gets k + 1 (teacherq ranks
only its top k: the true rank is at least that). `decoded_token` is null (no tokenizer).
"""

from __future__ import annotations

import time
import uuid
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

NEG_INF = -9999.0  # what vLLM writes for -inf


def routes(gw: Core) -> list[web.RouteDef]:
    """vLLM's routes."""

    async def completions(request: web.Request) -> web.StreamResponse:
        return await _completions(gw, request, await gw.body(request))

    async def generate(request: web.Request) -> web.StreamResponse:
        return await _generate(gw, request, await gw.body(request))

    async def models(_request: web.Request) -> web.StreamResponse:
        name = await model_name(gw)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": int(gw.started),
                        "owned_by": "teacherq",
                        "root": await gw.served_path(),
                        "parent": None,
                        "max_model_len": (await gw.limits()).max_input_tokens,
                    }
                ],
            }
        )

    async def health(_request: web.Request) -> web.StreamResponse:
        problem = await gw.redis_ok()
        if problem:
            raise HttpError(503, problem)
        return web.Response(status=200)

    return [
        web.post("/v1/completions", gw.route("openai", completions)),
        web.post("/inference/v1/generate", gw.route("openai", generate)),
        web.get("/v1/models", gw.route("openai", models)),
        web.get("/health", gw.route("openai", health)),
    ]


async def model_name(gw: Core) -> str:
    """The served model's name: the consumers' checkpoint path, else their model version,
    else the queue's name (any name is accepted in requests)."""
    path = await gw.served_path()
    if path:
        return path
    return (await gw.model_record()).get("version") or gw.queue


def _job(ids: list[int], k: int, temperature: float, where: str) -> TeacherRequest:
    try:
        # top_k >= 1 so the actual token's rank is known when it is the best one
        return parse_request(
            {
                "input_ids": ids,
                "top_k": max(k, 1),
                "temperature": temperature,
                "job_id": new_job_id(),
            }
        )
    except InvalidJob as exc:
        raise HttpError(400, f"{where}: {exc}") from None


def prompt_logprobs(ids: np.ndarray, res: TeacherResult, k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of one prompt: None, then per position the actual token's
    entry first and the k best tokens after it (see the module doc for `rank`)."""
    assert res.logprobs is not None and res.topk_token_ids is not None
    assert res.topk_logprobs is not None
    actual = np.where(np.isfinite(res.logprobs), res.logprobs, NEG_INF).tolist()
    top_ids = res.topk_token_ids.tolist()
    top_lps = np.where(np.isfinite(res.topk_logprobs), res.topk_logprobs, NEG_INF).tolist()
    out: list[dict[str, Any] | None] = [None]
    for row, token in enumerate(ids[1:].tolist()):
        tops = top_ids[row]
        rank = tops.index(token) + 1 if token in tops else len(tops) + 1
        entry = {str(token): {"logprob": actual[row], "rank": rank, "decoded_token": None}}
        for r, (t, lp) in enumerate(zip(tops[:k], top_lps[row][:k], strict=True)):
            entry.setdefault(str(t), {"logprob": lp, "rank": r + 1, "decoded_token": None})
        out.append(entry)
    return out


def _echo_logprobs(ids: np.ndarray, res: TeacherResult, k: int) -> dict[str, Any]:
    """The OpenAI completions `logprobs` object over the prompt (echo)."""
    assert res.logprobs is not None and res.topk_token_ids is not None
    assert res.topk_logprobs is not None
    actual = np.where(np.isfinite(res.logprobs), res.logprobs, NEG_INF).tolist()
    top_lps = np.where(np.isfinite(res.topk_logprobs), res.topk_logprobs, NEG_INF).tolist()
    tokens = [f"token_id:{t}" for t in ids.tolist()]
    top: list[dict[str, float] | None] = [None]
    for row, token in enumerate(tokens[1:]):
        entry = {token: actual[row]}
        for t, lp in zip(res.topk_token_ids[row, :k].tolist(), top_lps[row][:k], strict=True):
            entry.setdefault(f"token_id:{t}", lp)
        top.append(entry)
    return {
        "text_offset": [0] * len(tokens),
        "token_logprobs": [None, *actual],
        "tokens": tokens,
        "top_logprobs": top,
    }


def _prompts(payload: dict[str, Any]) -> list[list[int]]:
    raw = payload.get("prompt", payload.get("prompt_token_ids"))
    if raw is None:
        raise HttpError(400, "missing prompt: send token ids (prompt or prompt_token_ids)")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], str)):
        raise HttpError(400, "prompt must be token ids: teacherq has no tokenizer, text is refused")
    if isinstance(raw, list) and raw and isinstance(raw[0], list):
        return [token_ids(p, f"prompt[{i}]") for i, p in enumerate(raw)]
    return [token_ids(raw, "prompt")]


def _scoring_only(value: Any, name: str) -> None:
    n = int_field(value, name, default=0, low=0)
    if n > 1:
        raise HttpError(
            400, f"{name} is {n}; teacherq only scores the prompt (send {name}: 0 or 1)"
        )


async def _completions(gw: Core, request: web.Request, payload: dict[str, Any]) -> web.Response:
    prompts = _prompts(payload)
    _scoring_only(payload.get("max_tokens"), "max_tokens")
    if int_field(payload.get("n"), "n", default=1, low=1) != 1:
        raise HttpError(400, "n must be 1: teacherq generates nothing")
    if payload.get("stream"):
        raise HttpError(400, "stream is not supported: the answer comes whole")
    k = int_field(payload.get("prompt_logprobs"), "prompt_logprobs", default=-1, low=0)
    echo = bool(payload.get("echo"))
    n_top = int_field(payload.get("logprobs"), "logprobs", default=-1, low=0)
    temperature = input_temperature(payload)
    reqs = [
        _job(ids, max(k, n_top if echo else 0), temperature, f"prompt[{i}]")
        for i, ids in enumerate(prompts)
    ]
    results = await gw.score(
        request,
        reqs,
        span_name="vllm.completions",
        timeout_s=positive(payload.get("timeout_s"), "timeout_s"),
    )
    choices = []
    total = 0
    with gc_paused():
        for i, (req, res) in enumerate(zip(reqs, results, strict=True)):
            total += req.num_tokens
            choices.append(_choice(i, req, res, payload, k, n_top, echo))
    return gw.respond(
        request,
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": payload.get("model") or await model_name(gw),
            "choices": choices,
            "usage": {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total},
        },
    )


def _choice(
    i: int,
    req: TeacherRequest,
    res: TeacherResult,
    payload: dict[str, Any],
    k: int,
    n_top: int,
    echo: bool,
) -> dict[str, Any]:
    """One choice of a completions answer."""
    choice: dict[str, Any] = {
        "index": i,
        "text": "",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "prompt_logprobs": prompt_logprobs(req.input_ids, res, k) if k >= 0 else None,
    }
    if n_top >= 0:
        choice["logprobs"] = (
            _echo_logprobs(req.input_ids, res, n_top)
            if echo
            else {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        )
    if payload.get("return_token_ids"):
        choice.update(prompt_token_ids=req.input_ids.tolist(), token_ids=[])
    return choice


async def _generate(gw: Core, request: web.Request, payload: dict[str, Any]) -> web.Response:
    ids = token_ids(payload.get("token_ids"), "token_ids")
    params = payload.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise HttpError(400, "sampling_params must be a JSON object")
    _scoring_only(params.get("max_tokens"), "sampling_params.max_tokens")
    k = int_field(
        params.get("prompt_logprobs"), "sampling_params.prompt_logprobs", default=-1, low=0
    )
    temperature = input_temperature(payload, params)
    req = _job(ids, k, temperature, "token_ids")
    [res] = await gw.score(
        request,
        [req],
        span_name="vllm.generate",
        timeout_s=positive(payload.get("timeout_s"), "timeout_s"),
    )
    with gc_paused():
        plp = prompt_logprobs(req.input_ids, res, k) if k >= 0 else None
    return gw.respond(
        request,
        {
            "request_id": payload.get("request_id") or req.job_id,
            "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "token_ids": []}],
            "prompt_logprobs": plp,
            "kv_transfer_params": None,
        },
    )
