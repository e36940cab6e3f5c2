"""`POST /generate`, the one path two dialects share: slime's teacher server and SGLang's native
server both answer it, with different fields. This module tells them apart by the payload and
hands it to the dialect it belongs to, so neither dialect imports the other.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from producer.gateway import sglang, slime
from producer.gateway.core import Core

SLIME_ONLY = ("sample_n", "label_token_ids")  # fields only slime's server reads


def is_sglang(payload: dict[str, Any]) -> bool:
    """Whether a `/generate` payload is SGLang's: it carries `return_logprob`, or
    `sampling_params` without any field only slime's server reads (slime ignores
    `sampling_params`, so its callers may send one)."""
    if "return_logprob" in payload:
        return True
    return "sampling_params" in payload and not any(k in payload for k in SLIME_ONLY)


def routes(gw: Core) -> list[web.RouteDef]:
    """`/generate`, errors before the split (an unreadable body) in slime's shape; SGLang's
    handler answers its own errors in SGLang's."""

    async def generate(request: web.Request) -> web.StreamResponse:
        payload = await gw.body(request)
        if is_sglang(payload):
            return await sglang.generate(gw, request, payload)
        return await slime.generate(gw, request, payload)

    return [web.post("/generate", gw.route("slime", generate))]
