"""What every dialect of the gateway shares: the error type, reading a JSON body, coercing and
checking request fields, and writing JSON answers (orjson: numpy arrays are written as is).

Each dialect names its errors in its engine's shape (`error_body`): slime `{"error": msg}`,
SGLang `{"error": {"message", "code"}}`, vLLM and OpenAI clients `{"error": {"message", "type",
"param", "code"}}`, TRL (FastAPI) `{"detail": msg}`.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any, Literal

import orjson
from aiohttp import web

Style = Literal["slime", "sglang", "openai", "trl"]


class HttpError(Exception):
    """An error answer: status, one-line message naming the field or setting, extra fields."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


def error_body(style: Style, status: int, message: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The error answer of one dialect (see the module doc)."""
    if style == "sglang":
        return {"error": {"message": message, "code": status}, **extra}
    if style == "openai":
        kind = "BadRequestError" if status < 500 else HTTPStatus(status).phrase.replace(" ", "")
        return {
            "error": {"message": message, "type": kind, "param": None, "code": status},
            **extra,
        }
    if style == "trl":
        return {"detail": message, **extra}
    return {"error": message, **extra}


def json_response(
    body: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON answer; numpy arrays and scalars are encoded directly, NaN and infinities as null
    (JSON has no spelling for them: a dialect that needs a number puts one in first)."""
    data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return web.Response(body=data, status=status, content_type="application/json", headers=headers)


async def read_json(
    request: web.Request, *, max_bytes: int, empty_ok: bool = False
) -> dict[str, Any]:
    """The request body as a JSON object: 413 past `gateway.max_body_bytes`, 400 when it is
    not a JSON object ({} for an empty body where `empty_ok`)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(request.content_length, max_bytes)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(request.content_length, max_bytes) from None
    if not raw.strip():
        if empty_ok:
            return {}
        raise HttpError(400, "request body is empty; expected a JSON object")
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise HttpError(400, "request body must be a JSON object")
    return payload


def _too_large(length: int | None, max_bytes: int) -> HttpError:
    size = f"of {length} bytes " if length is not None else ""
    return HttpError(
        413,
        f"request body {size}exceeds gateway.max_body_bytes={max_bytes} "
        "(TEACHERQ_GATEWAY__MAX_BODY_BYTES)",
    )


def token_ids(value: Any, name: str) -> list[int]:
    """A list of token ids (ints; numeric strings refused: a dialect that coerces them does
    so itself). 400 naming `name` otherwise."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise HttpError(400, f"{name} must be a list of token ids (integers)")
    return value


def int_field(
    value: Any, name: str, *, default: int, low: int | None = None, high: int | None = None
) -> int:
    """An integer field (None: `default`) within [low, high]; 400 naming it otherwise."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise HttpError(400, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise HttpError(400, f"{name} must be <= {high}, got {value}")
    return value


def positive(value: Any, name: str) -> float | None:
    """A finite number > 0 (None stays None); 400 naming `name` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise HttpError(400, f"{name} must be a finite number > 0, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise HttpError(400, f"{name} must be a finite number > 0, got {value!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise HttpError(400, f"{name} must be a finite number > 0, got {value!r}")
    return v


def input_temperature(*sources: dict[str, Any]) -> float:
    """`input_logprob_temperature` from the first of `sources` that names it (default 1.0):
    the SGLang, vLLM and TRL dialects compute input log-probs at T = 1, as those engines do,
    whatever `temperature` says, unless a request asks for this."""
    for src in sources:
        if isinstance(src, dict) and src.get("input_logprob_temperature") is not None:
            t = positive(src["input_logprob_temperature"], "input_logprob_temperature")
            assert t is not None
            return t
    return 1.0


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while an answer of many small lists is built (a 4k x
    top-64 SGLang answer is 262k of them: collections triggered by the allocations cost ~10x
    the building itself). The lists hold no cycles, so reference counting frees them; the
    block must not await (the pause is process-wide)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
