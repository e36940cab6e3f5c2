"""A mixture-of-experts teacher on one GPU (#23, #36): teacherq's model + head vs transformers'
own forward + log_softmax, on the same mixed-length documents.

The model is a random-init shape in bf16, from the public config.json files (`--shape`):

  qwen3-30b-a3b  hidden 2048, 48 layers, 32 heads of 128, 4 KV heads, 128 experts of FFN 768,
                 top-8 renormalised, vocab 151936, untied; about 61 GB of weights (the default)
  deepseek-v3    hidden 7168, 128 heads of multi-head latent attention (q LoRA 1536, kv LoRA
                 512, q/k 128 + 64 rotated dims, v 128, YaRN x40), 256 routed experts of 2048
                 in 8 groups (top-4 groups), 8 active, 1 shared, 3 dense first layers (18432),
                 vocab 129280; cut to 5 layers by default (3 dense + 2 sparse: ~55 GB)
  glm-4.5-air    hidden 4096, 96 heads of 128 (8 KV, partial rotary 0.5, q/k/v biases), 128
                 experts of 1408, 8 active, 1 shared, 1 dense first layer, vocab 151552; cut to
                 8 layers by default (~38 GB)

`--layers N` sets the depth; `--tiny` is a few-MB model of the same structure that runs on the
CPU (a check of the script: there both paths load one checkpoint written by transformers, and
their log-probs are compared).

Paths, on the same documents (lengths uniform in 256..4096, drawn from `--seed`):

  hf        Qwen3MoeForCausalLM (transformers' default experts implementation), documents
            (or DeepseekV3ForCausalLM, Glm4MoeForCausalLM) sorted by length into right-padded
            batches of at most `--tokens-per-forward` tokens
            with an attention mask: logits, a float32 log_softmax and the next-token gather;
  hf_bare   the same batches through `model.model` to the final hidden states only;
  teacherq  TeacherGPTModel with TeacherMoE layers (consumer/forward/moe.py) and the chunked
            head via Scorer.score on the consumer's packed micro-batches of the same budget, every
            output
            (next-token log-probs, top-64, 8 samples, entropy) or `--label-only`.

Reported per path: tokens/s (documents' tokens, no padding), MFU on the active parameters
(2 x active matmul weights per token, the output layer included, plus causal attention
2 s^2 heads head_dim per layer and document; peak 790e12 bf16 FLOP/s measured on an H200),
and peak device memory (weights included). Then the ratio teacherq / hf.

`--gemm-only` times the expert FFN alone on one layer's routed tokens: consumer.forward.moe_gemm's
grouped GEMM vs transformers' Qwen3MoeExperts (its grouped_mm implementation on CUDA) on the
same weights and routing. On CUDA it also times the fused path's two GEMMs apart
(`triton_gate_up_alone`, `triton_down_alone`) and, for a float32 router (DeepSeekMoE), the
router's logits both ways (`router_float32`: the reference's float32 GEMM; `router_split_bf16`:
one bf16 GEMM against three bf16 parts of the weight), each against float64. Beside those, the
public grouped GEMMs alone (`public_grouped_gemms`: torch's `_grouped_mm`, and quack-kernels'
where installed; `--quack-autotune`: autotuned too) and, with quack installed on sm90, the
path TeacherMoE then takes (`quack`: `moe_gemm.routed_combined`). `--no-quack` keeps
TeacherMoE on the Triton path there (in every mode).

`--per-layer` (DeepSeek-V3, GLM-4.5-Air) runs the default comparison on four cuts of the
shape, one after another on the same documents: 1 dense layer, 2 dense, 1 dense + 1 sparse,
1 dense + 2 sparse. Each side's seconds per token then give the head (embedding, output layer,
log-probs), one dense layer and one sparse layer by difference, and from those the ratio the
shape's full depth would have (DeepSeek-V3: 3 dense + 58 sparse). The head is a third of a
3-layer cut's device time and about 2.5 % of the full model's FLOPs.

    python bench/gpu_moe.py                      # the full 48-layer model on one H200
    python bench/gpu_moe.py --layers 8 --docs 64
    python bench/gpu_moe.py --shape deepseek-v3  # 5 layers of DeepSeek-V3 on one H200
    python bench/gpu_moe.py --shape glm-4.5-air --layers 12
    python bench/gpu_moe.py --gemm-only --tokens-per-forward 16384
    python bench/gpu_moe.py --tiny               # CPU check of the plumbing
    python bench/gpu_moe.py --shape deepseek-v3 --per-layer  # head, dense, sparse per token
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import (
    PEAK_FLOPS,
    SAMPLES,
    SHAPES,
    TOP_K,
    active_flops,
    padded_batches,
    padded_tensors,
    shape,
    transformers_config,
    versions,
)


def _sweep(fp8: bool = False, tma_only: bool = False, only: list[str] | None = None) -> list[tuple]:
    """(gate/up tiles, down tiles) pairs --sweep times besides the defaults: each GEMM's
    candidates with the other GEMM at its default (FP8: 128 deep, and 128 wide for gate/up,
    whose SwiGLU quantizes h per 128 columns); `tma_only`: the pairs with a TMA shape;
    `only`: the pairs whose text holds one of these strings (e.g. "stages=3", "bk=32")."""
    from consumer.kernels import expert_gemm as eg
    from consumer.kernels.expert_gemm import Tiles

    if fp8:
        gate_up = [
            Tiles(bm=64, bn=128, bk=128, warps=4, stages=3),
            Tiles(bm=64, bn=128, bk=128, warps=8, stages=3),
            Tiles(bm=128, bn=128, bk=128, warps=8, stages=2),
            Tiles(bm=128, bn=128, bk=128, warps=4, stages=3),
        ]
        down = [
            Tiles(bm=64, bn=256, bk=128, warps=8, stages=3),
            Tiles(bm=128, bn=128, bk=128, warps=8, stages=3),
            Tiles(bm=128, bn=256, bk=128, warps=8, stages=2),
            Tiles(bm=64, bn=128, bk=128, warps=4, stages=3),
        ]
        first, second = eg.FP8_TILES, eg.FP8_DOWN_TILES
        gate_up += [
            Tiles(bm=128, bn=128, bk=128, warps=8, stages=3, tma=True),
            Tiles(bm=64, bn=128, bk=128, warps=8, stages=4, tma=True),  # no spill (sm_90a)
            # 80 KiB of shared memory and 255 registers: two programs an SM, one's scaling
            # beside the other's products
            Tiles(bm=64, bn=128, bk=128, warps=4, stages=2),
            Tiles(bm=64, bn=128, bk=128, warps=4, stages=4),  # the default before 2026-12-07
        ]
        down += [Tiles(bm=128, bn=256, bk=128, warps=8, stages=3, tma=True)]
    else:
        gate_up = [
            Tiles(bm=128, bn=128, bk=64, warps=8, stages=4),
            Tiles(bm=64, bn=128, bk=64, warps=4, stages=4),
            Tiles(bm=128, bn=64, bk=64, warps=4, stages=4),
            Tiles(bm=128, bn=128, bk=64, group_m=16, warps=8, stages=4),
            Tiles(bm=128, bn=128, bk=32, warps=8, stages=5),
        ]
        down = [
            Tiles(bm=128, bn=256, bk=64, warps=8, stages=3),
            Tiles(bm=128, bn=256, bk=64, warps=8, stages=4),
            Tiles(bm=256, bn=128, bk=64, warps=8, stages=3),
            Tiles(bm=128, bn=128, bk=64, warps=8, stages=4),
            Tiles(bm=128, bn=128, bk=128, warps=8, stages=3),
            Tiles(bm=64, bn=256, bk=64, warps=4, stages=4),
            Tiles(bm=128, bn=256, bk=64, group_m=16, warps=8, stages=3),
        ]
        first, second = eg.BF16_TILES, eg.BF16_DOWN_TILES
        gate_up += [
            Tiles(bm=128, bn=128, bk=64, warps=8, stages=3),  # the default before TMA
            Tiles(bm=128, bn=128, bk=64, group_m=16, warps=8, stages=3, tma=True),
            Tiles(bm=64, bn=128, bk=64, warps=4, stages=4, tma=True),
            # 128-row tiles in 96 KiB of shared memory (3 stages of 32 KiB): two programs an
            # SM, one's epilogue beside the other's products, as FP8's 2-stage tile does
            # (H100, 2026-12-07: 16-20 % slower than the default at three shapes)
            Tiles(bm=128, bn=64, bk=64, warps=4, stages=3),
            Tiles(bm=128, bn=64, bk=64, warps=4, stages=3, tma=True),
        ]
        down += [
            Tiles(bm=128, bn=256, bk=64, warps=8, stages=3, tma=True),
            Tiles(bm=128, bn=128, bk=64, warps=8, stages=4, tma=True),
            Tiles(bm=256, bn=128, bk=64, warps=8, stages=3, tma=True),
            # two programs an SM (96 KiB each), the down GEMM's short K (2048 at DeepSeek-V3)
            # making its epilogue a larger share of each tile (H100, 2026-12-07: within 4 %
            # of the default through TMA, 7-9 % slower by pointer, at three shapes)
            Tiles(bm=128, bn=128, bk=64, warps=8, stages=3),
            Tiles(bm=128, bn=128, bk=64, warps=4, stages=3),
            Tiles(bm=128, bn=128, bk=64, warps=8, stages=3, tma=True),
            Tiles(bm=128, bn=128, bk=64, warps=4, stages=3, tma=True),
        ]
    # the defaults' shapes with TMA switched (on where off, off where on), each GEMM alone
    # and both together
    gate_up.append(dataclasses.replace(first, tma=not first.tma))
    down.append(dataclasses.replace(second, tma=not second.tma))
    both = (gate_up[-1], down[-1])
    pairs = [(t, second) for t in gate_up if t != first] + [(first, t) for t in down if t != second]
    chosen = [(a, b) for a, b in (*pairs, both) if a.tma or b.tma or not tma_only]
    if not fp8 and not tma_only:  # each expert's last part of at most 64 rows, 64-row tiles
        up_tail = WithTail(first, Tiles(bm=64, bn=128, bk=64, warps=4, stages=4, tma=True))
        down_tails = [
            WithTail(second, Tiles(bm=64, bn=256, bk=64, warps=4, stages=4)),
            WithTail(second, Tiles(bm=64, bn=256, bk=64, warps=8, stages=4)),
        ]
        chosen += [(up_tail, second), *((first, t) for t in down_tails)]
        chosen += [(up_tail, down_tails[0])]
    if only:
        chosen = [(a, b) for a, b in chosen if any(o in f"{a} {b}" for o in only)]
    return list(dict.fromkeys(chosen))  # each pair once


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--layers", type=int, default=None, help="cut the depth to N layers")
    p.add_argument("--docs", type=int, default=48, help="documents per pass")
    p.add_argument("--tokens-per-forward", type=int, default=16384)
    p.add_argument("--iters", type=int, default=2, help="timed passes (after one warm-up)")
    p.add_argument("--label-only", action="store_true", help="teacherq: next-token only")
    p.add_argument("--gemm-only", action="store_true", help="time the expert FFN alone")
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="cuts of 1-2 dense and 0-2 sparse layers: each side's head, dense and sparse "
        "layer per token, and the ratio they project for the full depth",
    )
    p.add_argument("--sweep", action="store_true", help="--gemm-only: other tile shapes too")
    p.add_argument(
        "--tma-only", action="store_true", help="--sweep: only pairs where a GEMM reads through TMA"
    )
    p.add_argument(
        "--only",
        action="append",
        help="--sweep: only the tile pairs whose text holds this (repeatable; e.g. tma=True)",
    )
    p.add_argument(
        "--bf16-only", action="store_true", help="--gemm-only: no FP8 paths (less memory)"
    )
    p.add_argument("--dense-layers", type=int, default=None, help="dense first layers")
    p.add_argument("--profile", action="store_true", help="teacherq's top kernels (CUDA)")
    p.add_argument("--skip-hf", action="store_true", help="teacherq alone")
    p.add_argument(
        "--long-doc",
        type=int,
        default=0,
        help="documents of about this many tokens each (alone in a forward)",
    )
    p.add_argument(
        "--flash-only-too",
        action="store_true",
        help="also time teacherq with long documents on the flash path",
    )
    p.add_argument(
        "--quack-autotune",
        action="store_true",
        help="--gemm-only: also quack-kernels' GEMMs autotuned (about a minute of compiles)",
    )
    p.add_argument(
        "--no-quack",
        action="store_true",
        help="teacherq's experts without quack-kernels' GEMMs even where it is installed",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def cut(args: argparse.Namespace) -> dict:
    """The config.json fields of the shape and depth the arguments ask for."""
    return shape(args.shape, tiny=args.tiny, layers=args.layers, dense=args.dense_layers)


def hf_config(cfg: dict):
    """The transformers config object of a shape (output layer untied)."""
    return transformers_config(cfg, tie_word_embeddings=False)


def documents(cfg: dict, args: argparse.Namespace) -> list[np.ndarray]:
    rng = np.random.default_rng(args.seed)
    if args.long_doc:  # lengths a little apart: no two alike
        return [rng.integers(0, cfg["vocab_size"], size=args.long_doc - 7 * i)
                for i in range(args.docs)]  # fmt: skip
    hi = 256 if args.tiny else 4096
    lo = 16 if args.tiny else 256
    return [
        rng.integers(0, cfg["vocab_size"], size=int(rng.integers(lo, hi + 1)))
        for _ in range(args.docs)
    ]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """N(0, 0.02) matrices (routers 4x larger: decisive routing), unit norms, on the device."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 0.08 if ("router" in name or name.endswith("mlp.gate.weight")) else 0.02
                p.normal_(0.0, std, generator=gen)
            else:
                p.fill_(1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def _timed(fn, device: torch.device, iters: int) -> float:
    fn()  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def run_hf_bare(model, docs, args, device) -> float:
    """transformers' forward to the final hidden states only: its ceiling."""
    batches = [padded_tensors(b, device) for b in padded_batches(docs, args.tokens_per_forward)]

    @torch.inference_mode()
    def one_pass() -> None:
        for ids, mask in batches:
            model.model(input_ids=ids, attention_mask=mask)

    return _timed(one_pass, device, args.iters)


def run_hf(model, docs, args, device) -> tuple[float, list[np.ndarray]]:
    batches = padded_batches(docs, args.tokens_per_forward)
    out: list[np.ndarray] = []

    @torch.inference_mode()
    def one_pass() -> None:
        out.clear()
        for batch in batches:
            ids, mask = padded_tensors(batch, device)
            logits = model(input_ids=ids, attention_mask=mask).logits
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            got = lp.gather(-1, ids[:, 1:, None])[..., 0].cpu()
            out.extend(got[i, : len(d) - 1].numpy() for i, d in enumerate(batch))

    seconds = _timed(one_pass, device, args.iters)
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))
    by_doc = [np.empty(0)] * len(docs)
    for slot, i in enumerate(order):
        by_doc[i] = out[slot]
    return seconds, by_doc


def run_teacherq(model, spec, layout, docs, args, device) -> tuple[float, list[np.ndarray]]:
    from consumer.forward.prefix import plan_shared_microbatches
    from consumer.forward.scoring import Scorer
    from consumer.group.batching import batch_from_jobs
    from shared.messages import Job, TeacherRequest

    extra = {} if args.label_only else {"top_k": TOP_K, "sample_n": SAMPLES, "return_entropy": True}
    jobs = [
        Job(job_id=f"d{i}", entry_id="0-0", submitted_at=0,
            request=TeacherRequest(input_ids=d, seed=i, **extra))
        for i, d in enumerate(docs)
    ]  # fmt: skip
    groups = plan_shared_microbatches(jobs, token_budget=args.tokens_per_forward)
    batches = [(group, batch_from_jobs(group)) for group in groups]
    scorer = Scorer(model=model, spec=spec, layout=layout, device=device)
    results: dict[str, np.ndarray] = {}

    def one_pass() -> None:
        pending = [(group, scorer.launch(batch)) for group, batch in batches]
        for group, p in pending:
            for job, res in zip(group, p.result(), strict=True):
                results[job.job_id] = res["logprobs"]

    seconds = _timed(one_pass, device, args.iters)
    return seconds, [results[f"d{i}"] for i in range(len(docs))]


def profile_pass(model, spec, layout, docs, args, device, top: int = 25) -> list[dict]:
    """One teacherq pass under torch's profiler: its `top` kernels by device time, with each
    one's share of the pass."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_teacherq(
            model, spec, layout, docs, argparse.Namespace(**{**vars(args), "iters": 1}), device
        )
    events = [ev for ev in prof.key_averages() if ev.device_time_total > 0]
    total = sum(ev.self_device_time_total for ev in events) or 1.0
    events.sort(key=lambda ev: ev.self_device_time_total, reverse=True)
    return [{"kernel": ev.key[:120], "calls": ev.count, "ms": ev.self_device_time_total / 1e3,
             "share": ev.self_device_time_total / total} for ev in events[:top]]  # fmt: skip


def _time_path(
    fn, want: torch.Tensor, device: torch.device, iters: int, flops: float, against: str = "hf"
) -> dict:
    """One path of --gemm-only: its time, throughput and largest difference from `want`
    (`against`: what `want` is, for the entry's name)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    try:
        got = fn().float()
        seconds = _timed(fn, device, iters)
    except (RuntimeError, ValueError, CompilationError, OutOfResources) as exc:  # a tile shape
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}  # that does not build here
    return {
        "ms": 1e3 * seconds,
        "tflops": flops / seconds / 1e12,
        f"max_abs_diff_vs_{against}": (got - want).abs().max().item(),
    }


def each_gemm(x, rows, picks, weights, counts, fc1, fc2, iters: int) -> dict:
    """The fused bf16 path's two GEMMs timed apart at their default tiles: where the time of
    `triton` goes (gate/up + SwiGLU with the gather; down with the weight and the scatter)."""
    from consumer.kernels import expert_gemm

    f, h = fc2.shape[2], fc2.shape[1]
    out = torch.empty(rows.shape[0], h, device=x.device, dtype=x.dtype)
    hh = expert_gemm.gate_up(x, rows, fc1, counts)[0]

    def first() -> None:
        expert_gemm.gate_up(x, rows, fc1, counts)

    def second() -> None:
        expert_gemm.down(hh, fc2, counts, picks, weights, out)

    report = {}
    for name, fn, flops in (("triton_gate_up_alone", first, 2 * rows.shape[0] * 2 * f * h),
                            ("triton_down_alone", second, 2 * rows.shape[0] * f * h)):  # fmt: skip
        seconds = _timed(fn, x.device, iters)
        report[name] = {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12}
    return report


def public_grouped_gemms(
    x, rows, picks, weights, counts, fc1, fc2, want, hf: dict, iters: int, autotune: bool
) -> dict:
    """The public grouped GEMMs for Hopper on the same routed rows, each GEMM alone beside
    ours (`each_gemm`): torch's `_grouped_mm` (what transformers' experts call; its rows
    gathered beforehand, no SwiGLU) and, where the package is installed, quack-kernels'
    varlen-M GEMMs on the CuTe DSL: gate/up with SwiGLU (`gemm_gated`) gathering its rows
    (`A_idx`) or on rows gathered beforehand (`_gathered`), down into the sorted rows;
    at quack's default tile (`_untuned`), at the tiles consumer/forward/quack_gemm.py pins
    (`_pinned`, what TeacherMoE runs) and, with `autotune` (a minute of compiles a shape),
    autotuned as quack's default call does (no suffix).

    `quack_ffn` (with `autotune`): a whole FFN of quack's autotuned GEMMs, the routing weight
    and the scatter to [token, choice] order as torch passes, checked against `want`
    (transformers' FFN) and timed against `hf` (that FFN's entry). `first_call_s`: each
    entry's first call, its compile and tuning included."""
    f, h = fc2.shape[2], fc2.shape[1]
    r, k = rows.shape[0], picks.numel() // x.shape[0]
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    flops = {"gate_up": 2 * r * 2 * f * h, "down": 2 * r * f * h}
    report: dict = {}

    def timed(name: str, fn, flops: float) -> None:
        start = time.perf_counter()
        try:
            fn()
            _sync(x.device)
            first = time.perf_counter() - start
            seconds = _timed(fn, x.device, iters)
        except Exception as exc:  # noqa: BLE001 (a path that fails here: its error, not a stop)
            report[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            return
        report[name] = {"ms": 1e3 * seconds, "tflops": flops / seconds / 1e12,
                        "first_call_s": first}  # fmt: skip

    gathered = x[rows]
    h_ref = torch.empty(r, f, device=x.device, dtype=x.dtype)
    timed("grouped_mm_gate_up_alone", lambda: torch._grouped_mm(gathered, fc1.mT, offs=ends),
          flops["gate_up"])  # fmt: skip
    timed("grouped_mm_down_alone", lambda: torch._grouped_mm(h_ref, fc2.mT, offs=ends),
          flops["down"])  # fmt: skip
    try:
        from quack.gemm_interface import gemm, gemm_gated
    except ImportError:  # quack-kernels is not a dependency: the bench runs without it
        return report
    from consumer.forward import quack_gemm
    from consumer.kernels import expert_gemm

    offsets = quack_gemm.offsets(counts)
    index = rows.to(torch.int32)
    routing = weights[picks].unsqueeze(1)  # each sorted row's routing weight

    def gate_up(tuned: bool = True) -> torch.Tensor:
        return gemm_gated(
            x, fc1.mT, activation="swiglu", cu_seqlens_m=offsets, A_idx=index,
            concat_layout=("B",), store_preact=False, tuned=tuned,
        )[1]  # fmt: skip

    hh = expert_gemm.gate_up(x, rows, fc1, counts)[0]

    def down(tuned: bool = True) -> torch.Tensor:
        return gemm(hh, fc2.mT, cu_seqlens_m=offsets, tuned=tuned)

    def ffn() -> torch.Tensor:
        y = gemm(gate_up(), fc2.mT, cu_seqlens_m=offsets)
        out = torch.empty(r, h, device=x.device, dtype=x.dtype)
        return out.index_copy_(0, picks, y.mul_(routing)).view(-1, k, h).sum(1)

    def gate_up_gathered() -> torch.Tensor:  # the rows gathered beforehand (TMA loads)
        return gemm_gated(
            gathered, fc1.mT, activation="swiglu", cu_seqlens_m=offsets,
            concat_layout=("B",), store_preact=False,
        )[1]  # fmt: skip

    both = flops["gate_up"] + flops["down"]
    autotuned = (("quack_gate_up_alone", gate_up, flops["gate_up"]),
                 ("quack_down_alone", down, flops["down"]),
                 ("quack_gate_up_gathered_alone", gate_up_gathered, flops["gate_up"]),
                 ("quack_ffn", ffn, both))  # fmt: skip
    for name, fn, work in autotuned if autotune else ():
        timed(name, fn, work)
    timed("quack_gate_up_alone_untuned", lambda: gate_up(False), flops["gate_up"])
    timed("quack_down_alone_untuned", lambda: down(False), flops["down"])
    # at the tiles consumer/forward/quack_gemm.py pins (what TeacherMoE runs; gate/up with
    # its gather)
    pinned = functools.partial(quack_gemm.gate_up, x, rows, fc1, offsets)
    timed("quack_gate_up_alone_pinned", pinned, flops["gate_up"])
    timed("quack_down_alone_pinned", lambda: quack_gemm.down(hh, fc2, offsets), flops["down"])
    if "ms" in report["quack_gate_up_alone_pinned"]:
        # quack's SwiGLU takes the float32 products; ours rounds them to bf16 first
        diff = (pinned().float() - hh.float()).abs().max().item()
        report["quack_gate_up_alone_pinned"]["max_abs_diff_vs_triton"] = diff
    if "ms" in report.get("quack_ffn", {}):
        report["quack_ffn"]["max_abs_diff_vs_hf"] = (ffn().float() - want).abs().max().item()
        report["quack_ffn"]["speedup_vs_hf"] = hf.get("ms", math.nan) / report["quack_ffn"]["ms"]
    return report


def router_paths(spec, x: torch.Tensor, iters: int, seed: int) -> dict:
    """DeepSeekMoE's float32 router logits for `x`, side by side: the reference's float32
    GEMM (what transformers runs) and ours (one bf16 GEMM against three bf16 parts of the
    weight, accumulated in float32), each against float64. Empty for other families."""
    from torch.nn import functional as F

    from consumer.forward.moe import bf16_parts, float_router, split_router_logits

    if not float_router(spec):
        return {}
    device, experts = x.device, spec.num_experts
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    weight = torch.randn(experts, x.shape[1], device=device, generator=gen) / x.shape[1] ** 0.5
    want = (x.double() @ weight.double().T).float()
    flops = 2 * x.shape[0] * x.shape[1] * experts
    fp32 = functools.partial(F.linear, x.float(), weight)
    split = lambda: split_router_logits(x, bf16_parts(weight).flatten(0, 1))  # noqa: E731
    report = {f"router_{name}": _time_path(fn, want, device, iters, flops, "float64")
              for name, fn in (("float32", fp32), ("split_bf16", split))}  # fmt: skip
    if all("ms" in r for r in report.values()):
        report["router_split_bf16"]["speedup_vs_float32"] = (
            report["router_float32"]["ms"] / report["router_split_bf16"]["ms"]
        )
    return report


@dataclasses.dataclass(frozen=True)
class WithTail:
    """A sweep's tiles for one GEMM with a tail launch (`expert_gemm.schedule`): each
    expert's last part of at most `tail.bm` rows in tiles of its own."""

    tiles: Any
    tail: Any

    def __str__(self) -> str:
        return f"{self.tiles} tail={self.tail}"


def _tiled_ffn(x, rows, dst, weights, counts, fc1, fc2, out, tiles, scales) -> None:
    """The fused expert FFN on one (gate/up, down) pair of tile shapes of the sweep (each
    Tiles, or WithTail); FP8 where `scales` holds the weights' scales."""
    from consumer.forward import moe_gemm
    from consumer.kernels import expert_gemm

    up, down = (t if isinstance(t, WithTail) else WithTail(t, None) for t in tiles)
    a, a_scale = moe_gemm._quantize(x) if scales else (x, None)
    h, h_scale = expert_gemm.gate_up(
        a, rows, fc1, counts, x_scale=a_scale, fc1_scale=scales.get("fc1_scale"),
        tiles=up.tiles, tail=up.tail,
    )  # fmt: skip
    expert_gemm.down(
        h, fc2, counts, dst, weights, out, h_scale=h_scale, fc2_scale=scales.get("fc2_scale"),
        tiles=down.tiles, tail=down.tail,
    )  # fmt: skip


def _cuda_paths(args: argparse.Namespace, ours, fp8: bool) -> dict:
    """--gemm-only's fused Triton paths on CUDA: the defaults, `--sweep`'s tile pairs, and
    with `fp8` the same in FP8."""
    paths = {"triton": lambda: ours("triton")}
    only = {"tma_only": args.tma_only, "only": args.only}
    sweep = _sweep(**only) if args.sweep else []
    paths |= {
        f"triton up={a} down={b}": functools.partial(ours, "triton", (a, b)) for a, b in sweep
    }
    if fp8:
        paths["triton_fp8"] = lambda: ours("triton", fp8=True)
        sweep = _sweep(fp8=True, **only) if args.sweep else []
        paths |= {
            f"triton_fp8 up={a} down={b}": functools.partial(ours, "triton", (a, b), True)
            for a, b in sweep
        }
    return paths


def gemm_only(args: argparse.Namespace, device: torch.device) -> dict:
    """Expert FFN of one layer on routed tokens, at the shape's expert sizes, on the same
    weights and routing: transformers' experts (Qwen3MoeExperts, the same expert math as
    DeepSeek-V3's and GLM-4.5's; grouped_mm on CUDA), our unfused path (a gather, torch's
    grouped GEMM, SwiGLU, the weights and a scatter), the fused Triton kernels in bf16
    (consumer/kernels/expert_gemm.py; `--sweep`: other tile shapes too) and in FP8 with the
    weights block-quantized (against the same quantized operands in float32, and against the
    bf16 weights they came from)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from consumer.checkpoints.hf_config import spec_from_hf_config
    from consumer.forward import moe_gemm, quack_gemm

    spec = spec_from_hf_config(
        hf_config(
            shape(args.shape, tiny=args.tiny, layers=args.layers, dense=args.dense_layers)
        ).to_dict()
    )
    h, e, k, f = spec.hidden_size, spec.num_experts, spec.moe_top_k, spec.moe_ffn_hidden_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.tokens_per_forward if device.type == "cuda" else 256
    config = Qwen3MoeConfig(
        hidden_size=h, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=f
    )
    # what a whole model picks by default: grouped_mm where it dispatches, eager otherwise
    config._experts_implementation = "grouped_mm" if device.type == "cuda" else "eager"
    experts = Qwen3MoeExperts(config).to(device=device, dtype=dtype)
    randomize(experts, args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.randn(tokens, h, device=device, dtype=dtype, generator=gen)
    logits = torch.randn(tokens, e, device=device, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    flat = ids.reshape(-1)
    picks = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    rows = torch.div(picks, k, rounding_mode="floor")
    fc1, fc2 = experts.gate_up_proj, experts.down_proj  # [E, 2f, h], [E, h, f]
    if fc1.shape[-1] != h:  # an older transformers stores them transposed
        fc1, fc2 = fc1.transpose(1, 2).contiguous(), fc2.transpose(1, 2).contiguous()
    quantized = {}
    if device.type == "cuda" and f % 128 == 0 and h % 128 == 0 and not args.bf16_only:
        (q1, s1), (q2, s2) = (moe_gemm._quantize_experts(w) for w in (fc1, fc2))
        quantized = {"fc1": q1, "fc2": q2, "fc1_scale": s1, "fc2_scale": s2}

    def ours(path: str, tiles=None, fp8: bool = False) -> torch.Tensor:
        out = torch.empty(tokens * k, h, device=device, dtype=dtype)
        w1, w2 = (quantized["fc1"], quantized["fc2"]) if fp8 else (fc1, fc2)
        scales = {n: quantized[n] for n in ("fc1_scale", "fc2_scale")} if fp8 else {}
        if tiles is None:
            moe_gemm.routed_swiglu(
                x, rows, picks, weights.reshape(-1), counts, w1, w2, out, path=path, **scales
            )
        else:  # a pair of tile shapes of the sweep: (gate/up, down)
            flat = weights.reshape(-1)
            _tiled_ffn(x, rows, picks, flat, counts, w1, w2, out, tiles, scales)
        return out.view(tokens, k, h).sum(dim=1)

    def theirs() -> torch.Tensor:
        return experts(x, ids, weights)

    flops = 2 * tokens * k * 3 * h * f
    report: dict = {"tokens": tokens, "experts": e, "top_k": k, "hidden": h, "ffn": f,
                    "hf_experts_implementation": config._experts_implementation}  # fmt: skip
    iters = max(args.iters, 5)
    with torch.inference_mode():
        want = theirs().float()
        paths = {"hf": theirs, "unfused": lambda: ours("unfused")}
        if device.type == "cuda":
            paths |= _cuda_paths(args, ours, bool(quantized))
            if quack_gemm.available(device, dtype, h):  # quack's GEMMs and the combine kernel
                paths["quack"] = functools.partial(
                    moe_gemm.routed_combined, x, rows, picks, weights.reshape(-1), counts,
                    fc1, fc2, k,
                )  # fmt: skip
        for name, fn in paths.items():
            report[name] = _time_path(fn, want, device, iters, flops)
        apart = {}  # timed apart from the whole FFN: no speed-up against transformers' FFN
        if device.type == "cuda":
            apart |= each_gemm(x, rows, picks, weights.reshape(-1), counts, fc1, fc2, iters)
            apart |= public_grouped_gemms(
                x, rows, picks, weights.reshape(-1), counts, fc1, fc2, want, report["hf"], iters,
                args.quack_autotune,
            )  # fmt: skip
            apart |= router_paths(spec, x, iters, args.seed)
        if quantized:
            emulated = ours("unfused", fp8=True).float()
            got = ours("triton", fp8=True).float()
            report["fp8_error"] = {
                "kernel_vs_emulated_max_abs": (got - emulated).abs().max().item(),
                "fp8_vs_bf16_rel": ((got - want).norm() / want.norm()).item(),
            }
    for name in report:
        if isinstance(report[name], dict) and "ms" in report[name] and name != "hf":
            report[name]["speedup_vs_hf"] = report["hf"]["ms"] / report[name]["ms"]
    return report | apart


def main() -> None:
    from shared.log import configure_logging

    args = parse_args()
    configure_logging(level="warning", fmt="console")  # stdout carries the JSON report only
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.no_quack:  # the experts' Triton down GEMM, scatter and sum (moe_gemm.routed_swiglu)
        from consumer.forward import quack_gemm

        quack_gemm.allow(False)  # as `consumer.expert_gemms = triton` sets it
    if args.gemm_only:
        print(json.dumps(gemm_only(args, device), indent=2))
    elif args.per_layer:
        print(json.dumps(per_layer(args, device), indent=2))
    else:
        print(json.dumps(compare(args, cut(args), device), indent=2))


# --per-layer: (dense layers, layers) of each cut; its seconds per token, on both sides, are
# head + dense x D + sparse x S (the head: embedding, output layer, log-probs, and whatever a
# forward costs whatever its depth)
CUTS = {"1 dense": (1, 1), "2 dense": (2, 2), "1 dense + 1 sparse": (1, 2),
        "1 dense + 2 sparse": (1, 3)}  # fmt: skip


def per_layer(args: argparse.Namespace, device: torch.device) -> dict:
    """The cuts of CUTS one after another (each as the default run: teacherq, then
    transformers), each side's seconds per token of the head, of one dense and of one sparse
    layer from their differences, and the ratio those project for the shape's full depth."""
    full = SHAPES[args.shape]
    if "first_k_dense_replace" not in full:
        raise SystemExit(f"--per-layer needs a shape with dense first layers, not {args.shape}")
    if args.skip_hf:
        raise SystemExit("--per-layer compares both sides: leave out --skip-hf")
    runs = {}
    for name, (dense, layers) in CUTS.items():
        cfg = shape(args.shape, tiny=args.tiny, layers=layers, dense=dense)
        runs[name] = compare(args, cfg, device)
    report: dict = {"shape": args.shape, "device": str(device), "versions": versions(),
                    "tokens": runs["1 dense"]["tokens"], "cuts": runs}  # fmt: skip
    n_dense = full["first_k_dense_replace"]
    n_sparse = full["num_hidden_layers"] - n_dense
    for side in ("teacherq", "hf"):
        t = {name: 1.0 / run[side]["tokens_per_s"] for name, run in runs.items()}
        dense = t["2 dense"] - t["1 dense"]
        sparse_steps = [t["1 dense + 1 sparse"] - t["1 dense"],
                        t["1 dense + 2 sparse"] - t["1 dense + 1 sparse"]]  # fmt: skip
        sparse = (t["1 dense + 2 sparse"] - t["1 dense"]) / 2
        head = t["1 dense"] - dense
        report[side] = {
            "us_per_token": {"head": 1e6 * head, "dense_layer": 1e6 * dense,
                             "sparse_layer": 1e6 * sparse,
                             "sparse_layer_each_step": [1e6 * x for x in sparse_steps]},
            "projected_tokens_per_s": 1.0 / (head + n_dense * dense + n_sparse * sparse),
            # the first sparse layer's cost alone (its cut is the smaller: further from the
            # device's memory limit)
            "projected_from_first_step_tokens_per_s":
                1.0 / (head + n_dense * dense + n_sparse * sparse_steps[0]),
        }  # fmt: skip
    ours, theirs = report["teacherq"], report["hf"]
    report["sparse_layer_ratio"] = (
        theirs["us_per_token"]["sparse_layer"] / ours["us_per_token"]["sparse_layer"]
    )
    steps = zip(theirs["us_per_token"]["sparse_layer_each_step"],
                ours["us_per_token"]["sparse_layer_each_step"], strict=True)  # fmt: skip
    report["sparse_layer_ratio_each_step"] = [t / o for t, o in steps]
    report["near_memory_limit"] = near_memory_limit(runs, device)
    report["projected"] = {
        "layers": full["num_hidden_layers"], "dense_layers": n_dense,
        "ratio_teacherq_over_hf": ours["projected_tokens_per_s"] / theirs["projected_tokens_per_s"],
        "ratio_from_first_step": ours["projected_from_first_step_tokens_per_s"]
                                 / theirs["projected_from_first_step_tokens_per_s"],
    }  # fmt: skip
    return report


def near_memory_limit(runs: dict, device: torch.device, share: float = 0.85) -> list[str]:
    """The cuts where a side's peak held more than `share` of the device's memory: a caching
    allocator that close to the limit frees and maps memory again, which can slow that
    side's run, so the differences it enters into may not be the layer's cost alone."""
    if device.type != "cuda":
        return []
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    return [
        f"{name}: {side} peaked at {run[side]['peak_gib']:.1f} of {total:.1f} GiB"
        for name, run in runs.items()
        for side in ("teacherq", "hf")
        if run[side].get("peak_gib", 0) > share * total
    ]


def compare(args: argparse.Namespace, cfg: dict, device: torch.device) -> dict:
    """teacherq's model + head, then transformers' forward + log_softmax and its bare forward,
    on the same documents, for the config.json fields `cfg`: the default run's report."""
    from transformers import AutoModelForCausalLM

    from consumer import cpu_compat
    from consumer.checkpoints import load_hf_checkpoint
    from consumer.checkpoints.hf_config import spec_from_hf_config
    from consumer.forward.model import build_model
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=1, pp=1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    docs = documents(cfg, args)
    lengths = [len(d) for d in docs]
    config = hf_config(cfg)
    spec = spec_from_hf_config(config.to_dict())
    flops = active_flops(spec, lengths)
    report: dict = {"device": str(device), "shape": args.shape,
                    "layers": cfg["num_hidden_layers"],
                    "dense_layers": cfg.get("first_k_dense_replace"),
                    "tokens": sum(lengths), "versions": versions()}  # fmt: skip

    tmp = None
    if args.tiny:  # one checkpoint for both paths: their log-probs must agree
        tmp = tempfile.TemporaryDirectory()
        with torch.device("cpu"):
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize(hf, args.seed)
        hf.save_pretrained(tmp.name)
        model, spec = load_hf_checkpoint(tmp.name, layout, params_dtype=dtype, device=device)
    else:
        model = build_model(spec, layout, params_dtype=dtype, device=device, init_weights=False)
        randomize(model, args.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, ours = run_teacherq(model, spec, layout, docs, args, device)
    report["teacherq"] = {
        "tokens_per_s": sum(lengths) / seconds,
        "mfu_active": flops / seconds / PEAK_FLOPS,
        "peak_gib": _peak_gib(device),
        "outputs": "label" if args.label_only else f"top-{TOP_K}, {SAMPLES} samples, entropy",
    }
    if args.flash_only_too:
        from consumer.forward import attention

        kept, attention.LONG_DOCUMENT = attention.LONG_DOCUMENT, 1 << 40
        seconds_flash, _ = run_teacherq(model, spec, layout, docs, args, device)
        attention.LONG_DOCUMENT = kept
        report["teacherq_flash_only"] = {
            "tokens_per_s": sum(lengths) / seconds_flash,
            "mfu_active": flops / seconds_flash / PEAK_FLOPS,
        }
    if args.profile and device.type == "cuda":
        report["teacherq_profile"] = profile_pass(model, spec, layout, docs, args, device)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if args.skip_hf:
        return report

    if args.tiny:
        assert tmp is not None
        hf = AutoModelForCausalLM.from_pretrained(tmp.name, dtype=dtype).to(device).eval()
    else:
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        randomize(hf, args.seed)
    seconds_hf, theirs = run_hf(hf, docs, args, device)
    report["hf"] = {
        "tokens_per_s": sum(lengths) / seconds_hf,
        "mfu_active": flops / seconds_hf / PEAK_FLOPS,
        "peak_gib": _peak_gib(device),
    }
    seconds_bare = run_hf_bare(hf, docs, args, device)
    report["hf_bare"] = {
        "tokens_per_s": sum(lengths) / seconds_bare,
        "mfu_active": active_flops(dataclasses.replace(spec, vocab_size=0), lengths)
        / seconds_bare
        / PEAK_FLOPS,
    }
    report["ratio_teacherq_over_hf"] = seconds_hf / seconds
    if args.tiny:
        report["max_logprob_diff"] = float(
            max(np.abs(a - b).max() for a, b in zip(ours, theirs, strict=True))
        )
        tmp.cleanup()
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report


if __name__ == "__main__":
    main()
