"""The client side of the queue protocol, shared by `TeacherClient` and `AsyncTeacherClient`.

Pure functions, no I/O: each client does its own Redis round trips (blocking or asyncio) and
hands the replies here, so both clients validate, name, encode and decode jobs the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from shared.errors import InvalidJob
from shared.messages import (
    Limits,
    TeacherRequest,
    TeacherResult,
    check_limits,
    content_job_id,
    parse_request,
)
from shared.results import encode_record
from shared.settings import Settings
from shared.streams import StreamReply

CANCELLED = "cancelled by the user"


@dataclass(frozen=True)
class Prepared:
    """A validated request with its job id, ready to encode and enqueue."""

    job_id: str
    request: TeacherRequest

    @property
    def min_generation(self) -> int:
        """The model generation a stored result must come from to count (0: any)."""
        return self.request.min_model_generation or 0


def limits(settings: Settings, advertised_vocab: bytes | str | None) -> Limits:
    """What the queue accepts: its settings, and the vocabulary from settings or, unset there,
    as the live consumers advertise it (`keys.model_key`'s `vocab_size`)."""
    q = settings.queue
    vocab = settings.model.vocab_size
    if vocab is None and advertised_vocab:
        vocab = int(advertised_vocab)
    return Limits(
        max_input_tokens=q.max_input_tokens,
        max_label_width=q.max_label_width,
        max_top_k=q.max_top_k,
        max_sample_n=q.max_sample_n,
        vocab_size=vocab,
    )


def prepare(
    requests: Iterable[TeacherRequest | dict[str, Any]],
    *,
    limits: Limits,
    settings: Settings,
    generation: int,
) -> list[Prepared]:
    """Validate every request (raising InvalidJob naming the first bad one's index before
    anything is enqueued) and give each its job id.

    A caller's own `job_id` is kept as is (idempotent across weight updates). Without one, the
    id is a content hash that includes the queue's weight `generation`, and the job asks for
    at least that generation: the same tokens after `update-weights` are a new job, computed
    by the new weights even when submitted while replicas are still reloading.
    """
    out = []
    for i, raw in enumerate(requests):
        try:
            req = parse_request(raw)
            check_limits(req, limits)
        except InvalidJob as exc:
            raise InvalidJob(f"request {i}: {exc}") from None
        if req.job_id:
            out.append(Prepared(req.job_id, req))
            continue
        job_id = content_job_id(
            req, queue=settings.queue.name, teacher=settings.model.path, generation=generation
        )
        if generation > (req.min_model_generation or 0):
            req = req.model_copy(update={"min_model_generation": generation})
        out.append(Prepared(job_id, req))
    return out


def has_room(pending_tokens: int, tokens: int, settings: Settings) -> bool:
    """Backpressure rule: a job fits while the queue's pending tokens plus its own stay within
    queue.max_pending_tokens; a job larger than the bound alone still goes on an empty queue."""
    return pending_tokens + tokens <= settings.queue.max_pending_tokens or pending_tokens == 0


def cancel_record(queue: str, job_id: str) -> dict[str, bytes | str]:
    """The result record a cancellation writes: a `cancelled` failure, no arrays."""
    return encode_record(
        TeacherResult(job_id=job_id, error=CANCELLED), queue=queue, store=None, inline_max_bytes=0
    )


def announced(reply: Any, cursor: bytes | str) -> tuple[bytes | str, list[str]]:
    """Job ids announced in an XREAD reply of the completion stream, and the cursor to read on
    from (unchanged when the reply is empty)."""
    ids = []
    for _stream, entries in cast(StreamReply, reply) or []:
        for entry_id, fields in entries:
            cursor = entry_id
            ids.append(fields.get(b"job_id", b"").decode())
    return cursor, ids


def served_generation(raw: bytes | str | None) -> int:
    """The queue's weight generation from the `generation` field of `keys.weights_key`."""
    return int(raw) if raw else 0
