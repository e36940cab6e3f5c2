"""Score one micro-batch: a packed prefill forward, then the teacher head on every job's rows.

One forward serves every output any job of the batch asked for: the head runs once with the
batch's largest top-k and sample count and its widest label set, and each job keeps its own
slice (a top-k prefix is the smaller top-k; sample j is keyed by j, so a prefix of the samples
is exactly what a smaller sample_n would draw).

Jobs that share a prompt (`consumer/forward/prefix.py`) share its forward rows, and its head rows
too where their seed and temperature agree (see `_head_rows`); each job still gets exactly the
rows it would get scored alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from consumer import tp_ops
from consumer.forward.attention import TreeBounds, VarlenLayout
from consumer.forward.batch import BatchTensors
from consumer.forward.graphs import GraphedForward, eager_forward
from consumer.forward.model import ModelSpec, TeacherGPTModel
from consumer.forward.prefix import PackedTree
from consumer.parallel import ParallelLayout
from consumer.transfer import to_device
from shared.tracing import PhaseClock


@dataclass(frozen=True)
class Scorer:
    """A model shard plus what the head needs to know about its vocabulary slice."""

    model: TeacherGPTModel
    spec: ModelSpec
    layout: ParallelLayout
    device: torch.device
    chunk_rows: int = 1024
    graphs: GraphedForward | None = None  # CUDA graphs of recurring layouts (see graphs.py)
    fused_head: bool = True  # the head's fused kernels where they run (tp_ops.chunked_head)

    @property
    def shard(self) -> tp_ops.VocabShard:
        """This rank's columns of the padded vocabulary."""
        padded = self.spec.padded_vocab_size(self.layout.tp)
        per_rank = padded // self.layout.tp
        return tp_ops.VocabShard(
            start=self.layout.tp_rank * per_rank, size=per_rank, vocab_size=self.spec.vocab_size
        )

    def offload(self) -> None:
        """Sleep: move the weights to host memory and release cached device memory."""
        if self.graphs is not None:
            self.graphs.clear()  # they read the weights where they are now
        self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Wake: move the weights back to the device."""
        self.model.to(self.device)

    def check(self, batch: BatchTensors) -> None:
        """Refuse a batch this model cannot score (ids outside its vocabulary, inconsistent
        lengths) before any collective starts; the leader validated jobs already, so this
        guards against anything that slipped through."""
        v = self.spec.vocab_size
        if int(batch.lengths_J.sum()) != batch.num_tokens or bool((batch.lengths_J < 2).any()):
            raise ValueError(
                "batch lengths do not add up to its tokens, or a job is shorter than 2"
            )
        for name, ids in (("input_ids", batch.input_ids_T), ("labels", batch.labels_RW)):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= v):
                raise ValueError(f"{name} hold ids outside the vocabulary [0, {v})")
        self.layout_of(batch)  # shared prompts that are not shared raise here

    @torch.inference_mode()
    def hidden_states(self, batch: BatchTensors) -> torch.Tensor:
        """Final hidden states [T, H] of every job token (documents attend only to
        themselves, positions restart at 0 in each; a shared prompt's rows are computed once
        and repeated for each job that shares it)."""
        tree = self.layout_of(batch)
        hidden_PH = self.packed_hidden_states(tree)
        if not tree.shared:
            return hidden_PH.clone() if self.graphs is not None else hidden_PH
        return hidden_PH[to_device(tree.row_of_T, hidden_PH.device)]

    def layout_of(self, batch: BatchTensors) -> PackedTree:
        """The packed layout of a batch (raises ValueError if its prompt sharing is
        inconsistent)."""
        return batch.packed

    @torch.inference_mode()
    def packed_hidden_states(
        self, tree: PackedTree, clock: PhaseClock | None = None
    ) -> torch.Tensor:
        """Final hidden states [P, H] of the packed tokens (each shared prompt once). With
        CUDA graphs this may be a graph's output buffer, overwritten by the next forward."""
        clock = clock or PhaseClock()
        with clock.phase("h2d"):
            ids, pos, bounds = self._forward_inputs(tree)
        with clock.phase("forward"):
            if self.graphs is not None:
                return self.graphs(ids, pos, bounds)
            return eager_forward(self.model, ids, pos, bounds)

    @torch.inference_mode()
    def record_graph(self, batch: BatchTensors) -> bool:
        """Record the CUDA graph that would serve `batch` without scoring it (the warm-up's
        full batches: `GraphedForward.record`); whether one was recorded."""
        if self.graphs is None:
            return False
        return self.graphs.record(*self._forward_inputs(self.layout_of(batch)))

    def _forward_inputs(self, tree: PackedTree) -> tuple[torch.Tensor, torch.Tensor, TreeBounds]:
        """The packed forward's ids, positions and layout on the device."""
        ids = to_device(tree.input_ids_P, self.device)
        pos = to_device(tree.position_P, self.device)
        bounds = TreeBounds.from_segments(tree.segments, max_position=max(tree.lengths) - 1)
        if self.device.type == "cuda":  # before any graph capture reads it (graphs.py)
            bounds.varlen = VarlenLayout.of(tree.segments, self.device)
        if self.graphs is not None:
            # Graphs read the rotary tables where they are: grown, they move.
            # ids.device, not self.device: "cuda" and "cuda:0" compare unequal.
            before = self.model.rope_tables(ids.device)[0]
            if self.model.rope_tables(ids.device, bounds.max_seqlen_q)[0] is not before:
                self.graphs.clear()
        return ids, pos, bounds

    @torch.inference_mode()
    def score(
        self, batch: BatchTensors, clock: PhaseClock | None = None
    ) -> list[dict[str, np.ndarray]]:
        """Every requested output for every job of the batch, as numpy arrays per job.

        `clock` times the phases h2d, forward, head and d2h (for the batch's trace)."""
        return self.launch(batch, clock).result()

    @torch.inference_mode()
    def launch(self, batch: BatchTensors, clock: PhaseClock | None = None) -> PendingScore:
        """Queue a batch's forward, head and copies back to the host, without waiting for the
        device (at TP = 1; with a TP group the head completes first): the caller can prepare,
        or even queue, the next batch before `result()` collects this one."""
        clock = clock or PhaseClock()
        tree = self.layout_of(batch)
        hidden_PH = self.packed_hidden_states(tree, clock)
        rows = _JobRows.of(batch, tree)
        passes = []
        # Jobs that want the same kinds of output share one head pass, so a job asking only for
        # log-probs never pays for another job's samples. Every rank forms the same groups.
        with clock.phase("head"):
            for jobs in _output_groups(batch):
                plan = _head_rows(batch, rows, jobs)
                # Row inputs stay on the host: the head checks them there and copies them
                # over without waiting for the forward (no device sync before the head). The
                # rows' hidden states are gathered into a tensor of this pass's own, which a
                # CUDA graph replayed for the next batch does not overwrite.
                call = tp_ops.HeadCall(
                    shard=self.shard,
                    tp_group=self.layout.tp_group,
                    target_ids_TW=plan.targets_UW,
                    inv_temperature_T=plan.inv_temperature_U,
                    top_k=int(batch.top_k_J[jobs].max()),
                    sample_n=int(batch.sample_n_J[jobs].max()),
                    seed_T=plan.seed_U,
                    position_T=plan.position_U,
                    want_entropy=bool(batch.return_entropy_J[jobs].any()),
                    chunk_rows=self.chunk_rows,
                    fused=self.fused_head,
                )
                pending = tp_ops.chunked_head(
                    hidden_TH=hidden_PH[to_device(plan.packed_row_U, hidden_PH.device)],
                    weight_VH=self.model.output_weight_shard(),
                    call=call,
                    deferred=True,
                )
                passes.append(_Pass(jobs, plan, pending, _host(pending.out, wait=False)))
        done = None
        if self.device.type == "cuda":  # after every pass's copies to the host
            done = torch.cuda.Event()
            done.record()
        return PendingScore(batch, clock, passes, done)


@dataclass(frozen=True)
class _Pass:
    jobs: list[int]
    plan: _HeadPlan
    pending: tp_ops.PendingHead
    host: tp_ops.HeadOutputs  # host copies of pending.out, complete after PendingScore.done


def _host(out: tp_ops.HeadOutputs, *, wait: bool) -> tp_ops.HeadOutputs:
    """Host copies of head outputs: from CUDA, queued into pinned memory (`wait`=False: valid
    once the device got there) or copied now; on the CPU, the tensors themselves."""
    if out.target_logprobs_TW.device.type != "cuda":
        return out
    return out.map(lambda t: t.to("cpu", non_blocking=not wait))


@dataclass(frozen=True)
class PendingScore:
    """A batch queued on the device by `Scorer.launch`."""

    batch: BatchTensors
    clock: PhaseClock
    passes: list[_Pass]
    done: torch.cuda.Event | None  # recorded after the last copy to the host (CUDA)

    @torch.inference_mode()
    def result(self) -> list[dict[str, np.ndarray]]:
        """Every requested output for every job, as numpy arrays per job (waits for the
        device; raises ValueError on rows with unusable logits, as `Scorer.score`)."""
        results: list[dict[str, np.ndarray]] = [{} for _ in range(self.batch.num_jobs)]
        # Host work: a device mark here would queue behind batches launched since.
        with self.clock.phase("d2h", on_device=False):
            if self.done is not None:
                self.done.synchronize()
            for p in self.passes:
                out = p.pending.result()  # checks the rows (redone on the reference path, rarely)
                host = p.host if out is p.pending.out else _host(out, wait=True)
                for j, arrays in zip(
                    p.jobs, _split_per_job(host, self.batch, p.jobs, p.plan), strict=True
                ):
                    results[j] = arrays
        return results


def _output_groups(batch: BatchTensors) -> list[list[int]]:
    groups: dict[tuple[bool, bool, bool], list[int]] = {}
    for j in range(batch.num_jobs):
        key = (bool(batch.top_k_J[j]), bool(batch.sample_n_J[j]), bool(batch.return_entropy_J[j]))
        groups.setdefault(key, []).append(j)
    return list(groups.values())


@dataclass(frozen=True)
class _JobRows:
    """Every scored row of a batch (every job position but its last; row r of a job predicts
    its token r + 1), jobs back to back: R = T - J rows, host arrays."""

    starts: np.ndarray  # int64 [J + 1], first row of each job
    packed_row_R: np.ndarray  # int64 [R], packed forward row holding the row's hidden state
    position_R: np.ndarray  # int64 [R], position of the predicted token (the sampling key)
    targets_RW: np.ndarray  # int64 [R, 1 + Wmax], the next token, then the job's labels

    @classmethod
    def of(cls, batch: BatchTensors, tree: PackedTree) -> _JobRows:
        """The rows of a batch packed as `tree`."""
        lengths = np.asarray(tree.lengths, dtype=np.int64)
        keep = np.ones(batch.num_tokens, dtype=bool)
        keep[np.cumsum(lengths) - 1] = False
        next_ids_R = np.roll(batch.input_ids_T.numpy(), -1)[keep]
        return cls(
            starts=np.concatenate([[0], np.cumsum(lengths - 1)]),
            packed_row_R=tree.row_of_T.numpy()[keep],
            position_R=np.concatenate([np.arange(1, n) for n in lengths]),
            targets_RW=np.concatenate([next_ids_R[:, None], batch.labels_RW.numpy()], axis=1),
        )


@dataclass(frozen=True)
class _HeadPlan:
    """The U rows one head pass computes, and where each job's rows are among them."""

    packed_row_U: torch.Tensor  # int64 [U]
    position_U: torch.Tensor  # int64 [U]
    seed_U: torch.Tensor  # int64 [U]
    inv_temperature_U: torch.Tensor  # float32 [U]
    targets_UW: torch.Tensor  # int64 [U, W], side by side for the jobs sharing a row
    head_row: dict[int, np.ndarray]  # job -> [L_j - 1] its rows' head rows
    column: dict[int, np.ndarray]  # job -> [L_j - 1] where its targets start in targets_UW


def _head_rows(batch: BatchTensors, rows: _JobRows, jobs: list[int]) -> _HeadPlan:
    """One head row per (packed row, seed, temperature) among the rows of `jobs`.

    Jobs sharing a prompt with equal seed and temperature get identical logits, top-k,
    entropy and samples on its rows (samples are keyed by seed, position, sample index and
    vocab id), so those rows are computed once. Only the target ids differ: each job's labels,
    and the prompt's last row, which predicts each job's own first response token. A shared
    row therefore carries every sharing job's targets side by side. Jobs whose seed or
    temperature differ get their own head rows over the same hidden states. Without sharing
    this is every job's rows in order, targets at column 0.
    """
    seeds, temps = batch.seed_J.tolist(), batch.temperature_J.tolist()
    # By the rule submit checked the requests with (raises ValueError otherwise).
    inv_temperature_J = tp_ops.validate_temperature(temperature_T=batch.temperature_J)
    num_packed = int(rows.packed_row_R.max()) + 1 if rows.packed_row_R.size else 0
    tables: dict[tuple[int, float], np.ndarray] = {}  # (seed, temp) -> packed row -> head row
    used = np.zeros(sum(int(rows.starts[j + 1] - rows.starts[j]) for j in jobs), np.int64)
    head_row, column, first_use = {}, {}, []
    count = 0
    for j in jobs:
        r0, r1 = int(rows.starts[j]), int(rows.starts[j + 1])
        packed = rows.packed_row_R[r0:r1]
        table = tables.setdefault((seeds[j], temps[j]), np.full(num_packed, -1, np.int64))
        heads = table[packed]
        new = heads < 0
        heads[new] = np.arange(count, count + int(new.sum()))
        table[packed[new]] = heads[new]
        count += int(new.sum())
        first_use.append(np.flatnonzero(new) + r0)
        head_row[j], column[j] = heads, used[heads]
        used[heads] += 1 + int(batch.label_width_J[j])
    rep_U = np.concatenate(first_use)  # the row of the job that introduced each head row
    job_U = np.searchsorted(rows.starts, rep_U, side="right") - 1
    targets_UW = np.zeros((count, int(used[:count].max())), np.int64)
    for j in jobs:
        r0, r1 = int(rows.starts[j]), int(rows.starts[j + 1])
        w = 1 + int(batch.label_width_J[j])
        cols = column[j][:, None] + np.arange(w)
        targets_UW[head_row[j][:, None], cols] = rows.targets_RW[r0:r1, :w]
    return _HeadPlan(
        packed_row_U=torch.from_numpy(rows.packed_row_R[rep_U]),
        position_U=torch.from_numpy(rows.position_R[rep_U]),
        seed_U=batch.seed_J[torch.from_numpy(job_U)],
        inv_temperature_U=inv_temperature_J[torch.from_numpy(job_U)],
        targets_UW=torch.from_numpy(targets_UW),
        head_row=head_row,
        column=column,
    )


def _split_per_job(
    out: tp_ops.HeadOutputs, batch: BatchTensors, jobs: list[int], plan: _HeadPlan
) -> list[dict[str, np.ndarray]]:
    """Each job's rows of a head pass over the rows of `jobs`."""

    def host(t: torch.Tensor) -> np.ndarray:
        return t.detach().cpu().numpy()

    targets = host(out.target_logprobs_TW)
    topk_ids, topk_lp = host(out.topk_ids_TK), host(out.topk_logprobs_TK)
    rest = host(out.topk_rest_logprob_T)
    samp_ids, samp_lp = host(out.sample_ids_TN), host(out.sample_logprobs_TN)
    entropy = None if out.entropy_T is None else host(out.entropy_T)
    results = []
    for j in jobs:
        rows, col = plan.head_row[j], plan.column[j]  # fancy indexing below copies
        w, k, n = (int(batch.label_width_J[j]), int(batch.top_k_J[j]), int(batch.sample_n_J[j]))
        job: dict[str, np.ndarray] = {"logprobs": targets[rows, col]}
        if w:
            job["label_logprobs"] = targets[rows[:, None], col[:, None] + 1 + np.arange(w)]
        if k:
            job["topk_token_ids"] = topk_ids[rows, :k]
            job["topk_logprobs"] = topk_lp[rows, :k]
            # The batch may have run a larger K: this job's rest mass also holds ranks k..K.
            extra = topk_lp[rows, k:].astype(np.float64)
            rest_k = np.logaddexp.reduce(
                np.concatenate([rest[rows, None].astype(np.float64), extra], axis=1), axis=1
            )
            job["topk_rest_logprob"] = rest_k.astype(np.float32)
        if n:
            job["sampled_token_ids"] = samp_ids[rows, :n]
            job["sampled_logprobs"] = samp_lp[rows, :n]
        if int(batch.return_entropy_J[j]):
            assert entropy is not None  # the pass computed it: one of its jobs asked
            job["entropy"] = entropy[rows]
        results.append(job)
    return results
