"""Pack jobs into token-budgeted micro-batches and move a batch between ranks as tensors.

Jobs are packed as documents into one row (megatron's `thd` layout), so a micro-batch has no
padding at all: waste is zero by construction, and a job longer than the budget runs alone.
`BatchTensors` (consumer/forward/batch.py) is what every rank of a tensor-parallel group computes
on; the leader builds it
from decoded jobs and broadcasts it to its peers as plain tensors (no pickling), after a
four-integer header that also carries the group's other commands (stop, reload, sleep, wake).
Jobs that share a prompt (see `consumer/forward/prefix.py`) are marked per job in `group_J` and
`prefix_len_J`; the jobs' own tokens still travel whole, and each rank packs the prompt once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist

from consumer.forward.batch import BatchTensors
from shared.messages import Job, RequestOptions


def plan_microbatches(jobs: Sequence[Job], *, token_budget: int) -> list[list[Job]]:
    """Split jobs, in arrival order, into groups of at most `token_budget` tokens each.

    First-fit over open groups keeps order mostly intact while filling budgets; a job longer
    than the budget gets a group of its own.
    """
    groups: list[list[Job]] = []
    sizes: list[int] = []
    for job in jobs:
        n = job.request.num_tokens
        for i, used in enumerate(sizes):
            if used + n <= token_budget:
                groups[i].append(job)
                sizes[i] += n
                break
        else:
            groups.append([job])
            sizes.append(n)
    return groups


def _option_columns() -> dict[str, tuple[str, torch.dtype]]:
    """option -> (its BatchTensors column `<option>_J`, dtype): float64 for float options,
    int64 for int and bool ones."""
    columns = {}
    for name, info in RequestOptions.model_fields.items():
        dtype = torch.float64 if info.annotation is float else torch.int64
        columns[name] = (f"{name}_J", dtype)
    return columns


OPTION_COLUMNS = _option_columns()
"""The batch column of every request option (`shared.messages.RequestOptions`)."""


def batch_from_jobs(jobs: Sequence[Job]) -> BatchTensors:
    """Tensors for a micro-batch of decoded jobs.

    A `consumer.forward.prefix.MicroBatch` also says which jobs share a prompt; any other sequence
    of jobs is scored with every job as its own document.
    """
    reqs = [j.request for j in jobs]
    group, prefix = [-1] * len(reqs), [0] * len(reqs)
    for g, shared in enumerate(getattr(jobs, "groups", ())):
        for m in shared.members:
            group[m], prefix[m] = g, shared.prefix_len
    w_max = max((r.label_width for r in reqs), default=0)
    rows = sum(r.num_tokens - 1 for r in reqs)
    labels = np.zeros((rows, w_max), dtype=np.int64)
    at = 0
    for r in reqs:
        n = r.num_tokens - 1
        if r.label_width:
            assert r.label_token_ids is not None  # a label width implies the labels
            labels[at : at + n, : r.label_width] = r.label_token_ids
        at += n

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return BatchTensors(
        input_ids_T=torch.from_numpy(np.concatenate([r.input_ids for r in reqs])),
        lengths_J=ints([r.num_tokens for r in reqs]),
        label_width_J=ints([r.label_width for r in reqs]),
        labels_RW=torch.from_numpy(labels),
        **{
            column: torch.tensor([getattr(r, name) for r in reqs], dtype=dtype)
            for name, (column, dtype) in OPTION_COLUMNS.items()
        },
        group_J=ints(group),
        prefix_len_J=ints(prefix),
    )


# Control words: what follows a header on the leader -> peers channel.
STOP, BATCH, RELOAD, SLEEP, WAKE = 0, 1, 2, 3, 4


def broadcast_header(
    word: int, a: int = 0, b: int = 0, c: int = 0, *, src: int, group: dist.ProcessGroup | None
) -> tuple[int, int, int, int]:
    """Send (or receive) a fixed-size header of four integers from the leader."""
    header = torch.tensor([word, a, b, c], dtype=torch.int64)
    if group is not None:
        dist.broadcast(header, src=src, group=group)
    w, x, y, z = (int(v) for v in header)
    return w, x, y, z


def broadcast_text(text: str, *, src: int, group: dist.ProcessGroup | None) -> str:
    """Send a short string (a checkpoint path) from the leader as a uint8 tensor."""
    if group is None:
        return text
    is_src = dist.get_rank() == src
    data = text.encode() if is_src else b""
    (n, *_rest) = broadcast_header(len(data), src=src, group=group)
    if n == 0:
        return ""
    buf = (
        torch.tensor(list(data), dtype=torch.uint8) if is_src else torch.empty(n, dtype=torch.uint8)
    )
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.tolist()).decode()


def broadcast_batch(
    batch: BatchTensors | None, *, src: int, group: dist.ProcessGroup | None
) -> BatchTensors | None:
    """Send the leader's batch (or, with batch=None, a stop signal) to every rank of `group`.

    Shapes travel in the header so receivers can allocate; then one broadcast per tensor.
    """
    if group is None:
        return batch
    if batch is None:
        broadcast_header(STOP, src=src, group=group)
        return None
    broadcast_header(
        BATCH, batch.num_jobs, batch.num_tokens, batch.labels_RW.shape[1], src=src, group=group
    )
    return _batch_tensors(batch, src=src, group=group)


def receive_batch(
    j: int, t: int, w: int, *, src: int, group: dist.ProcessGroup | None
) -> BatchTensors:
    """On a peer, after a BATCH header: allocate and receive the batch."""
    batch = BatchTensors(
        input_ids_T=torch.empty(t, dtype=torch.int64),
        lengths_J=torch.empty(j, dtype=torch.int64),
        label_width_J=torch.empty(j, dtype=torch.int64),
        labels_RW=torch.empty((t - j, w), dtype=torch.int64),
        **{column: torch.empty(j, dtype=dtype) for column, dtype in OPTION_COLUMNS.values()},
        group_J=torch.empty(j, dtype=torch.int64),
        prefix_len_J=torch.empty(j, dtype=torch.int64),
    )
    return _batch_tensors(batch, src=src, group=group)


def _batch_tensors(batch: BatchTensors, *, src: int, group: dist.ProcessGroup | None):
    for f in fields(batch):
        dist.broadcast(getattr(batch, f.name), src=src, group=group)
    return batch
