"""Warm-up: run every kernel the serving path can launch before the consumer reports ready.

A consumer that says ready should serve its first batch of any output at warm speed. What a
first batch would otherwise pay for, and how the warm-up reaches it:

- **The head's output combinations.** The scorer runs one head pass per group of jobs that
  want the same kinds of output (top-k or not, samples or not, entropy or not: 8 groups), and
  the fused kernels (`consumer/kernels/rowstats.py`) compile one variant per combination of
  their compile-time flags: samples or not and how many per program (1, 2, 4, 8, 16), entropy
  or not, top-k or not. Their integer arguments that follow the row or sample count are not
  specialised, so a batch of a new size compiles nothing. Each warm-up batch holds one job of
  each group; the batches walk the sample-count classes up to `queue.max_sample_n` (and
  `queue.max_top_k` bounds the top-k); every other job carries label ids and a temperature
  other than 1.
- **CUDA-graph buckets** (`consumer/forward/graphs.py`, CUDA at TP = 1, dense teachers). A graph is
  recorded the first time its bucket comes; a full batch of documents of one length class
  (128, 256, ... up to 8192 tokens) fills one bucket, so the warm-up records each of those.
  The first such batch is scored (the head then runs at a full batch's row count); the others
  are only recorded, not run: their results are not needed, and a forward of the whole token
  budget per class was most of a large teacher's warm-up (7 of them at 7B).
  Batches of mixed lengths may still meet a bucket for the first time (one eager forward and
  a recording, a few milliseconds at 1.5B).
- **Compiled kernels persist** in `consumer.compile_cache_dir` (consumer/serve/compile_cache.py,
  sealed per environment), so a restart, or a new consumer sharing the directory, loads what
  an earlier run compiled. On an empty cache, `consumer/serve/precompile.py` compiles the
  variants this plan reaches (its own plan is derived from `plan`) in worker processes while
  the consumer imports and loads, so the warm-up finds them compiled.

`plan` says what to run (pure, testable without a model); `run` scores it on a `Scorer`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import structlog

from shared.messages import Job, TeacherRequest

log = structlog.get_logger("teacherq.consumer")

# Sample counts, one per kernel variant: samples per program (`NS`, the next power of two up
# to 16) of 1, 2, 4, 8 and 16; the counts themselves are not specialised (rowstats.py).
SAMPLE_CLASSES = (1, 2, 3, 5, 9)
TOPK_CLASSES = (1,)  # the top-k value is not specialised either: any k > 0 is one variant
SHORT_TOKENS = 16  # documents of the short round
TEMPERATURE = 0.7  # half the jobs: any temperature other than 1


@dataclass(frozen=True)
class Combo:
    """One job's outputs in a warm-up batch."""

    top_k: int
    sample_n: int
    entropy: bool
    labels: int  # label ids per position (0: none)
    temperature: float

    @property
    def group(self) -> tuple[bool, bool, bool]:
        """The scorer's head-pass group: (top-k, samples, entropy) asked for or not."""
        return (self.top_k > 0, self.sample_n > 0, self.entropy)

    def name(self) -> str:
        """A short label for logs, e.g. `k16 n3 e L2 t0.7`."""
        parts = [f"k{self.top_k}", f"n{self.sample_n}", "e" if self.entropy else "-"]
        parts += [f"L{self.labels}" if self.labels else "-", f"t{self.temperature:g}"]
        return " ".join(parts)


def classes(limit: int, values: tuple[int, ...]) -> list[int]:
    """`values` up to `limit`, and `limit` itself (the largest a job may ask for)."""
    kept = [v for v in values if v <= limit]
    if limit > 0 and limit not in kept:
        kept.append(limit)
    return kept


def combos(*, max_top_k: int, max_sample_n: int, vocab_size: int) -> list[list[Combo]]:
    """The output combinations to warm up, one list per batch: each batch holds one job of
    every head-pass group, and the batches together visit every top-k and sample-count class
    the limits allow."""
    ks = classes(min(max_top_k, vocab_size), TOPK_CLASSES) or [0]
    ns = classes(max_sample_n, SAMPLE_CLASSES) or [0]
    batches = []
    for i in range(max(len(ks), len(ns))):
        k, n = ks[i % len(ks)], ns[i % len(ns)]
        batch = []
        for g in range(8):
            want_k, want_n, entropy = bool(g & 1), bool(g & 2), bool(g & 4)
            if (want_k and not k) or (want_n and not n):
                continue  # the limits forbid this group
            flavoured = (g + i) % 2 == 1  # labels and temperature on every other job
            batch.append(
                Combo(
                    top_k=k if want_k else 0,
                    sample_n=n if want_n else 0,
                    entropy=entropy,
                    labels=2 if flavoured else 0,
                    temperature=TEMPERATURE if flavoured else 1.0,
                )
            )
        batches.append(batch)
    return batches


@dataclass(frozen=True)
class WarmupBatch:
    """One batch of the warm-up: its jobs' outputs and every job's length."""

    combos: list[Combo]
    tokens: int  # per job
    why: str  # "outputs" or "graph"


def plan(
    *,
    max_top_k: int,
    max_sample_n: int,
    vocab_size: int,
    max_input_tokens: int,
    token_budget: int,
    full: bool,
    graphs: bool,
) -> list[WarmupBatch]:
    """What the warm-up runs (see the module doc). `full` False: one small batch. `graphs`:
    also one full batch of each document-length class, which records its CUDA-graph bucket
    and runs the head at a full batch's row count."""
    if not full:
        return [WarmupBatch([Combo(1, 1, True, 0, 1.0)], 4, "outputs")]
    per_batch = combos(max_top_k=max_top_k, max_sample_n=max_sample_n, vocab_size=vocab_size)
    short = min(SHORT_TOKENS, max_input_tokens)
    out = [WarmupBatch(c, short, "outputs") for c in per_batch]
    if graphs:
        # Here, not at the top: the precompile workers read `plan` without megatron's import.
        from consumer.forward.graphs import MAX_GRAPHED_SPAN, MIN_SPAN

        plain = Combo(0, 0, False, 0, 1.0)
        span = MIN_SPAN
        while span <= min(MAX_GRAPHED_SPAN, token_budget, max_input_tokens):
            out.append(WarmupBatch([plain] * (token_budget // span), span, "graph"))
            span *= 2
    return out


def requests(batch: WarmupBatch, *, vocab_size: int, seed: int) -> list[TeacherRequest]:
    """The requests of one warm-up batch: random ids (seeded), labels and temperature as
    its combinations say."""
    rng = np.random.default_rng(seed)
    reqs = []
    for c in batch.combos:
        ids = rng.integers(0, vocab_size, size=batch.tokens, dtype=np.int64)
        labels = None
        if c.labels:
            labels = rng.integers(0, vocab_size, size=(batch.tokens - 1, c.labels), dtype=np.int64)
        reqs.append(
            TeacherRequest(
                input_ids=ids,
                label_token_ids=labels,
                top_k=c.top_k,
                sample_n=c.sample_n,
                return_entropy=c.entropy,
                temperature=c.temperature,
                seed=int(rng.integers(0, 2**31)),
            )
        )
    return reqs


def run(scorer, batches: list[WarmupBatch]) -> dict[str, object]:
    """Score every warm-up batch on `scorer` (every rank of a group runs the same batches, so
    their collectives meet); returns what was warmed, for the start-up log line."""
    from consumer.group.batching import batch_from_jobs

    started = time.perf_counter()
    vocab = int(scorer.spec.vocab_size)
    captures = scorer.graphs.captures if scorer.graphs is not None else 0
    scored_full = False  # a full batch went through the head (its row count warmed)
    recorded_only = 0
    for i, batch in enumerate(batches):
        reqs = requests(batch, vocab_size=vocab, seed=i)
        jobs = [
            Job(job_id=f"warmup-{i}-{j}", entry_id="0-0", request=r, submitted_at=0)
            for j, r in enumerate(reqs)
        ]
        if batch.why == "graph" and scored_full:
            # The rest of the length classes need their graphs, not their results: recorded,
            # not run (a whole forward of the token budget each).
            recorded_only += scorer.record_graph(batch_from_jobs(jobs))
            continue
        scorer.score(batch_from_jobs(jobs))
        scored_full = scored_full or batch.why == "graph"
    if scorer.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    seen = sorted({c.name() for b in batches if b.why == "outputs" for c in b.combos})
    return {
        "batches": len(batches),
        "combinations": seen,
        "graphs_recorded": (scorer.graphs.captures if scorer.graphs is not None else 0) - captures,
        "graphs_not_run": recorded_only,
        "seconds": round(time.perf_counter() - started, 3),
    }
