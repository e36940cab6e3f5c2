"""Shared-prefix packing: compute a prompt once for all the jobs of a micro-batch that share it.

RL and distillation batches are full of jobs with one prompt and different responses (a GRPO
group is n responses to one prompt). Scoring them as separate documents runs the prompt's
forward n times. This module finds such groups among the jobs read together and lays a
micro-batch out as a set of one-level trees:

    packed tokens:  [prompt][response 1]...[response n] [other job] ...
    positions:      0..p-1   p..p+r1-1 ... p..p+rn-1     0..L-1
    attention:      prompt causal over itself; response i over prompt ++ itself (causal);
                    every other job causal over itself, as in plain packing

A job's output rows are then its prompt rows (shared: rows 0..p-1, the last of which predicts
the job's own first response token) followed by its response rows; see `consumer/forward/scoring.py`
for how the head shares the prompt rows between jobs whose options agree.

Two ways in: jobs whose requests carry the same `prefix_id` share their longest common prefix,
whatever its length; other jobs are matched automatically when they start with an identical
run of at least `min_prefix_tokens` tokens (`MIN_SHARED_PREFIX` by default; None turns
automatic matching off). Either way every job keeps at least one token of its own, so a job
is never entirely somebody else's prompt.

The plan travels with the jobs: `plan_shared_microbatches` returns `MicroBatch` lists (plain
lists of jobs to any caller) whose `groups` say who shares what; `batch_from_jobs` turns that
into two per-job tensors of `BatchTensors` (`group_J`, `prefix_len_J`), and every rank of a TP
group derives the same packed layout from them with `pack_tree`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shared.messages import Job

MIN_SHARED_PREFIX = 64
"""Default: automatic matching needs an identical leading run of at least this many tokens.
Below it the extra attention calls a tree costs outweigh the few tokens saved."""


@dataclass(frozen=True)
class PrefixGroup:
    """Jobs (positions in a job list) whose first `prefix_len` tokens are identical."""

    members: tuple[int, ...]
    prefix_len: int

    @property
    def tokens_saved(self) -> int:
        """Forward tokens not computed because the prompt runs once, not once per member."""
        return (len(self.members) - 1) * self.prefix_len


class MicroBatch(list):
    """The jobs of one micro-batch, plus which of them share a prompt (`groups`, positions in
    this list). A list subclass so code that takes `list[Job]` keeps working unchanged."""

    def __init__(self, jobs: Sequence[Job] = (), groups: Sequence[PrefixGroup] = ()) -> None:
        super().__init__(jobs)
        self.groups: tuple[PrefixGroup, ...] = tuple(groups)

    @property
    def prefix_tokens_saved(self) -> int:
        """Forward tokens this micro-batch does not compute thanks to shared prompts."""
        return sum(g.tokens_saved for g in self.groups)

    @property
    def computed_tokens(self) -> int:
        """Tokens the packed forward runs: every job's tokens minus the shared repeats."""
        return sum(j.request.num_tokens for j in self) - self.prefix_tokens_saved


# ---------------------------------------------------------------------------------------------
# Finding shared prefixes


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the identical leading run of two token arrays."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def find_shared_prefixes(
    jobs: Sequence[Job], *, min_prefix_tokens: int | None = MIN_SHARED_PREFIX
) -> list[PrefixGroup]:
    """Disjoint groups of at least two jobs that share a prompt, as positions in `jobs`.

    Jobs with the same `prefix_id` form one group sharing their longest common prefix (capped
    so each keeps a token of its own); an id seen once, or whose jobs share nothing, leaves its
    jobs to automatic matching, which groups the remaining jobs by identical leading runs of at
    least `min_prefix_tokens` tokens (None: no automatic matching).
    """
    ids = [np.asarray(j.request.input_ids) for j in jobs]
    by_id: dict[str, list[int]] = {}
    for i, job in enumerate(jobs):
        pid = job.request.prefix_id
        if pid is not None:
            by_id.setdefault(pid, []).append(i)
    groups: list[PrefixGroup] = []
    taken: set[int] = set()
    for members in by_id.values():
        if len(members) < 2:
            continue
        p = min(common_prefix_len(ids[members[0]], ids[m]) for m in members[1:])
        p = min(p, min(ids[m].shape[0] for m in members) - 1)
        if p >= 1:
            groups.append(PrefixGroup(tuple(members), p))
            taken.update(members)
    if min_prefix_tokens is not None:
        rest = [i for i in range(len(jobs)) if i not in taken]
        groups += _auto_groups(ids, rest, max(1, min_prefix_tokens))
    return sorted(groups, key=lambda g: g.members[0])


def _auto_groups(ids: list[np.ndarray], candidates: list[int], threshold: int) -> list[PrefixGroup]:
    # Only jobs that agree on their first `threshold` tokens can share that much: bucket by
    # those bytes first, so the expensive part sees few jobs at a time.
    buckets: dict[bytes, list[int]] = {}
    for i in candidates:
        if ids[i].shape[0] > threshold:
            buckets.setdefault(ids[i][:threshold].tobytes(), []).append(i)
    groups = []
    for members in buckets.values():
        if len(members) >= 2:
            groups += _split_bucket(ids, members, threshold)
    return groups


def _split_bucket(ids: list[np.ndarray], members: list[int], threshold: int) -> list[PrefixGroup]:
    """Best one-level grouping of jobs that share at least `threshold` leading tokens.

    Sorted lexicographically, jobs sharing a prefix of a given length are contiguous, and the
    prefix of a contiguous run is the minimum of its adjacent common prefixes. Each run is
    either kept whole (saving (n - 1) * prefix) or cut at its weakest link, whichever saves
    more: e.g. 8 responses to prompt A plus 8 to prompt A' that agrees with A on 100 of 2000
    tokens become two groups of 2000, not one of 100.
    """
    order = sorted(members, key=lambda i: ids[i].tolist())
    lengths = [ids[i].shape[0] for i in order]
    links = [common_prefix_len(ids[a], ids[b]) for a, b in zip(order, order[1:], strict=False)]
    best: dict[tuple[int, int], tuple[int, list[tuple[int, int, int]]]] = {}
    # Post-order over the cut tree without recursion (a bucket may hold hundreds of jobs).
    stack = [(0, len(order) - 1, False)]
    while stack:
        lo, hi, children_done = stack.pop()
        if hi <= lo:
            best[lo, hi] = (0, [])
            continue
        cut = lo + int(np.argmin(links[lo:hi]))
        if not children_done:
            stack += [(lo, hi, True), (lo, cut, False), (cut + 1, hi, False)]
            continue
        p = min(links[cut], min(lengths[lo : hi + 1]) - 1)
        whole = (hi - lo) * p if p >= threshold else 0
        left, right = best.pop((lo, cut)), best.pop((cut + 1, hi))
        if whole and whole >= left[0] + right[0]:
            best[lo, hi] = (whole, [(lo, hi, p)])
        else:
            best[lo, hi] = (left[0] + right[0], left[1] + right[1])
    _, runs = best[0, len(order) - 1]
    return [PrefixGroup(tuple(sorted(order[lo : hi + 1])), p) for lo, hi, p in runs]


# ---------------------------------------------------------------------------------------------
# Planning micro-batches


def plan_shared_microbatches(
    jobs: Sequence[Job],
    *,
    token_budget: int,
    min_prefix_tokens: int | None = MIN_SHARED_PREFIX,
) -> list[MicroBatch]:
    """Split jobs into micro-batches of at most `token_budget` computed tokens, each shared
    prompt counted once.

    Like `consumer.group.batching.plan_microbatches` (first fit, in arrival order, a job longer than
    the budget alone), but a group sharing a prompt is placed as one unit costing
    prompt + its responses; a group too big for the budget is cut into chunks that each
    repeat the prompt. `MicroBatch.prefix_tokens_saved` counts what sharing saved.
    """
    units: list[tuple[list[int], int, int]] = []  # (job positions, prefix_len, cost)
    grouped: set[int] = set()
    for g in find_shared_prefixes(jobs, min_prefix_tokens=min_prefix_tokens):
        grouped.update(g.members)
        units += _chunk_group(jobs, g, token_budget)
    units += [([i], 0, jobs[i].request.num_tokens) for i in range(len(jobs)) if i not in grouped]
    units.sort(key=lambda u: u[0][0])

    batches: list[MicroBatch] = []
    used: list[int] = []
    for members, p, cost in units:
        b = next((i for i, size in enumerate(used) if size + cost <= token_budget), len(used))
        if b == len(batches):
            batches.append(MicroBatch())
            used.append(0)
        batch = batches[b]
        if p:
            at = len(batch)
            batch.groups += (PrefixGroup(tuple(range(at, at + len(members))), p),)
        batch.extend(jobs[i] for i in members)
        used[b] += cost
    return batches


def _chunk_group(
    jobs: Sequence[Job], group: PrefixGroup, token_budget: int
) -> list[tuple[list[int], int, int]]:
    """The group as units of at most `token_budget` computed tokens (a chunk of one job is
    a plain job)."""
    p = group.prefix_len
    chunks: list[list[int]] = [[]]
    cost = p
    for m in group.members:
        own = jobs[m].request.num_tokens - p
        if chunks[-1] and cost + own > token_budget:
            chunks.append([])
            cost = p
        chunks[-1].append(m)
        cost += own
    units = []
    for members in chunks:
        if len(members) == 1:
            units.append((members, 0, jobs[members[0]].request.num_tokens))
        else:
            units.append((members, p, p + sum(jobs[m].request.num_tokens - p for m in members)))
    return units


# ---------------------------------------------------------------------------------------------
# The packed layout every rank computes on


@dataclass(frozen=True)
class PackedTree:
    """Where every token of a micro-batch's jobs lives in its packed forward.

    T job tokens (documents back to back, as in `BatchTensors.input_ids_T`), P <= T packed
    tokens. Each segment is (start, end, context_start, context_end) over packed rows: the
    segment's tokens attend to the context rows (a shared prompt; empty for a prompt or a job
    that shares nothing) and causally to themselves.
    """

    input_ids_P: torch.Tensor  # int64 [P]
    position_P: torch.Tensor  # int64 [P], position of the token in its job(s)
    row_of_T: torch.Tensor  # int64 [T], packed row of each job token
    segments: tuple[tuple[int, int, int, int], ...]
    lengths: tuple[int, ...]  # per job, L_j
    shared: bool  # any prompt shared at all

    @property
    def num_packed(self) -> int:
        """P."""
        return int(self.input_ids_P.shape[0])

    @property
    def tokens_saved(self) -> int:
        """T - P: job tokens that reuse a shared prompt's rows."""
        return int(self.row_of_T.shape[0]) - self.num_packed


def pack_tree(
    input_ids_T: torch.Tensor,
    lengths_J: torch.Tensor,
    group_J: torch.Tensor,
    prefix_J: torch.Tensor,
) -> PackedTree:
    """The packed layout of a micro-batch: each shared prompt once, before its responses.

    `group_J` gives jobs that share a prompt one id >= 0 (-1: alone), `prefix_J` the shared
    length. Raises ValueError when they are inconsistent (members disagreeing on the prompt
    length or its tokens, a job left with no tokens of its own), so a bad plan fails its batch
    instead of scoring jobs against a wrong prompt.
    """
    lengths = [int(n) for n in lengths_J.tolist()]
    groups, prefixes = group_J.tolist(), prefix_J.tolist()
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64).tolist()
    ids = input_ids_T.numpy()
    # Host bookkeeping in numpy: a micro-batch holds up to hundreds of jobs, and this runs on
    # the host between batches (small torch ops cost several microseconds each).
    src_parts: list[np.ndarray] = []  # job-token index of each packed token
    pos_parts: list[np.ndarray] = []
    row_parts: list[np.ndarray] = []
    segments: list[tuple[int, int, int, int]] = []
    prompts: dict[int, tuple[int, int]] = {}  # group -> (packed start of its prompt, job)
    at = 0

    def emit(src0: int, pos0: int, n: int, context: tuple[int, int]) -> None:
        nonlocal at
        src_parts.append(np.arange(src0, src0 + n))
        pos_parts.append(np.arange(pos0, pos0 + n))
        segments.append((at, at + n, *context))
        at += n

    for j, (n, g, p, s) in enumerate(zip(lengths, groups, prefixes, starts, strict=True)):
        if g < 0 and p:
            raise ValueError(f"job {j} shares no prompt but has prefix length {p}")
        if g < 0:
            row_parts.append(np.arange(at, at + n))
            emit(s, 0, n, (at, at))
            continue
        if not 1 <= p < n:
            raise ValueError(f"job {j} of length {n} cannot share a prompt of {p} tokens")
        if g not in prompts:
            prompts[g] = (at, j)
            emit(s, 0, p, (at, at))
        p_at, j0 = prompts[g]
        if p != prefixes[j0]:
            raise ValueError(f"jobs {j0} and {j} of group {g} disagree on its prompt length")
        s0 = starts[j0]
        if j != j0 and not np.array_equal(ids[s : s + p], ids[s0 : s0 + p]):
            raise ValueError(f"jobs {j0} and {j} of group {g} do not share their prompt")
        row_parts += [np.arange(p_at, p_at + p), np.arange(at, at + n - p)]
        emit(s + p, p, n - p, (p_at, p_at + p))
    src = torch.from_numpy(np.concatenate(src_parts))
    return PackedTree(
        input_ids_P=input_ids_T[src],
        position_P=torch.from_numpy(np.concatenate(pos_parts)),
        row_of_T=torch.from_numpy(np.concatenate(row_parts)),
        segments=tuple(segments),
        lengths=tuple(lengths),
        shared=bool(prompts),
    )
