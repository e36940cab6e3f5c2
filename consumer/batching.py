"""Pack jobs into token-budgeted micro-batches and move a batch between ranks as tensors.

Jobs are packed as documents into one row (megatron's `thd` layout), so a micro-batch has no
padding at all: waste is zero by construction, and a job longer than the budget runs alone.
`BatchTensors` is what every rank of a tensor-parallel group computes on; the leader builds it
from decoded jobs and broadcasts it to its peers as plain tensors (no pickling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist

from shared.messages import Job


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


@dataclass
class BatchTensors:
    """One micro-batch as tensors; identical on every rank of a TP group.

    J jobs, T tokens in total, R = T - J scored rows (every position but each job's last).
    """

    input_ids_T: torch.Tensor  # int64 [T], documents back to back
    lengths_J: torch.Tensor  # int64 [J]
    label_width_J: torch.Tensor  # int64 [J]
    labels_RW: torch.Tensor  # int64 [R, Wmax], zero-padded past each job's width
    top_k_J: torch.Tensor  # int64 [J]
    sample_n_J: torch.Tensor  # int64 [J]
    entropy_J: torch.Tensor  # int64 [J] (0/1)
    seed_J: torch.Tensor  # int64 [J]
    temperature_J: torch.Tensor  # float64 [J]

    @property
    def num_jobs(self) -> int:
        """J."""
        return int(self.lengths_J.shape[0])

    @property
    def num_tokens(self) -> int:
        """T."""
        return int(self.input_ids_T.shape[0])


def batch_from_jobs(jobs: Sequence[Job]) -> BatchTensors:
    """Tensors for a micro-batch of decoded jobs."""
    reqs = [j.request for j in jobs]
    w_max = max((r.label_width for r in reqs), default=0)
    rows = sum(r.num_tokens - 1 for r in reqs)
    labels = np.zeros((rows, w_max), dtype=np.int64)
    at = 0
    for r in reqs:
        n = r.num_tokens - 1
        if r.label_width:
            labels[at : at + n, : r.label_width] = r.label_token_ids
        at += n

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    return BatchTensors(
        input_ids_T=torch.from_numpy(np.concatenate([r.input_ids for r in reqs])),
        lengths_J=ints([r.num_tokens for r in reqs]),
        label_width_J=ints([r.label_width for r in reqs]),
        labels_RW=torch.from_numpy(labels),
        top_k_J=ints([r.top_k for r in reqs]),
        sample_n_J=ints([r.sample_n for r in reqs]),
        entropy_J=ints([int(r.return_entropy) for r in reqs]),
        seed_J=ints([r.seed for r in reqs]),
        temperature_J=torch.tensor([r.temperature for r in reqs], dtype=torch.float64),
    )


# Control words sent before each batch: a batch follows, or the group stops.
_BATCH, _STOP = 1, 0


def broadcast_batch(
    batch: BatchTensors | None, *, src: int, group: dist.ProcessGroup | None
) -> BatchTensors | None:
    """Send the leader's batch (or a stop signal, batch=None) to every rank of `group`.

    Returns the batch on every rank, or None when the leader signalled stop. Shapes travel in a
    fixed-size header first so receivers can allocate; then one broadcast per tensor.
    """
    if group is None:
        return batch
    is_src = dist.get_rank() == src
    header = torch.zeros(4, dtype=torch.int64)
    if is_src:
        if batch is not None:
            header[:] = torch.tensor(
                [_BATCH, batch.num_jobs, batch.num_tokens, batch.labels_RW.shape[1]]
            )
        else:
            header[0] = _STOP
    dist.broadcast(header, src=src, group=group)
    if int(header[0]) == _STOP:
        return None
    j, t, w = (int(x) for x in header[1:])
    if not is_src:
        batch = BatchTensors(
            input_ids_T=torch.empty(t, dtype=torch.int64),
            lengths_J=torch.empty(j, dtype=torch.int64),
            label_width_J=torch.empty(j, dtype=torch.int64),
            labels_RW=torch.empty((t - j, w), dtype=torch.int64),
            top_k_J=torch.empty(j, dtype=torch.int64),
            sample_n_J=torch.empty(j, dtype=torch.int64),
            entropy_J=torch.empty(j, dtype=torch.int64),
            seed_J=torch.empty(j, dtype=torch.int64),
            temperature_J=torch.empty(j, dtype=torch.float64),
        )
    assert batch is not None
    for f in fields(batch):
        dist.broadcast(getattr(batch, f.name), src=src, group=group)
    return batch
