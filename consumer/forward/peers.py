"""A peer rank that is gone: a failed transfer between a replica's ranks ends the process.

Both the forward (the pipeline's stage-to-stage transfers) and the group's agreement use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class ReplicaBroken(BaseException):
    """A peer rank of this replica is gone: a transfer between the replica's pipeline stages
    failed (its connection reset). The process group cannot recover, and the batch is not to
    blame, so this is not an `Exception` a batch failure handler takes for the jobs' fault: it
    ends the process, whose claimed entries go to another consumer (as after a kill)."""


@contextmanager
def peers_alive(what: str) -> Iterator[None]:
    """Turn a failed transfer inside the block into `ReplicaBroken` (`what` names it)."""
    try:
        yield
    except RuntimeError as exc:
        raise ReplicaBroken(f"{what} failed, a peer rank is gone: {exc}") from exc
