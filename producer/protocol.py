"""The client side of the queue protocol, shared by `TeacherClient` and `AsyncTeacherClient`.

Pure functions, no I/O: each client does its own Redis round trips (blocking or asyncio) and
hands the replies here, so both clients validate, name, group, encode and decode jobs, and
word their refusals, the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from shared.errors import InvalidJob
from shared.memory import MemoryInfo
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
from shared.tracing import Span, end_span, start_span
from shared.weights import Served

CANCELLED = "cancelled by the user"

# Jobs of one prompt group enqueued per transaction: a group submitted in one call reaches the
# stream at once (a GRPO group is far smaller); a larger group goes in chunks of it.
SUBMIT_CHUNK = 512
MEMORY_CHECK_EVERY = 64  # jobs per INFO memory round trip while submitting
MODEL_FIELDS = ("vocab_size", "max_input_tokens")  # read from keys.model_key for `limits`


@dataclass(frozen=True)
class Prepared:
    """A validated request with its job id, ready to encode and enqueue."""

    job_id: str
    request: TeacherRequest

    @property
    def min_generation(self) -> int:
        """The model generation a stored result must come from to count (0: any)."""
        return self.request.min_model_generation or 0


def limits(settings: Settings, advertised: list[Any]) -> Limits:
    """What the queue accepts: its settings, the vocabulary from settings or (unset there) as
    the live consumers advertise it, and the model's position limit. `advertised`: the
    HMGET reply of MODEL_FIELDS on `keys.model_key`."""
    vocab, max_tokens = advertised
    return Limits.for_queue(
        settings.queue,
        vocab_size=settings.model.vocab_size or (int(vocab) if vocab else None),
        model_max_tokens=int(max_tokens) if max_tokens else None,
    )


def job_generation(served: Served) -> int:
    """The weight generation new content-named jobs are named after and ask for: the one the
    queue's replicas serve once no update runs (`active_generation`). A running or failed
    update does not count: a job asking for a generation no replica may ever serve would wait
    forever."""
    return served.active_generation


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
    id is a content hash that includes the queue's weight `generation` (`job_generation`),
    and the job asks for at least that generation: the same tokens after `update-weights` are
    a new job, computed by the new weights.
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


def units(prepared: list[Prepared], settings: Settings) -> list[list[Prepared]]:
    """Adjacent jobs that will share a prompt (the same prefix_id, or the same first
    consumer.min_shared_prefix tokens) form one unit of at most SUBMIT_CHUNK jobs, enqueued in
    one transaction; every other job is a unit of its own, so unrelated jobs still spread over
    consumers."""
    n = settings.consumer.min_shared_prefix
    out: list[list[Prepared]] = []
    last = None
    for p in prepared:
        req = p.request
        if req.prefix_id is not None:
            key: object = ("id", req.prefix_id)
        elif n and req.num_tokens > n:
            key = ("tokens", req.input_ids[:n].tobytes())
        else:
            key = None
        if key is not None and key == last and len(out[-1]) < SUBMIT_CHUNK:
            out[-1].append(p)
        else:
            out.append([p])
        last = key
    return out


def memory_check_due(enqueued: int, unit_size: int) -> bool:
    """Whether to look at Redis memory before enqueuing the next unit: before the first, then
    once per MEMORY_CHECK_EVERY jobs (one INFO round trip per transaction at most)."""
    return enqueued == 0 or enqueued // MEMORY_CHECK_EVERY != (
        (enqueued + unit_size) // MEMORY_CHECK_EVERY
    )


def has_room(pending_tokens: int, tokens: int, settings: Settings) -> bool:
    """Backpressure rule: a job fits while the queue's pending tokens plus its own stay within
    queue.max_pending_tokens; a job larger than the bound alone still goes on an empty queue."""
    return pending_tokens + tokens <= settings.queue.max_pending_tokens or pending_tokens == 0


def full_message(settings: Settings, pending: int, tokens: int) -> str:
    """QueueFull's message when backpressure is `raise` and the tokens do not fit."""
    q = settings.queue
    return (
        f"queue {q.name} holds {pending} pending tokens; adding {tokens} would "
        f"exceed queue.max_pending_tokens={q.max_pending_tokens}"
    )


def stayed_full_message(settings: Settings) -> str:
    """QueueFull's message when the queue stayed full for queue.backpressure_timeout_s."""
    q = settings.queue
    return (
        f"queue {q.name} stayed above queue.max_pending_tokens="
        f"{q.max_pending_tokens} for {q.backpressure_timeout_s:.0f}s"
    )


def memory_full(settings: Settings, info: MemoryInfo) -> bool:
    """Memory backpressure rule: Redis uses more than queue.max_memory_fraction of maxmemory."""
    return info.above(settings.queue.max_memory_fraction)


def memory_message(settings: Settings, info: MemoryInfo) -> str:
    """QueueFull's message while Redis memory is above queue.max_memory_fraction."""
    q = settings.queue
    return (
        f"queue {q.name}: Redis memory is {info.describe()}, above "
        f"queue.max_memory_fraction={q.max_memory_fraction}; results could not be stored. "
        "Remedy: read finished results (or set queue.delete_result_on_read), shorten "
        "queue.result_ttl_s / queue.trace_ttl_s, add consumers, or raise Redis maxmemory"
    )


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


def submit_span(p: Prepared) -> Span:
    """A job's `submit` span (ended by the caller with `end_span`): a child of the request's
    own `trace` carrier when it has one (a trainer's W3C `traceparent`), else of the current
    span (teacherq's, or the trainer's OpenTelemetry span). The job then carries this span's
    carrier, so every consumer span of the job lies in the same trace."""
    req = p.request
    return start_span("submit", carrier=req.trace or None, job_id=p.job_id, tokens=req.num_tokens)


def end_submit_spans(spans: list[Span], entries: list) -> None:
    """End the `submit` spans of a transaction, each with whether its job was enqueued (a
    stream entry id) or was already known (None)."""
    for s, entry in zip(spans, entries, strict=True):
        s.set(enqueued=entry is not None)
        end_span(s)
