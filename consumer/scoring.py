"""Score one micro-batch: a packed prefill forward, then the teacher head on every job's rows.

One forward serves every output any job of the batch asked for: the head runs once with the
batch's largest top-k and sample count and its widest label set, and each job keeps its own
slice (a top-k prefix is the smaller top-k; sample j is keyed by j, so a prefix of the samples
is exactly what a smaller sample_n would draw).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from consumer import tp_ops
from consumer.attention import DocumentBounds
from consumer.batching import BatchTensors
from consumer.model import ModelSpec, TeacherGPTModel
from consumer.parallel import ParallelLayout


@dataclass(frozen=True)
class Scorer:
    """A model shard plus what the head needs to know about its vocabulary slice."""

    model: TeacherGPTModel
    spec: ModelSpec
    layout: ParallelLayout
    device: torch.device
    chunk_rows: int = 1024

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

    @torch.inference_mode()
    def hidden_states(self, batch: BatchTensors) -> torch.Tensor:
        """Final hidden states [T, H] of the packed batch (documents attend only to
        themselves, positions restart at 0 in each)."""
        lengths = batch.lengths_J.tolist()
        ids = _to_device(batch.input_ids_T, self.device)
        pos = _to_device(torch.cat([torch.arange(n) for n in lengths]), self.device)
        packed = DocumentBounds.from_lengths(lengths, self.device) if len(lengths) > 1 else None
        hidden = self.model(ids[None], pos[None], attention_mask=None, packed_seq_params=packed)
        return hidden.reshape(ids.shape[0], -1)

    @torch.inference_mode()
    def score(self, batch: BatchTensors) -> list[dict[str, np.ndarray]]:
        """Every requested output for every job of the batch, as numpy arrays per job."""
        hidden_TH = self.hidden_states(batch)
        lengths = batch.lengths_J.tolist()
        # Scored rows: every position but each job's last; row r predicts token r + 1.
        keep = torch.ones(batch.num_tokens, dtype=torch.bool)
        ends = torch.tensor(lengths).cumsum(0) - 1
        keep[ends] = False
        next_ids_R = torch.roll(batch.input_ids_T, -1)[keep]
        targets_RW = torch.cat([next_ids_R[:, None], batch.labels_RW], dim=1)

        job_of_R = torch.repeat_interleave(torch.arange(batch.num_jobs), batch.lengths_J - 1)
        position_R = torch.cat([torch.arange(1, n) for n in lengths])
        hidden_RH = hidden_TH[keep.to(hidden_TH.device)]
        results: list[dict[str, np.ndarray]] = [{} for _ in range(batch.num_jobs)]
        # Jobs that want the same kinds of output share one head pass, so a job asking only for
        # log-probs never pays for another job's samples. Every rank forms the same groups.
        for jobs in _output_groups(batch):
            rows = torch.isin(job_of_R, torch.tensor(jobs))
            width = 1 + int(batch.label_width_J[jobs].max())
            out = tp_ops.chunked_head(
                hidden_TH=hidden_RH[rows.to(hidden_RH.device)],
                weight_VH=self.model.output_weight_shard(),
                shard=self.shard,
                tp_group=self.layout.tp_group,
                target_ids_TW=targets_RW[rows, :width].to(self.device),
                inv_temperature_T=(1.0 / batch.temperature_J)[job_of_R[rows]]
                .float()
                .to(self.device),
                top_k=int(batch.top_k_J[jobs].max()),
                sample_n=int(batch.sample_n_J[jobs].max()),
                seed_T=batch.seed_J[job_of_R[rows]].to(self.device),
                position_T=position_R[rows].to(self.device),
                want_entropy=bool(batch.entropy_J[jobs].any()),
                chunk_rows=self.chunk_rows,
            )
            for j, arrays in zip(jobs, _split_per_job(out, batch, jobs), strict=True):
                results[j] = arrays
        return results


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device copy; through pinned memory on CUDA so the copy is truly asynchronous."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _output_groups(batch: BatchTensors) -> list[list[int]]:
    groups: dict[tuple[bool, bool, bool], list[int]] = {}
    for j in range(batch.num_jobs):
        key = (bool(batch.top_k_J[j]), bool(batch.sample_n_J[j]), bool(batch.entropy_J[j]))
        groups.setdefault(key, []).append(j)
    return list(groups.values())


def _split_per_job(
    out: tp_ops.HeadOutputs, batch: BatchTensors, jobs: list[int]
) -> list[dict[str, np.ndarray]]:
    """Each job's slice of a head pass over the rows of `jobs` (in order)."""

    def host(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.detach().cpu().numpy()

    targets = host(out.target_logprobs_TW)
    topk_ids, topk_lp = host(out.topk_ids_TK), host(out.topk_logprobs_TK)
    rest = host(out.topk_rest_logprob_T)
    samp_ids, samp_lp = host(out.sample_ids_TN), host(out.sample_logprobs_TN)
    entropy = host(out.entropy_T)
    results = []
    start = 0
    for j in jobs:
        rows = slice(start, start + int(batch.lengths_J[j]) - 1)
        start = rows.stop
        w, k, n = (int(batch.label_width_J[j]), int(batch.top_k_J[j]), int(batch.sample_n_J[j]))
        job: dict[str, np.ndarray] = {"logprobs": targets[rows, 0].copy()}
        if w:
            job["label_logprobs"] = targets[rows, 1 : 1 + w].copy()
        if k:
            job["topk_token_ids"] = topk_ids[rows, :k].copy()
            job["topk_logprobs"] = topk_lp[rows, :k].copy()
            # The batch may have run a larger K: this job's rest mass also holds ranks k..K.
            extra = topk_lp[rows, k:].astype(np.float64)
            rest_k = np.logaddexp.reduce(
                np.concatenate([rest[rows, None].astype(np.float64), extra], axis=1), axis=1
            )
            job["topk_rest_logprob"] = rest_k.astype(np.float32)
        if n:
            job["sampled_token_ids"] = samp_ids[rows, :n].copy()
            job["sampled_logprobs"] = samp_lp[rows, :n].copy()
        if int(batch.entropy_J[j]):
            job["entropy"] = entropy[rows].copy()
        results.append(job)
    return results
