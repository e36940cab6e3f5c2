"""SGLang's native dialect: `POST /generate` with `return_logprob` (input log-probs of token ids),
`GET /health_generate`, `GET /get_model_info`.

teacherq scores and never generates: `max_new_tokens` must be 0 (or absent), answers carry
`text: ""` and `output_ids: []`. Input log-probs follow SGLang's layout (entries are
`[logprob, token_id, text]`, text always null: teacherq has no tokenizer):

- `logprob_start_len` s (default -1, which SGLang reads as L-1) selects positions s..L-1;
  entry 0 is always `[null, input_ids[s], null]`, entry i > 0 scores `input_ids[s + i]`
  given the tokens before it. slime's OPD client sends s = 0 and reads entries `[1:]`.
- `input_top_logprobs` / `input_token_ids_logprobs`: null at entry 0, then per position the
  `top_logprobs_num` best tokens (or the `token_ids_logprob` ids) as `[logprob, id, null]`.
- `return_flat_raw_top_logprobs` replaces `input_top_logprobs` by `input_top_logprobs_shape`
  `[rows, k]`, `input_top_logprobs_null_prefix` (1), and the rows after the prefix as flat
  `input_top_logprobs_val_flat` / `_idx_flat` lists, or with `return_flat_raw_top_logprobs_b64`
  as base64 little-endian float32 / int32 (`..._flat_b64`, `..._flat_b64_dtype`).

Log-probs are at T = 1 whatever `sampling_params.temperature` says, as SGLang computes input
log-probs; `input_logprob_temperature` applies one and is echoed in `meta_info`.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from producer.gateway.common import (
    HttpError,
    error_body,
    gc_paused,
    input_temperature,
    int_field,
    json_response,
    positive,
    token_ids,
)
from producer.gateway.core import Core, new_job_id
from shared.errors import InvalidJob
from shared.messages import TeacherRequest, TeacherResult, parse_request


def routes(gw: Core) -> list[web.RouteDef]:
    """SGLang's health and model-info routes (`/generate`, shared with slime: generate.py)."""

    async def health_generate(_request: web.Request) -> web.StreamResponse:
        problem = await gw.redis_ok()
        if problem or not await gw.consumers_ready():
            raise HttpError(503, problem or "no consumer of the queue is ready")
        return web.Response(status=200)

    async def model_info(_request: web.Request) -> web.StreamResponse:
        model = await gw.model_record()
        path = await gw.served_path()
        return web.json_response(
            {
                "model_path": path,
                "tokenizer_path": None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": model.get("version") or None,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": None,
                "vocab_size": int(model["vocab_size"]) if model.get("vocab_size") else None,
                "max_input_tokens": (await gw.limits()).max_input_tokens,
            }
        )

    return [
        web.get("/health_generate", gw.route("sglang", health_generate)),
        web.get("/get_model_info", gw.route("sglang", model_info)),
    ]


async def generate(gw: Core, request: web.Request, payload: dict[str, Any]) -> web.Response:
    """Answer one SGLang `/generate` request (one or a batch of `input_ids`)."""
    try:
        return await _generate(gw, request, payload)
    except HttpError as exc:  # errors in SGLang's shape, whoever raised them
        return json_response(
            error_body("sglang", exc.status, exc.message, exc.extra), status=exc.status
        )


async def _generate(gw: Core, request: web.Request, payload: dict[str, Any]) -> web.Response:
    if payload.get("text") is not None or payload.get("input_ids") is None:
        raise HttpError(
            400, "send input_ids (token ids): teacherq has no tokenizer, so text is not accepted"
        )
    raw_ids = payload["input_ids"]
    batch = isinstance(raw_ids, list) and bool(raw_ids) and isinstance(raw_ids[0], list)
    prompts = raw_ids if batch else [raw_ids]
    items = [_item(payload, i, p, batch) for i, p in enumerate(prompts)]
    started = time.time()
    results = await gw.score(
        request,
        [it.request for it in items],
        span_name="sglang.generate",
        timeout_s=positive(payload.get("timeout_s"), "timeout_s"),
    )
    latency = time.time() - started
    with gc_paused():
        out = [it.answer(res, latency) for it, res in zip(items, results, strict=True)]
    return gw.respond(request, out if batch else out[0])


def _per_item(payload: dict[str, Any], name: str, i: int, batch: bool) -> Any:
    """A field that a batch may give once for all or as one value per item (SGLang's rule)."""
    value = payload.get(name)
    if batch and isinstance(value, list) and name != "token_ids_logprob":
        return value[i] if i < len(value) else None
    if batch and name == "token_ids_logprob" and value and isinstance(value[0], list):
        return value[i]
    return value


@dataclass(frozen=True)
class _Item:
    """One prompt of a request: its queue job and how to answer it."""

    request: TeacherRequest
    rid: str
    start: int  # logprob_start_len, resolved
    top_n: int
    label_ids: list[int] | None
    flat: bool
    flat_b64: bool
    temperature: float
    return_logprob: bool

    def answer(self, res: TeacherResult, latency: float) -> dict[str, Any]:
        ids = self.request.input_ids
        n = len(ids)
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": n,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": res.model_version,
            "e2e_latency": latency,
            "input_logprob_temperature": self.temperature,
        }
        if self.return_logprob:
            meta.update(self._logprobs(res))
        return {"text": "", "output_ids": [], "meta_info": meta}

    def _logprobs(self, res: TeacherResult) -> dict[str, Any]:
        s = self.start
        ids = self.request.input_ids
        assert res.logprobs is not None
        lps = res.logprobs[s:].tolist()  # row j scores position j + 1
        out: dict[str, Any] = {
            "input_token_logprobs": [[None, int(ids[s]), None]]
            + [[lp, int(t), None] for lp, t in zip(lps, ids[s + 1 :].tolist(), strict=True)],
            "output_token_logprobs": [],
        }
        if self.top_n:
            assert res.topk_logprobs is not None and res.topk_token_ids is not None
            n = self.top_n
            vals, idx = res.topk_logprobs[s:, :n], res.topk_token_ids[s:, :n]
            out["output_top_logprobs"] = []
            if self.flat:
                out.update(_flat(vals, idx, self.flat_b64))
            else:
                out["input_top_logprobs"] = [None] + _triples(vals, idx)
        if self.label_ids is not None:
            assert res.label_logprobs is not None
            labels = np.broadcast_to(np.asarray(self.label_ids), res.label_logprobs[s:].shape)
            out["input_token_ids_logprobs"] = [None] + _triples(res.label_logprobs[s:], labels)
            out["output_token_ids_logprobs"] = []
        return out


def _triples(vals: np.ndarray, idx: np.ndarray) -> list[list[list[Any]]]:
    return [
        [[v, i, None] for v, i in zip(vrow, irow, strict=True)]
        for vrow, irow in zip(vals.tolist(), idx.tolist(), strict=True)
    ]


def _flat(vals: np.ndarray, idx: np.ndarray, b64: bool) -> dict[str, Any]:
    """SGLang's flat top-logprob fields: entry 0 (null) is the prefix, then rows x k."""
    rows, k = vals.shape[0] + 1, vals.shape[1]
    out: dict[str, Any] = {
        "input_top_logprobs_shape": [rows, k],
        "input_top_logprobs_null_prefix": 1,
    }
    if b64:
        v = np.ascontiguousarray(vals, dtype="<f4").tobytes()
        i = np.ascontiguousarray(idx, dtype="<i4").tobytes()
        out.update(
            input_top_logprobs_val_flat_b64=base64.b64encode(v).decode("ascii"),
            input_top_logprobs_idx_flat_b64=base64.b64encode(i).decode("ascii"),
            input_top_logprobs_val_flat_b64_dtype="float32",
            input_top_logprobs_idx_flat_b64_dtype="int32",
        )
    else:
        out.update(
            input_top_logprobs_val_flat=vals.reshape(-1),
            input_top_logprobs_idx_flat=idx.reshape(-1),
        )
    return out


def _item(payload: dict[str, Any], i: int, ids: Any, batch: bool) -> _Item:
    where = f"input_ids[{i}]" if batch else "input_ids"
    ids = token_ids(ids, where)
    n = len(ids)
    params = _per_item(payload, "sampling_params", i, batch) or {}
    if not isinstance(params, dict):
        raise HttpError(400, "sampling_params must be a JSON object")
    max_new = int_field(params.get("max_new_tokens"), "sampling_params.max_new_tokens", default=0)
    if max_new != 0:
        raise HttpError(
            400,
            f"sampling_params.max_new_tokens is {max_new}; teacherq only scores the input "
            "(send max_new_tokens: 0)",
        )
    if payload.get("return_text_in_logprobs"):
        raise HttpError(
            400, "return_text_in_logprobs is not supported: teacherq has no tokenizer (send false)"
        )
    return_logprob = bool(_per_item(payload, "return_logprob", i, batch))
    start = int_field(
        _per_item(payload, "logprob_start_len", i, batch), "logprob_start_len", default=-1, low=-1
    )
    if start == -1:
        start = max(n - 1, 0)
    if start >= n:
        raise HttpError(
            400,
            f"logprob_start_len ({start}) must be below the length of {where} ({n})",
        )
    top_n = int_field(
        _per_item(payload, "top_logprobs_num", i, batch), "top_logprobs_num", default=0, low=0
    )
    label_ids = _per_item(payload, "token_ids_logprob", i, batch)
    if label_ids is not None:
        label_ids = token_ids(label_ids, "token_ids_logprob")
    flat = bool(payload.get("return_flat_raw_top_logprobs"))
    flat_b64 = bool(payload.get("return_flat_raw_top_logprobs_b64"))
    if flat_b64 and not flat:
        raise HttpError(
            400, "return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs"
        )
    temperature = input_temperature(payload, params)
    rid = _per_item(payload, "rid", i, batch)
    fields: dict[str, Any] = {
        "input_ids": ids,
        "top_k": top_n if return_logprob else 0,
        "temperature": temperature,
        "job_id": new_job_id(),
    }
    if return_logprob and label_ids:
        fields["label_token_ids"] = [label_ids] * (n - 1)
    try:
        req = parse_request(fields)
    except InvalidJob as exc:
        raise HttpError(400, f"{where}: {exc}" if batch else str(exc)) from None
    return _Item(
        req,
        rid=str(rid) if rid is not None else req.job_id or "",
        start=start,
        top_n=top_n if return_logprob else 0,
        label_ids=label_ids if return_logprob and label_ids else None,
        flat=flat,
        flat_b64=flat_b64,
        temperature=temperature,
        return_logprob=return_logprob,
    )
