"""Group agreement: every rank of a TP group scores a batch, and all agree on the outcome.

A failure on any rank (a bad batch, an injected fault, an error in the model) is reported
to the whole group with one tiny all-reduce, and raised as `GroupFailure` on every rank
alike: no rank is left waiting in a collective for a peer that gave up. A peer that is gone
(killed: the transfer to it fails) raises `ReplicaBroken` (consumer/forward/peers.py) instead,
which ends the process without blaming the batch's jobs. The leader
(consumer/serve/leader.py) and the followers (consumer/serve/follower.py) call the same steps in the
same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from consumer.forward.batch import BatchTensors
from consumer.forward.peers import peers_alive
from consumer.forward.scoring import PendingScore, Scorer
from consumer.group.faults import FaultInjector
from shared.tracing import PhaseClock

PHASES = ("check", "h2d", "forward", "head", "d2h")  # timed on every rank of a group

# What scoring a batch returns on every rank: the outputs (one dict of arrays per job; the
# leader's are stored) and every rank's phase offsets, by TP rank.
Scored = tuple[list[dict], list[list[float]]]


class GroupFailure(RuntimeError):
    """Some rank of the TP group failed on a batch; every rank knows."""


def agree(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True only if every rank of the group is ok (one tiny all-reduce)."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    with peers_alive("the replica's agreement"):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def score_agreed(scorer: Scorer, batch: BatchTensors, faults: FaultInjector) -> Scored:
    """Score a batch on every rank of the group, agreeing on failure.

    Each rank checks the batch first (and fault injection fires here); the group computes only
    if every rank is ready, and reports success only if every rank finished. A failure is
    raised as GroupFailure on all ranks alike, so no rank is left waiting in a collective for a
    peer that gave up. (A rank that dies inside the model's own collectives is caught by the
    process group's timeout instead.)

    Also returns every rank's phase offsets (`PhaseClock.offsets(PHASES)`), by TP rank.
    """
    return launch_agreed(scorer, batch, faults)()


def launch_agreed(
    scorer: Scorer, batch: BatchTensors, faults: FaultInjector
) -> Callable[[], Scored]:
    """`score_agreed` in two steps: check, agree and queue the batch on the device now; the
    returned call waits for the outputs and agrees on them (raising GroupFailure then). Every
    rank of a group calls both steps in the same order."""
    group, device = scorer.layout.replica_group, scorer.device
    marks = cuda_marks(device) if device.type == "cuda" else None
    clock = PhaseClock(device_mark=marks)  # starts as the broadcast returns, on every rank
    error: BaseException | None = None
    try:
        with clock.phase("check"):
            faults.check_batch(batch.input_ids_T)
            scorer.check(batch)
    except Exception as exc:  # noqa: BLE001 - reported to the group, re-raised below
        error = exc
    if not agree(error is None, group, device):
        reason = describe_error(error, "a peer rank failed checking the batch")
        raise GroupFailure(reason) from error
    pending: PendingScore | None = None
    try:
        pending = scorer.launch(batch, clock)
    except Exception as exc:  # noqa: BLE001 - reported to the group when finishing
        error = exc

    def finish() -> Scored:
        failure, outputs = error, []
        if pending is not None:
            try:
                outputs = pending.result()
            except Exception as exc:  # noqa: BLE001 - reported to the group, re-raised below
                failure = exc
        if not agree(failure is None, group, device):
            reason = describe_error(failure, "a peer rank failed scoring the batch")
            raise GroupFailure(reason) from failure
        return outputs, gather_phases(clock, group, device)

    return finish


def cuda_marks(device: torch.device) -> Callable[[], Callable[[], float]]:
    """A `PhaseClock.device_mark` for CUDA: events on the current stream, timed against one
    recorded as the clock starts (between batches the device is idle, so that event completes
    at once; were it still busy, phases would read late, never early)."""
    start = torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(device))

    def mark() -> Callable[[], float]:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))

        def seconds() -> float:
            event.synchronize()
            return start.elapsed_time(event) / 1e3

        return seconds

    return mark


def gather_phases(
    clock: PhaseClock, group: dist.ProcessGroup | None, device: torch.device
) -> list[list[float]]:
    """Every rank's phase offsets, by TP rank (one all-gather of 10 numbers per rank)."""
    if group is None:  # nothing to gather, and no device round trip (it waits for the device)
        return [clock.offsets(PHASES)]
    mine = torch.tensor(clock.offsets(PHASES), dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with peers_alive("gathering phase times"):
        dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


def describe_error(error: BaseException | None, fallback: str) -> str:
    """`Type: message` of an error, or `fallback` when there is none (a peer failed)."""
    return f"{type(error).__name__}: {error}" if error else fallback
