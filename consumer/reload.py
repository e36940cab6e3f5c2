"""Loading teacher weights safely: every rank of a group loads, or every rank keeps what it had.

A weight update (or a start-up on a queue's updated weights) must never take a replica down:
`load_agreed` runs the load on every rank of the tensor-parallel group and agrees on the
outcome with one tiny all-reduce (`consumer.agreement.agree`), so a checkpoint that fails on
any rank is dropped by all of them and the replica goes on serving its current weights.
`check_weights` is the cheap check a leader runs before telling its peers to load anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import structlog
import torch
import torch.distributed as dist

from consumer.agreement import agree

log = structlog.get_logger("teacherq.consumer")

T = TypeVar("T")


def describe(exc: BaseException) -> str:
    """One line for an operator: the error's type and message, cut to a readable length."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, ValueError | OSError):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 500 else text[:497] + "..."


def load_agreed(
    load: Callable[[str], T], path: str, *, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[T | None, str | None]:
    """Run `load(path)` on every rank; `(value, None)` when every rank succeeded, else
    `(None, reason)` on every rank (the reason is this rank's, or that a peer failed)."""
    value: T | None = None
    reason: str | None = None
    try:
        value = load(path)
    except Exception as exc:  # a failed load is reported and survived, never fatal
        reason = describe(exc)
        log.exception("weights.load_failed", path=path or "(configured model)", error=reason)
    if agree(reason is None, group, device):
        return value, None
    del value  # free what this rank loaded: the group keeps its old weights
    return None, reason or "a peer rank could not load the weights (see its log)"


def check_weights(path: str, *, tp: int, ep: int = 1) -> str | None:
    """Why `path` cannot be served at `tp` x `ep` ranks (None when it looks servable); "" means the
    configured model, which was checked at start-up."""
    if not path:
        return None
    from consumer.checkpoints import check_teacher

    try:
        check_teacher(path, tp=tp, ep=ep)
    except Exception as exc:  # noqa: BLE001 - any refusal (bad JSON, missing file) is the reason
        return describe(exc)
    return None
