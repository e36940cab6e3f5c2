"""Shared-prefix packing against plain packing on a GRPO-like workload, side by side.

Workload: `--prompts` prompts of `--prompt-len` tokens (uniform in MIN:MAX), each answered by
`--responses` responses (uniform in MIN:MAX) of `--response-len` tokens; one job per response
(prompt ++ response), every job read in one batching window. Both paths score every job with
the same Scorer (one model, one process) and the same token budget per micro-batch:

    unshared: consumer.group.batching.plan_microbatches       every job its own document
    shared:   consumer.forward.prefix.plan_shared_microbatches each prompt once, responses as a tree

Printed per path: forward tokens computed, head rows, micro-batches, seconds, jobs/s and job
tokens/s (tokens the jobs hold, whatever was computed), then shared/unshared ratios and the
agreement of the two paths' outputs; last, after the timed runs, both paths' log-probs of the
first `--check-jobs` jobs against those jobs scored alone by the float32 model (in bf16, two
correct forwards differ by rounding; each path's distance from float32 is its error). The jobs
of a group ask for the same outputs with the same seed, so the head shares the prompt rows too
(head rows = job rows - prefix tokens saved). The weights are random (matrices N(0, 0.02),
norms 1): timing does not depend on them.

    .venv/bin/python bench/prefix.py --small                                  # CPU
    python bench/prefix.py --device cuda                                       # H200, 8B-like
    python bench/prefix.py --device cuda --prompt-len 2048 --responses 8 --response-len 512
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from consumer import cpu_compat  # noqa: E402 - repo on path
from consumer.forward.model import TINY, ModelSpec, build_model  # noqa: E402 - repo on path
from consumer.forward.prefix import plan_shared_microbatches  # noqa: E402 - repo on path
from consumer.forward.scoring import Scorer  # noqa: E402 - repo on path
from consumer.group.batching import batch_from_jobs, plan_microbatches  # noqa: E402 - repo on path
from consumer.parallel import init_parallel  # noqa: E402 - repo on path
from shared.messages import Job, TeacherRequest  # noqa: E402 - repo on path

PRESETS = {
    "tiny": TINY,
    "small": ModelSpec(family="small", vocab_size=4096, hidden_size=256, num_layers=4,
                       num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=768,
                       max_position_embeddings=16384),
    "1.5b": ModelSpec(family="qwen2", vocab_size=151936, hidden_size=1536, num_layers=28,
                      num_attention_heads=12, num_kv_heads=2, ffn_hidden_size=8960,
                      qkv_bias=True, max_position_embeddings=32768),
    "8b": ModelSpec(family="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
                    num_attention_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                    rope_theta=500000.0, max_position_embeddings=32768),
}  # fmt: skip
SMALL = {"model": "small", "prompts": 4, "prompt_len": "256:768", "responses": "4:8",
         "response_len": "32:128", "token_budget": 4096}  # fmt: skip
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def workload(args: argparse.Namespace, vocab: int) -> list[Job]:
    """One job per response; responses of a prompt are consecutive, as a GRPO group."""
    rng = np.random.default_rng(args.seed)
    jobs = []
    for g in range(args.prompts):
        prompt = rng.integers(0, vocab, size=int(rng.integers(*_inclusive(args.prompt_len))))
        for _ in range(int(rng.integers(*_inclusive(args.responses)))):
            response = rng.integers(
                0, vocab, size=int(rng.integers(*_inclusive(args.response_len)))
            )
            req = TeacherRequest(
                input_ids=np.concatenate([prompt, response]),
                top_k=args.top_k,
                sample_n=args.sample_n,
                seed=g,
                prefix_id=f"prompt-{g}" if args.prefix_id else None,
            )
            jobs.append(Job(job_id=f"j{len(jobs)}", entry_id="0-0", request=req, submitted_at=0))
    return jobs


def _inclusive(text: str) -> tuple[int, int]:
    lo, hi = _range(text)
    return lo, hi + 1


def _model(args: argparse.Namespace, device: torch.device) -> Scorer:
    spec = PRESETS[args.model]
    layout = init_parallel(tp=1, pp=1)
    dtype = DTYPES[args.dtype]
    # Zero-filled build, then random weights drawn on the device: seconds even for 8B.
    model = build_model(spec, layout, params_dtype=dtype, device=device, init_weights=False)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    return Scorer(model=model, spec=spec, layout=layout, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclasses.dataclass
class PathRun:
    """One path's measurements."""

    name: str
    batches: int
    forward_tokens: int
    head_rows: int
    seconds: float
    peak_bytes: int
    outputs: dict[str, dict]


def run_path(name: str, scorer: Scorer, plans: list, repeat: int) -> PathRun:
    """Score every micro-batch of `plans`; the best of `repeat` timed runs is kept."""
    device = scorer.device
    scorer.score(batch_from_jobs(plans[0]))  # warm-up: allocations, kernel selection
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    best, outputs = float("inf"), {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        for plan in plans:
            results = scorer.score(batch_from_jobs(plan))  # host arrays: synchronised
            outputs.update({job.job_id: r for job, r in zip(plan, results, strict=True)})
        best = min(best, time.perf_counter() - t0)
    saved = sum(getattr(p, "prefix_tokens_saved", 0) for p in plans)
    tokens = sum(j.request.num_tokens for p in plans for j in p)
    return PathRun(
        name=name,
        batches=len(plans),
        forward_tokens=tokens - saved,
        head_rows=sum(j.request.num_tokens - 1 for p in plans for j in p) - saved,
        seconds=best,
        peak_bytes=torch.cuda.max_memory_allocated() if device.type == "cuda" else 0,
        outputs=outputs,
    )


def _report(args, jobs: list[Job], runs: dict[str, PathRun]) -> None:
    n_jobs = len(jobs)
    job_tokens = sum(j.request.num_tokens for j in jobs)
    print(
        f"model={args.model} dtype={args.dtype} device={args.device} threads="
        f"{torch.get_num_threads()} prompts={args.prompts} prompt_len={args.prompt_len} "
        f"responses={args.responses} response_len={args.response_len} "
        f"token_budget={args.token_budget} top_k={args.top_k} sample_n={args.sample_n}"
    )
    print(f"jobs={n_jobs} job_tokens={job_tokens}")
    head = f"{'path':<10}{'batches':>8}{'fwd tokens':>12}{'head rows':>11}{'seconds':>10}"
    print(head + f"{'jobs/s':>10}{'tokens/s':>11}{'peak GiB':>10}")
    for r in runs.values():
        print(
            f"{r.name:<10}{r.batches:>8}{r.forward_tokens:>12}{r.head_rows:>11}"
            f"{r.seconds:>10.3f}{n_jobs / r.seconds:>10.2f}{job_tokens / r.seconds:>11.0f}"
            f"{r.peak_bytes / 2**30:>10.2f}"
        )
    s, u = runs["shared"], runs["unshared"]
    print(
        f"shared/unshared: forward tokens {s.forward_tokens / u.forward_tokens:.3f}x "
        f"({u.forward_tokens / s.forward_tokens:.2f}x fewer), jobs/s "
        f"{u.seconds / s.seconds:.2f}x, prefix tokens saved {u.forward_tokens - s.forward_tokens}"
    )
    line = (
        f"agreement: logprobs max|diff| shared vs unshared {_worst(s.outputs, u.outputs, jobs):.2e}"
    )
    if args.top_k:
        same = np.mean(
            [
                np.mean(
                    s.outputs[j.job_id]["topk_token_ids"] == u.outputs[j.job_id]["topk_token_ids"]
                )
                for j in jobs
            ]
        )
        line += f", top-k ids equal {same * 100:.2f}%"
    print(line)


def _worst(a: dict, b: dict, jobs: list[Job]) -> float:
    return max(float(np.abs(a[j.job_id]["logprobs"] - b[j.job_id]["logprobs"]).max()) for j in jobs)


def fp32_reference(scorer: Scorer, jobs: list[Job], runs: dict[str, PathRun]) -> str:
    """Both paths against each job scored alone by the float32 model (the weights upcast
    exactly, after the timed runs): in bf16 two correct forwards differ by rounding, so
    each path's distance from this reference, not from the other path, shows its error."""
    scorer.model.float()
    ref = {j.job_id: scorer.score(batch_from_jobs([j]))[0] for j in jobs}
    parts = []
    for name, run in runs.items():
        diff = np.concatenate(
            [np.abs(run.outputs[j.job_id]["logprobs"] - ref[j.job_id]["logprobs"]) for j in jobs]
        )
        parts.append(f"{name} max {diff.max():.2e} mean {diff.mean():.2e}")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU sizes: " + str(SMALL))
    parser.add_argument("--model", choices=sorted(PRESETS), default="8b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", default="1024:4096", help="MIN:MAX tokens")
    parser.add_argument("--responses", default="8:16", help="MIN:MAX per prompt")
    parser.add_argument("--response-len", default="256:2048", help="MIN:MAX tokens")
    parser.add_argument("--token-budget", type=int, default=16384, help="both paths")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sample-n", type=int, default=0)
    parser.add_argument(
        "--prefix-id", action="store_true", help="group by prefix_id, not by tokens"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, help="timed runs; the best is kept")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-jobs", type=int, default=8, help="jobs scored alone in fp32")
    args = parser.parse_args()
    if args.small:
        for key, value in SMALL.items():
            setattr(args, key, value)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_compat.apply()
    device = torch.device(args.device)
    scorer = _model(args, device)
    jobs = workload(args, scorer.spec.vocab_size)
    plans = {
        "unshared": plan_microbatches(jobs, token_budget=args.token_budget),
        "shared": plan_shared_microbatches(jobs, token_budget=args.token_budget),
    }
    runs = {name: run_path(name, scorer, p, args.repeat) for name, p in plans.items()}
    _report(args, jobs, runs)
    if args.check_jobs:
        some = jobs[: args.check_jobs]
        print(
            f"vs float32 alone (first {len(some)} jobs): logprobs |diff| "
            f"{fp32_reference(scorer, some, runs)}"
        )


if __name__ == "__main__":
    main()
