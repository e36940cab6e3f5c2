"""Teacher throughput end to end on one GPU, on the workloads users have: Hugging Face vs the
bare forward vs teacherq.

Random-init models of the Qwen2.5-1.5B and Qwen2.5-7B shapes (and of Qwen3-8B, of Qwen3-30B-A3B,
a mixture of experts: `--models 30b-a3b`, and cuts of DeepSeek-V3 and GLM-4.5-Air, the shapes
of bench/gpu_moe.py: `deepseek-v3`, `deepseek-v3-7l`, `glm-4.5-air`) in bf16; `--e2e-variants
fp8=1` serves the same windows again with the linears block-quantized to FP8. Each workload is a
stream of documents whose lengths are drawn anew for every pass, so no batch layout repeats (as
in RL rollouts and distillation sets):

  fixed     every document 2048 tokens (the one shape earlier runs measured);
  uniform   lengths uniform in 512-4096;
  longtail  lengths log-uniform in 128-2048, and one document in 16 uniform in 16k-32k;
  grpo      groups of a prompt (256-1024 tokens) and 8 responses (128-2048 tokens each),
            submitted one group per call as a trainer sends them.

Paths, all on the same documents:

  (a) hf     transformers Qwen2ForCausalLM, attn_implementation="sdpa", documents sorted by
             length into right-padded batches of at most `--tokens-per-forward` tokens
             (padding included) with an attention mask: the forward with logits, a
             full-vocabulary fp32 log_softmax and a gather of the next-token log-probs -- what
             a user would write;
  (b) bare   the same batches, the forward to the final hidden states only, HF
             `model.model(...)` -- the ceiling for HF;
      (b')   teacherq's TeacherGPTModel forward on the consumer's own packed (thd) micro-
             batches of the same budget (shared prompts computed once);
  (c) e2e    teacherq end to end: an embedded valkey-server, a real consumer process
             (`consumer.serve.service.run`, serving a random-init TeacherGPTModel built on the
             device), jobs submitted with TeacherClient and waited for, results through
             Redis and file:// object storage. Once for next-token log-probs only ("label"),
             once with top-k 64, 8 samples and the entropy as well ("full").
             (c-direct) is Scorer.launch / result over the same micro-batches back to back in
             the consumer process (the next batch launched before the last is collected, as
             the consumer does): the device-bound rate of (c) without the queue. Its host
             time per batch is the time `launch` holds the host. (c-direct e) scores the
             same documents as (c-direct) full again with CUDA graphs off: graphs on and off
             side by side (for a teacher the consumer never graphs, MoE, the same forward
             again: what seeing a batch's documents a second time changes).
             `--e2e-variants` serves the same (c) windows again with other consumer settings
             (e.g. `cuda_graphs=0`), one consumer after the other.

(c)'s timed windows (`--e2e-forwards` forwards of documents) are larger than a pass
(`--pass-forwards`), so (a) and (b) are timed a second time on exactly the window's documents
(the label and the full window score the same ones): c/a and c/b, and (c)'s MFU, are taken on
those. On long-tailed lengths this matters: a 65k-token pass holds 0-3 of the 16k-32k
documents, and two draws differed by up to 4x in attention FLOPs per token.

Tokens/s count the documents' tokens (no padding, every shared prompt as often as it is
submitted), so every path is credited the same work. Each side runs in its own process (HF in
one, the consumer in another), so each peak of device memory (torch.cuda.max_memory_allocated,
weights included) belongs to one path. `--long-docs 32768,65536` also scores single long
documents with every output in the consumer process and reports the memory each takes above
the weights (linear in the length when nothing is quadratic).

Model shapes, from the public config.json files of Qwen/Qwen2.5-1.5B and Qwen/Qwen2.5-7B on
the Hugging Face hub (both: SwiGLU, q/k/v bias, RMSNorm eps 1e-6, RoPE theta 1e6):

    model  hidden  layers  heads  kv heads  ffn    vocab   embeddings
    1.5b   1536    28      12     2         8960   151936  tied
    7b     3584    28      28     4         18944  152064  separate

FLOPs of one prefill forward: 2 * N_mm * tokens + attention, where N_mm counts the weights of
every matrix multiply (q, k, v, o, gate, up, down of each layer, plus the output layer V * H
for the paths that compute logits: (a) and (c)), and causal attention adds, per layer and
document of s tokens, 2 * s^2 * heads * head_dim (QK^T and PV over half the square).
MFU = FLOPs / seconds / 790e12 (the bf16 dense rate measured on an H200).

    python bench/gpu_e2e.py --models 1.5b,7b --workloads fixed,uniform,longtail,grpo
    python bench/gpu_e2e.py --models tiny --tokens-per-forward 2048 --pass-forwards 2 \\
        --iters 1 --device cpu --workloads fixed,grpo     # a smoke test of the plumbing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_common import (  # noqa: E402 - the repository is on the path from here
    FRONTIER,
    PEAK_FLOPS,
    SAMPLES,
    TOP_K,
    active_flops,
    child_env,
    frontier,
    padded_batches,
    padded_tensors,
    transformers_config,
    versions,
)

_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
}
MODELS = {
    "1.5b": {
        **_QWEN2,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "7b": {
        **_QWEN2,
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-30B-A3B's public config.json (a mixture of experts: 128 experts of FFN 768,
    # 8 routed per token, renormalised): about 61 GB of bf16 weights, 3.3B active per token.
    "30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": 40960,
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-8B's public config.json (q/k RMSNorm, no biases): ~16 GB of bf16 weights.
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": 40960,
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # A few-MB mixture of experts of the same structure, for smoke tests of the MoE path.
    "tiny-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    },
    # Not a Qwen2.5 model: a few-MB shape for smoke tests of the script itself.
    "tiny": {
        **_QWEN2,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
    },
}


def model_spec(cfg: dict):
    """teacherq's ModelSpec of a shape (through transformers' config where the shape carries
    `rope_parameters`, as the frontier families' config.json files do)."""
    from consumer.checkpoints import spec_from_hf_config

    if "rope_parameters" in cfg:
        return spec_from_hf_config(transformers_config(cfg).to_dict())
    return spec_from_hf_config(cfg)


# --------------------------------------------------------------------------------------------
# Workloads and arithmetic
# --------------------------------------------------------------------------------------------

WORKLOADS = ("fixed", "uniform", "longtail", "grpo")
GRPO_RESPONSES = 8


def workload(name: str, *, tokens: int, vocab: int, seed: int) -> list[list]:
    """Documents of a workload, about `tokens` tokens in all, as submit calls: a GRPO group
    (its prompt + each response, as full documents), else one document each. Lengths and
    tokens come from `seed`: a new seed is a new layout."""
    import numpy as np

    rng = np.random.default_rng(seed)
    calls: list[list] = []
    total = 0
    while total < tokens:
        if name == "grpo":
            prompt = rng.integers(0, vocab, int(rng.integers(256, 1025)))
            group = [
                np.concatenate([prompt, rng.integers(0, vocab, int(rng.integers(128, 2049)))])
                for _ in range(GRPO_RESPONSES)
            ]
        else:
            if name == "fixed":
                n = 2048
            elif name == "uniform":
                n = int(rng.integers(512, 4097))
            elif name == "longtail":
                long = rng.random() < 1 / 16
                n = (
                    int(rng.integers(16384, 32769))
                    if long
                    else int(np.exp(rng.uniform(np.log(128), np.log(2048))))
                )
            else:
                raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
            group = [rng.integers(0, vocab, n)]
        calls.append(group)
        total += sum(len(d) for d in group)
    return calls


def window_seed(w: int) -> int:
    """The seed of the documents of (c)'s timed windows for the `w`-th workload: the label
    and the full window score the same documents, and transformers' window paths time
    them too, so that (c)/(a) compares the two sides on the same documents. (A long-tailed
    pass of 65k tokens holds 0-3 documents of 16k-32k tokens; two draws differed by up to
    4x in attention per token, so a ratio across draws says little.)"""
    return 1000 * (w + 1) + 500


def docs_of(calls: list[list]) -> list:
    """The documents of a workload's calls, in submit order."""
    return [d for group in calls for d in group]


def forward_flops(cfg: dict, lengths: list[int], *, with_head: bool) -> float:
    """FLOPs of prefill forwards over documents of these lengths (see the module doc)."""
    if "n_routed_experts" in cfg:  # DeepSeek-V3 / GLM-4.5: MLA, shared experts, dense layers
        head = 2.0 * cfg["vocab_size"] * cfg["hidden_size"] * sum(lengths)
        return active_flops(model_spec(cfg), lengths) - (0.0 if with_head else head)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    if cfg.get("num_experts"):  # active weights: the router and the k experts a token takes
        ffn = (
            cfg["num_experts"] * h
            + cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
        )
    else:
        ffn = 3 * h * cfg["intermediate_size"]
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + ffn
    n_mm = layers * per_layer + (cfg["vocab_size"] * h if with_head else 0)
    attention = sum(layers * 2 * s**2 * heads * hd for s in lengths)
    return 2.0 * n_mm * sum(lengths) + attention


def _gib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**30, 3)


def _timed_passes(
    run_pass: Callable[[int], int], *, seeds: list[int], warmup_seed: int | None, cuda: bool
) -> dict:
    """Time `run_pass(seed)` (which returns the tokens it scored) once per seed after one
    warm-up pass (none where `warmup_seed` is None: the path ran just before); tokens/s over
    all timed passes, and the device peak."""
    import torch

    if warmup_seed is not None:
        run_pass(warmup_seed)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, tokens = [], 0
    for seed in seeds:
        t0 = time.perf_counter()
        tokens += run_pass(seed)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {
        "seconds": round(sum(times), 5),
        "tokens": tokens,
        "tok_s": tokens / sum(times),
        "times_s": [round(t, 4) for t in times],
        "peak_gib": _gib(torch.cuda.max_memory_allocated() if cuda else None),
        "peak_reserved_gib": _gib(torch.cuda.max_memory_reserved() if cuda else None),
    }


# --------------------------------------------------------------------------------------------
# (a) and (b): Hugging Face, in its own process
# --------------------------------------------------------------------------------------------


def hf_child(args: argparse.Namespace) -> None:
    """Build the HF model on the device and time (a) and (b) on every workload; print JSON."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = MODELS[args.model]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config = transformers_config(cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with device:  # parameters are created (and randomly initialised) on the device
        model = AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(torch.float32)
    model.eval().requires_grad_(False)
    weights = torch.cuda.memory_allocated() if cuda else None
    out = {"versions": versions(), "weights_gib": _gib(weights), "runs": {}}

    @torch.inference_mode()
    def path_a(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]

    @torch.inference_mode()
    def path_b(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state

    for w, name in enumerate(args.workloads):

        def run_pass(seed: int, fn, name=name, w=w) -> int:
            tokens = args.e2e_tokens if seed == window_seed(w) else args.pass_tokens
            docs = docs_of(workload(name, tokens=tokens, vocab=cfg["vocab_size"], seed=seed))
            for batch in padded_batches(docs, args.tokens_per_forward):
                ids, mask = padded_tensors(batch, device)
                fn(ids, mask)
            return sum(len(d) for d in docs)

        run = {}
        # the passes (the documents of ours (b')), then the documents of (c)'s windows
        for path, fn in (("hf", path_a), ("bare_hf", path_b)):
            run[path] = _timed_passes(
                lambda seed, fn=fn: run_pass(seed, fn),
                seeds=[100 + i for i in range(args.iters)],
                warmup_seed=99,
                cuda=cuda,
            )
            try:
                run[f"{path}_window"] = _timed_passes(
                    lambda seed, fn=fn: run_pass(seed, fn),
                    seeds=[window_seed(w)],
                    warmup_seed=None,  # warmed up by the passes just timed
                    cuda=cuda,
                )
            except torch.cuda.OutOfMemoryError as exc:  # a longer document than the pass's
                run[f"{path}_window_error"] = f"out of memory: {str(exc).splitlines()[0]}"
                torch.cuda.empty_cache()
        out["runs"][name] = run
    print(json.dumps(out))


# --------------------------------------------------------------------------------------------
# (c): the consumer process
# --------------------------------------------------------------------------------------------

# [start, end, tokens, recorded, launch_ms, launch_t0] of every batch while serving: recorded
# is 1 when the batch's launch recorded a CUDA graph, launch_ms the host time its launch took
# from launch_t0 (host clock).
SPANS: list[list[float]] = []
DEVICE_SPANS: list = []  # CUDA: (start event, end event, *the rest as SPANS) per batch
# (name, start, end) on the host clock of what the consumer's main thread did while serving,
# for what it was doing before a batch it launched late (`_host_steps`).
HOST_STEPS: list[tuple[str, float, float]] = []


def _quantize_linears(model) -> int:
    """Every tensor-parallel linear whose shape takes 128 x 128 blocks, block-quantized to
    FP8 as published FP8 checkpoints are, and run through the FP8 GEMM (`--fp8`); and every
    MoE layer's routed experts, run through the FP8 expert GEMMs, as an FP8 checkpoint's
    experts load (`hf_fp8_experts`). Latent attention's own linears and the shared experts
    stay bf16, as that load leaves them. Returns how many linears and expert stacks."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from consumer.checkpoints.hf_fp8_experts import hold_fp8_experts
    from consumer.checkpoints.hf_fp8_linears import make_fp8_linear
    from consumer.forward import fp8_gemm, moe_gemm
    from consumer.forward.moe import TeacherMoE

    n = 0
    for name, module in model.named_modules():
        if isinstance(module, TeacherMoE) and module.expert_scale("fc1") is None:
            fc1, fc2 = module.experts_fc1, module.experts_fc2  # [E, 2, f, h], [E, h, f]
            if fc1.shape[2] % fp8_gemm.GROUP or fc1.shape[3] % fp8_gemm.GROUP:
                continue
            q1, s1 = moe_gemm._quantize_experts(fc1.data.flatten(1, 2))
            q2, s2 = moe_gemm._quantize_experts(fc2.data)
            hold_fp8_experts(module, q1.view(fc1.shape), s1, q2, s2)
            del fc1, fc2, q1, q2  # the bf16 experts go with the last reference
            n += 2
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        if name.endswith("output_layer"):  # published FP8 checkpoints keep lm_head in bf16
            continue
        rows, cols = module.weight.shape
        if rows % fp8_gemm.GROUP or cols % fp8_gemm.GROUP:
            continue
        weight, scale = fp8_gemm.quantize_weight(module.weight.data)
        make_fp8_linear(module, weight, scale, (fp8_gemm.GROUP, fp8_gemm.GROUP))
        n += 1
    return n


def _randomize(model, seed: int) -> None:
    """Random weights on the device: N(0, 0.02) matrices and embeddings, unit norms, zero
    biases (the HF initialisation of the same shapes), without a checkpoint on disk."""
    import torch

    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:  # RMSNorm weights
                p.fill_(1.0)


def _jobs(calls: list[list], *, full: bool, tag: str) -> list:
    """Decoded jobs for a workload's documents, as the consumer would claim them."""
    from shared.messages import Job, TeacherRequest

    extra = {"top_k": TOP_K, "sample_n": SAMPLES, "return_entropy": True} if full else {}
    return [
        Job(
            job_id=f"direct-{tag}-{i}",
            entry_id="0-0",
            request=TeacherRequest(input_ids=d, seed=i, **extra),
            submitted_at=0,
        )
        for i, d in enumerate(docs_of(calls))
    ]


def _microbatches(jobs: list, budget: int) -> list:
    """The consumer's micro-batches of these jobs (shared prompts once), as tensors."""
    from consumer.forward.prefix import plan_shared_microbatches
    from consumer.group.batching import batch_from_jobs

    return [batch_from_jobs(mb) for mb in plan_shared_microbatches(jobs, token_budget=budget)]


def _kernel_busy(fn: Callable[[], object], cuda: bool) -> float | None:
    """Share of one call's wall time during which some kernel ran (torch.profiler, CUPTI)."""
    if not cuda:
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return round(busy * 1e-6 / wall, 4)


def _head_check(scorer, vocab: int) -> dict:
    """The consumer's outputs for one document against full-vocabulary PyTorch on the same
    hidden states: max |diff| of label log-probs, top-k log-probs and entropy."""
    import numpy as np
    import torch

    from consumer.group.batching import batch_from_jobs

    doc = np.random.default_rng(99).integers(0, vocab, 2048)
    batch = batch_from_jobs(_jobs([[doc]], full=True, tag="check"))
    got = scorer.score(batch)[0]
    hidden = scorer.hidden_states(batch)[:-1]
    logits = (hidden @ scorer.model.output_weight_shard().t()).float()[:, :vocab]
    logp = torch.log_softmax(logits, dim=-1)
    nxt = batch.input_ids_T[1:].to(logp.device)
    ref_lp = logp.gather(1, nxt[:, None]).squeeze(1).cpu()
    ref_top = logp.topk(TOP_K, dim=1).values.cpu()
    ref_ent = -(logp.exp() * logp).sum(1).cpu()
    return {
        "label_logprob_max_abs_diff": float(
            (torch.as_tensor(got["logprobs"]) - ref_lp).abs().max()
        ),
        "topk_logprob_max_abs_diff": float(
            (torch.as_tensor(got["topk_logprobs"]) - ref_top).abs().max()
        ),
        "entropy_max_abs_diff": float((torch.as_tensor(got["entropy"]) - ref_ent).abs().max()),
    }


def _score_pass(scorer, batches: list, host_s: list[float]) -> None:
    """Every batch through launch / result as the consumer runs them: the next batch is
    launched before the last is collected. Appends each launch's host time to `host_s`."""
    pending = None
    for b in batches:
        t0 = time.perf_counter()
        nxt = scorer.launch(b)
        host_s.append(time.perf_counter() - t0)
        if pending is not None:
            pending.result()
        pending = nxt
    if pending is not None:
        pending.result()


def _long_docs(scorer, args: argparse.Namespace, vocab: int) -> dict:
    """Single long documents with every output: seconds and device memory above the
    weights (peak allocated during the call minus what was allocated before)."""
    import numpy as np
    import torch

    out = {}
    cuda = scorer.device.type == "cuda"
    for n in args.long_docs:
        doc = np.random.default_rng(n).integers(0, vocab, n)
        batch = _microbatches(_jobs([[doc]], full=True, tag=f"long{n}"), args.tokens_per_forward)
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        scorer.score(batch[0])
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        extra = torch.cuda.max_memory_allocated() - base if cuda else None
        out[str(n)] = {"seconds": round(seconds, 4), "extra_gib": _gib(extra)}
    return out


def _direct(scorer, args: argparse.Namespace, cfg: dict) -> dict:
    """Device-bound rates in the consumer process before it serves, on every workload:
    (b') and (c-direct) with host time per batch, kernel occupancy, the head alone, single
    long documents and a numerical check."""
    import torch

    from consumer import tp_ops

    cuda = scorer.device.type == "cuda"
    vocab = cfg["vocab_size"]
    out: dict = {"versions": versions(), "kernels": _kernel_mode(args)}
    for name in args.workloads:
        res: dict = {"graphed": scorer.graphs is not None}

        def batches_of(seed: int, full: bool, name=name) -> tuple[list, int]:
            calls = workload(name, tokens=args.pass_tokens, vocab=vocab, seed=seed)
            jobs = _jobs(calls, full=full, tag=f"{name}{seed}")
            return _microbatches(jobs, args.tokens_per_forward), sum(map(len, docs_of(calls)))

        # (path, every output, documents): every path and pass gets documents of its own (no
        # layout seen twice), except the eager twin of direct_full, which scores direct_full's
        # documents again without CUDA graphs: graphs on and off side by side.
        paths = (
            ("bare_ours", False, 0),
            ("direct_label", False, 1),
            ("direct_full", True, 2),
            ("direct_full_eager", True, 2),
        )
        for path, full, k in paths:
            warm, seeds = 1000 * k + 99, [1000 * k + 100 + i for i in range(args.iters)]
            # Tensors are built before timing (the consumer's prefetcher does it off the loop).
            prepared = {s: batches_of(s, full) for s in [warm, *seeds]}
            host_s: list[float] = []

            def run_pass(seed: int, path=path, prepared=prepared, host_s=host_s) -> int:
                batches, tokens = prepared[seed]
                if path == "bare_ours":
                    for b in batches:
                        scorer.hidden_states(b)
                elif path == "direct_full_eager":
                    _score_pass(dataclasses.replace(scorer, graphs=None), batches, host_s)
                else:
                    _score_pass(scorer, batches, host_s)
                return tokens

            res[path] = _timed_passes(run_pass, seeds=seeds, warmup_seed=warm, cuda=cuda)
            batches = sum(len(prepared[s][0]) for s in seeds)
            res[path]["batches"] = batches
            if host_s:
                timed = host_s[len(prepared[warm][0]) :]  # after the warm-up pass
                res[path]["host_ms_per_batch"] = round(1e3 * statistics.mean(timed), 2)
                res[path]["device_ms_per_batch"] = round(1e3 * res[path]["seconds"] / batches, 2)
            del prepared
        one = batches_of(300, True)[0][0]
        res["busy_full"] = _kernel_busy(lambda b=one: scorer.score(b), cuda)
        out[name] = res
    # The head alone on one full batch's hidden states (fused kernels), as earlier runs.
    batch = _microbatches(
        _jobs(
            workload("fixed", tokens=args.tokens_per_forward, vocab=vocab, seed=5),
            full=True,
            tag="head",
        ),
        args.tokens_per_forward,
    )[0]
    hidden = scorer.hidden_states(batch)
    rows, dev = hidden.shape[0], scorer.device
    head_args = dict(
        shard=scorer.shard,
        tp_group=None,
        target_ids_TW=batch.input_ids_T[:, None].to(dev),
        inv_temperature_T=torch.ones(rows, device=dev),
        seed_T=torch.zeros(rows, dtype=torch.int64, device=dev),
        position_T=torch.arange(rows, device=dev),
        chunk_rows=scorer.chunk_rows,
    )
    kinds = {
        "label": dict(top_k=0, sample_n=0, want_entropy=False),
        "full": dict(top_k=TOP_K, sample_n=SAMPLES, want_entropy=True),
    }
    for kind, kw in kinds.items():
        out[f"head_{kind}"] = _timed_passes(
            lambda _seed, kw=kw, ha=head_args, h=hidden: (
                tp_ops.chunked_head(
                    hidden_TH=h,
                    weight_VH=scorer.model.output_weight_shard(),
                    call=tp_ops.HeadCall(**ha, **kw, fused=not args.no_fused),
                ),
                rows,
            )[1],
            seeds=[0, 1, 2],
            warmup_seed=0,
            cuda=cuda,
        )
    del hidden, head_args
    if args.long_docs:
        out["long"] = _long_docs(scorer, args, vocab)
    out["check"] = _head_check(scorer, vocab)
    return out


def _kernel_mode(args: argparse.Namespace) -> str:
    """The head's mode under --no-fused (the scorer's `fused_head`), by name."""
    return "reference (no fused kernels)" if args.no_fused else "fused"


def consumer_child(args: argparse.Namespace) -> int:
    """`python -m consumer` with the scorer swapped for a random-init model of the shape,
    built on the device; measures (b') and (c-direct) first, then serves until SIGTERM."""
    import torch

    import consumer.serve.service as service
    from consumer.forward.model import build_model
    from consumer.forward.scoring import Scorer
    from shared.log import configure_logging
    from shared.settings import load_settings

    settings = load_settings()
    configure_logging(level=settings.log.level, fmt=settings.log.format, rank=0)
    cfg = MODELS[args.model]
    spec = model_spec(cfg)
    report: dict = {}

    def build_scorer(settings, layout, path=None):
        device = service.pick_device(settings.consumer.device)
        t0 = time.perf_counter()
        # Zero-filled on the host, moved, then drawn on the device: no checkpoint on disk.
        model = build_model(
            spec, layout, params_dtype=torch.bfloat16, device=device, init_weights=False
        )
        _randomize(model, seed=1234)
        if args.fp8:
            report["fp8_linears"] = _quantize_linears(model)
        report["build_s"] = round(time.perf_counter() - t0, 2)
        cuda = device.type == "cuda"
        report["weights_gib"] = _gib(torch.cuda.memory_allocated() if cuda else None)
        graphs = service.graphed_forward(model, settings, layout, device)
        scorer = Scorer(
            model=model,
            spec=spec,
            layout=layout,
            device=device,
            chunk_rows=settings.consumer.head_chunk_rows,
            graphs=graphs,
            fused_head=not args.no_fused,
        )
        if "direct" not in report:
            report["direct"] = {} if args.no_direct else _direct(scorer, args, cfg)
            _instrument_scoring()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return scorer, f"random-qwen2.5-{args.model}"

    service.build_scorer = build_scorer
    try:
        return service.run(settings)
    finally:
        cuda = torch.cuda.is_available() and settings.consumer.device != "cpu"
        report["serve_peak_gib"] = _gib(torch.cuda.max_memory_allocated() if cuda else None)
        report["serve_peak_reserved_gib"] = _gib(torch.cuda.max_memory_reserved() if cuda else None)
        report["spans"] = _device_spans() if DEVICE_SPANS else SPANS
        report["host_steps"] = HOST_STEPS
        Path(args.out).write_text(json.dumps(report))


def _instrument_scoring() -> None:
    """Record when the device worked on each batch while serving, for idle time.

    On CUDA: an event queued before a batch's work (Scorer.launch) and one after it; the
    device reaches the first when it starts the batch (or finishes the one before) and the
    second when the batch is done, so their union over batches is the device's busy time even
    though the consumer queues a batch before collecting the previous one. Elsewhere: host
    times from launch to collection (PendingScore.result)."""
    import torch

    from consumer.forward.scoring import PendingScore, Scorer

    launch, result = Scorer.launch, PendingScore.result
    started: dict[int, float] = {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
        torch.cuda.synchronize()
        DEVICE_SPANS.append((ref, time.time()))  # the reference: its event and host time

    def launch_timed(self, batch, clock=None):
        t0 = time.time()
        captures = self.graphs.captures if self.graphs is not None else 0
        if self.device.type == "cuda":
            before = torch.cuda.Event(enable_timing=True)
            before.record()
        pending = launch(self, batch, clock)
        if self.device.type == "cuda":
            after = torch.cuda.Event(enable_timing=True)
            after.record()
        recorded = int(self.graphs is not None and self.graphs.captures > captures)
        launch_ms = 1e3 * (time.time() - t0)
        if self.device.type == "cuda":
            DEVICE_SPANS.append((before, after, int(batch.num_tokens), recorded, launch_ms, t0))
        started[id(pending)] = (t0, recorded, launch_ms)
        return pending

    def result_timed(self):
        try:
            return result(self)
        finally:
            t0, recorded, launch_ms = started.pop(id(self), (time.time(), 0, 0.0))
            SPANS.append([t0, time.time(), int(self.batch.num_tokens), recorded, launch_ms, t0])

    Scorer.launch = launch_timed
    PendingScore.result = result_timed
    _instrument_host_steps()


def _instrument_host_steps() -> None:
    """Time the serving loop's steps on the consumer's main thread (HOST_STEPS), and the
    garbage collector's passes there."""
    import gc
    import threading

    from consumer.forward import scoring
    from consumer.serve import batch_runner, claims, control, intake, leader, prefetch, retention

    main = threading.main_thread()
    steps = {
        "launch": (scoring.Scorer, "launch"),
        "wait for results": (scoring.PendingScore, "result"),
        "finish (store)": (batch_runner.BatchRunner, "_finish"),
        "claimed entries": (prefetch.Prefetcher, "get"),
        "plan": (leader, "plan_shared_microbatches"),
        "pack": (batch_runner, "batch_from_jobs"),
        "hand to writers": (batch_runner.BatchRunner, "_submit"),
        "delivery counts": (claims.Claimer, "delivery_counts"),
        "admit": (intake.Intake, "admit"),
        "control": (control.Control, "check"),
        "trim": (retention.Janitor, "maybe_trim"),
    }
    for name, (owner, attr) in steps.items():
        fn = getattr(owner, attr)

        def timed(*a, _fn=fn, _name=name, **kw):
            if threading.current_thread() is not main:
                return _fn(*a, **kw)
            t0 = time.time()
            try:
                return _fn(*a, **kw)
            finally:
                HOST_STEPS.append((_name, t0, time.time()))

        setattr(owner, attr, timed)
    gc_start: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if threading.current_thread() is not main:
            return
        if phase == "start":
            gc_start[:] = [time.time()]
        elif gc_start:
            HOST_STEPS.append((f"gc gen{info.get('generation')}", gc_start[0], time.time()))

    gc.callbacks.append(on_gc)


def _device_spans() -> list[list[float]]:
    """DEVICE_SPANS as SPANS are: [start, end, tokens, recorded, launch_ms, launch_t0], on
    the host clock."""
    import torch

    torch.cuda.synchronize()
    (ref, t_ref), batches = DEVICE_SPANS[0], DEVICE_SPANS[1:]
    return [
        [t_ref + ref.elapsed_time(a) / 1e3, t_ref + ref.elapsed_time(b) / 1e3, *rest]
        for a, b, *rest in batches
    ]


def _child_args(args: argparse.Namespace, role: str, model: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--model", model]
    cmd += ["--workloads", ",".join(args.workloads), "--iters", str(args.iters)]
    cmd += ["--tokens-per-forward", str(args.tokens_per_forward), "--device", args.device]
    cmd += ["--pass-forwards", str(args.pass_forwards)]
    if args.long_docs:
        cmd += ["--long-docs", ",".join(map(str, args.long_docs))]
    if args.no_fused:
        cmd.append("--no-fused")
    return cmd


def _run_hf(args: argparse.Namespace, model: str) -> dict:
    done = subprocess.run(_child_args(args, "hf", model), capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"HF child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _wait_ready(client, proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = [c.get("state") for c in client.consumers().values()]
        if any(s in ("ready", "busy") for s in states):
            return
        if proc.poll() is not None:
            raise RuntimeError(
                f"consumer exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError("the consumer did not become ready")
        time.sleep(0.2)


def _submit_and_wait(client, calls: list[list], timeout: float) -> tuple[float, float, list]:
    """Submit each call as a trainer would (a GRPO group per call), then wait for all."""
    t0 = time.time()
    ids = [job_id for reqs in calls for job_id in client.submit(reqs)]
    results = client.wait(ids, timeout=timeout, progress=False)
    return t0, time.time(), results


def _inside(spans: list, t0: float, t1: float) -> list:
    """The spans of batches served within [t0, t1], by start."""
    return sorted(s for s in spans if s[0] >= t0 and s[1] <= t1)


def _gaps(inside: list) -> list[tuple[int, float]]:
    """(i, seconds) for each stretch with no batch queued, ending where batch i of `inside`
    starts. Batches overlap (one is queued while the previous is collected), so a gap is
    time after every earlier batch ended."""
    gaps, end = [], float("-inf")
    for i, (s, e, *_rest) in enumerate(inside):
        if i and s > end:
            gaps.append((i, s - end))
        end = max(end, e)
    return gaps


def _serve_window(spans: list, t0: float, t1: float) -> dict:
    inside = _inside(spans, t0, t1)
    if not inside:
        return {}
    gaps = _gaps(inside)
    first, last = inside[0][0], max(s[1] for s in inside)
    span = last - first
    busy = span - sum(g for _, g in gaps)  # the union of the batches' spans
    # A gap is put down to a recording when it ends at a batch whose launch recorded a CUDA
    # graph, or at the batch after it (the host is then still catching up).
    recorded_gaps = sum(g for i, g in gaps if inside[i][3] or inside[i - 1][3])
    launch = {flag: [s[4] for s in inside if s[3] == flag] for flag in (0, 1)}
    return {
        "batches": len(inside),
        "busy_s": round(busy, 4),
        # Device idle between batches: time from the first batch's start to the last batch's
        # end during which no batch was between launch and collection.
        "idle_between_batches": round(1 - busy / span, 4),
        # The same, less the gaps at a recording: what a consumer idles once its buckets
        # are recorded.
        "idle_between_unrecorded": round(1 - (busy + recorded_gaps) / span, 4),
        "gaps": len(gaps),
        "max_gap_ms": round(1e3 * max((g for _, g in gaps), default=0.0), 1),
        # Host time of a batch's launch, replayed (or eager) against recording a graph.
        "launch_ms": round(statistics.mean(launch[0]), 1) if launch[0] else None,
        "launch_ms_recording": round(statistics.mean(launch[1]), 1) if launch[1] else None,
        # Everything that is not scoring in the client's view: submit, queue, store, wait.
        "idle_end_to_end": round(1 - busy / (t1 - t0), 4),
        # Of that: before the first batch (submit, claim) and after the last (store, wait).
        "fill_ms": round(1e3 * (first - t0), 1),
        "drain_ms": round(1e3 * (t1 - last), 1),
    }


def _host_steps(spans: list, steps: list, window: dict, min_gap_s: float = 0.002) -> dict:
    """What the consumer's main thread did before each batch it launched too late (the
    device had run out of work for more than `min_gap_s`): host seconds per step between the
    previous launch's end and the late launch's start, summed over those gaps (steps may
    nest: "finish (store)" holds "wait for results")."""
    inside = _inside(spans, window["t0"], window["t1"])
    late: dict[str, float] = {}
    gaps = 0
    for i, gap in _gaps(inside):
        if gap <= min_gap_s:
            continue
        gaps += 1
        prev = inside[i - 1]
        since, until = prev[5] + prev[4] / 1e3, inside[i][5]
        late["(gap)"] = late.get("(gap)", 0.0) + gap
        host = "(host, previous launch to this one)"
        late[host] = late.get(host, 0.0) + (until - since)
        for name, t0, t1 in steps:
            if t1 > since and t0 < until:
                late[name] = late.get(name, 0.0) + min(t1, until) - max(t0, since)
    return {"gaps": gaps, **{k: round(1e3 * v, 1) for k, v in late.items()}}


def _capture_times(log_path: Path) -> list[float]:
    """When the consumer recorded a CUDA graph (its `cuda_graphs.captured` log lines)."""
    from datetime import datetime

    times = []
    for line in log_path.read_text().splitlines():
        if "cuda_graphs.captured" not in line:
            continue
        try:
            times.append(datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp())
        except (ValueError, KeyError):
            continue
    return times


def run_e2e(
    args: argparse.Namespace,
    model: str,
    tmp: Path,
    overrides: dict[str, int] | None = None,
) -> dict:
    """Start valkey and a consumer process, submit and wait for (c); returns its numbers.
    `overrides`: consumer settings of a variant (`--e2e-variants`), which serves the same
    windows without the (b') / (c-direct) passes."""
    from producer import TeacherClient
    from shared.messages import TeacherRequest
    from shared.redis_server import ensure_embedded, stop_embedded
    from shared.settings import Settings

    overrides = None if overrides is None else dict(overrides)
    fp8 = bool(overrides and overrides.pop("fp8", 0))  # the model's linears in FP8
    home = tmp / "valkey"
    url, _ = ensure_embedded(home)
    try:
        settings = Settings(
            redis={"url": url, "home": str(home)},
            queue={"name": f"bench-{model.replace('.', '')}"},
            storage={"url": f"file://{tmp / 'objects'}"},
            model={"dtype": "bfloat16"},
            consumer={
                "token_budget": args.tokens_per_forward,
                "head_chunk_rows": args.head_chunk_rows,
                "cuda_graphs": args.cuda_graphs,
                "device": args.device,
                "store_threads": 4,
                "block_ms": 200,
                **(overrides or {}),
            },
            log={"format": "json", "level": "info"},
        )
        out_json = tmp / f"consumer-{model}.json"
        log_path = tmp / f"consumer-{model}.log"
        env = child_env(settings)
        cmd = _child_args(args, "consumer", model) + ["--out", str(out_json)]
        cmd += [] if overrides is None else ["--no-direct"]
        cmd += ["--fp8"] if fp8 else []
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT)
        client = TeacherClient(settings)
        windows: dict = {}
        try:
            _wait_ready(client, proc, log_path, timeout=1800)
            vocab = MODELS[model]["vocab_size"]
            for w, name in enumerate(args.workloads):
                for kind in ("label", "full"):
                    extra = (
                        {"top_k": TOP_K, "sample_n": SAMPLES, "return_entropy": True}
                        if kind == "full"
                        else {}
                    )

                    def calls(seed: int, tokens: int, extra=extra, name=name) -> list[list]:
                        docs = workload(name, tokens=tokens, vocab=vocab, seed=seed)
                        return [
                            [TeacherRequest(input_ids=d, seed=i, **extra) for i, d in enumerate(c)]
                            for c in docs
                        ]

                    warm_seed = 1000 * (w + 1) + (kind == "full")
                    warm_tokens = args.e2e_warmup_forwards * args.tokens_per_forward
                    _submit_and_wait(client, calls(warm_seed, warm_tokens), 1800)
                    timed = calls(window_seed(w), args.e2e_tokens)
                    t0, t1, results = _submit_and_wait(client, timed, timeout=1800)
                    bad = [r for r in results if r.error]
                    if bad:
                        raise RuntimeError(f"{len(bad)} jobs failed: {bad[0].error}")
                    windows[f"{name}_{kind}"] = {
                        "t0": t0,
                        "t1": t1,
                        "seconds": round(t1 - t0, 4),
                        "tokens": sum(r.num_tokens for c in timed for r in c),
                        "jobs": len(results),
                    }
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            client.close()
        if not out_json.exists():
            raise RuntimeError(f"consumer wrote no report:\n{log_path.read_text()[-4000:]}")
        report = json.loads(out_json.read_text())
        captured = _capture_times(log_path)
        for w in windows.values():
            w.update(_serve_window(report["spans"], w["t0"], w["t1"]))
            w["late_launches"] = _host_steps(report["spans"], report["host_steps"], w)
            # Recording a new bucket costs the host about one eager launch: say how many a
            # window holds (a long-running consumer has recorded its buckets).
            w["graphs_recorded"] = sum(w["t0"] <= t <= w["t1"] for t in captured)
        report["windows"] = windows
        report.pop("spans")
        report.pop("host_steps")
        return report
    finally:
        stop_embedded(home)


def _row(name: str, run: dict | None, flops_per_token: float) -> dict:
    if not run:
        return {"path": name}
    return {
        "path": name,
        "tok_s": run["tok_s"],
        "mfu": run["tok_s"] * flops_per_token / PEAK_FLOPS,
        "peak_gib": run.get("peak_gib"),
    }


# Targets of the issue on lengths uniform in 512-4096 ((c)/(a), label and every output).
TARGETS = {"1.5b": {"label": 2.0, "full": 1.8}, "7b": {"label": 1.5, "full": 1.3}}


def _flops_of(cfg: dict, name: str, seed: int, tokens: int) -> tuple[list[int], float, float]:
    """The lengths of a workload's documents, and FLOPs per token with and without the head."""
    docs = docs_of(workload(name, tokens=tokens, vocab=cfg["vocab_size"], seed=seed))
    lengths = [len(d) for d in docs]
    n = sum(lengths)
    return (
        lengths,
        forward_flops(cfg, lengths, with_head=True) / n,
        forward_flops(cfg, lengths, with_head=False) / n,
    )


def _window_rows(h: dict, fl_head: float, fl_bare: float) -> tuple[list[dict], list[str]]:
    """Rows of transformers' (a) and (b) on (c)'s documents (HF JSON `h` of one workload),
    and a note for each that ran out of memory (c/a and c/b then fall back to the pass)."""
    rows, notes = [], []
    for path, label, fl in (("hf", "(a)", fl_head), ("bare_hf", "(b)", fl_bare)):
        if f"{path}_window" in h:
            rows.append(_row(f"{label} on (c)'s documents", h[f"{path}_window"], fl))
        elif f"{path}_window_error" in h:
            notes.append(f"{label} on (c)'s documents: {h[f'{path}_window_error']}; c/a and "
                         "c/b below are against the pass's documents")  # fmt: skip
    return rows, notes


def summarize(args: argparse.Namespace, model: str, hf: dict, e2e: dict) -> list[str]:
    """Human-readable table and ratios for one model."""
    import numpy as np

    cfg = MODELS[model]
    lines = []
    rates: dict[str, dict[str, float]] = {}
    for i, name in enumerate(args.workloads):
        lengths, fl_head, fl_bare = _flops_of(cfg, name, 100, args.pass_tokens)
        windowed, fl_head_w, fl_bare_w = _flops_of(cfg, name, window_seed(i), args.e2e_tokens)
        h, d = hf["runs"][name], e2e["direct"][name]
        rows = [
            _row("(a) hf fwd+fp32 log_softmax", h["hf"], fl_head),
            _row("(b) bare fwd, HF", h["bare_hf"], fl_bare),
            _row("(b') bare fwd, ours (thd)", d["bare_ours"], fl_bare),
            _row("(c-direct) score label", d["direct_label"], fl_head),
            _row("(c-direct) score full", d["direct_full"], fl_head),
        ]
        if "direct_full_eager" in d:  # a teacher served without graphs (MoE) has no A/B here
            twin = "no graphs" if d.get("graphed", True) else "seen again"
            rows.append(_row(f"(c-direct e) full, {twin}", d["direct_full_eager"], fl_head))
        windowed_rows, notes = _window_rows(h, fl_head_w, fl_bare_w)
        rows += windowed_rows
        for kind in ("label", "full"):
            w = e2e["windows"][f"{name}_{kind}"]
            run = {"tok_s": w["tokens"] / w["seconds"], "peak_gib": e2e.get("serve_peak_gib")}
            rows.append(_row(f"(c) e2e {kind}", run, fl_head_w))
        lines.append(
            f"\nmodel {model}  workload {name}  ({len(lengths)} documents a pass, mean "
            f"{np.mean(lengths):.0f} tokens, max {max(lengths)}; (c)'s window {len(windowed)} "
            f"documents, mean {np.mean(windowed):.0f}, max {max(windowed)}; tokens/forward "
            f"{args.tokens_per_forward})"
        )
        lines += notes
        lines.append(f"{'path':<32}{'tok/s':>11}{'MFU':>8}{'peak GiB':>10}")
        for r in rows:
            if "tok_s" in r:
                peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
                lines.append(f"{r['path']:<32}{r['tok_s']:>11.0f}{r['mfu']:>8.1%}{peak:>10}")
        by = {r["path"]: r for r in rows}
        # (c) against transformers on its own documents where that ran (older HF JSON: the
        # passes' documents)
        a = by.get("(a) on (c)'s documents", by["(a) hf fwd+fp32 log_softmax"])
        b = by.get("(b) on (c)'s documents", by["(b) bare fwd, HF"])
        rates[name] = {}
        for kind in ("label", "full"):
            c = by[f"(c) e2e {kind}"]
            rates[name][kind] = c["tok_s"]
            target = TARGETS.get(model, {}).get(kind) if name == "uniform" else None
            lines += _e2e_lines(kind, c, a, b, e2e["windows"][f"{name}_{kind}"], target)
        lines += _host_lines(d)
        if d.get("busy_full") is not None:
            lines.append(f"kernel busy inside one Scorer.score call (full): {d['busy_full']:.1%}")
    if "fixed" in rates:
        for name in rates:
            if name != "fixed":
                lines.append(
                    f"{name} vs fixed, (c) tokens/s: label "
                    f"{rates[name]['label'] / rates['fixed']['label']:.3f}, full "
                    f"{rates[name]['full'] / rates['fixed']['full']:.3f} (target >= 0.9)"
                )
    direct = e2e["direct"]
    lines.append(
        "head alone (s, one forward's rows): "
        + ", ".join(
            f"{k[5:]} {direct[k]['seconds'] / 3:.4f}" for k in direct if k.startswith("head_")
        )
    )
    if "long" in direct:
        lines.append(
            "single long documents, every output (memory above the weights): "
            + ", ".join(
                f"{n} tokens {v['seconds']:.2f} s {v['extra_gib']} GiB"
                for n, v in direct["long"].items()
            )
        )
    lines.append(f"check vs full-vocab PyTorch: {json.dumps(direct['check'])}")
    return lines


def _host_lines(d: dict) -> list[str]:
    """Host and device time per batch of the direct runs that measured them."""
    return [
        f"{path}: host {d[path]['host_ms_per_batch']} ms / device "
        f"{d[path]['device_ms_per_batch']} ms per batch ({d[path]['batches']} batches)"
        for path in ("direct_label", "direct_full", "direct_full_eager")
        if "host_ms_per_batch" in d.get(path, {})
    ]


def _e2e_lines(kind: str, c: dict, a: dict, b: dict, w: dict, target: float | None) -> list[str]:
    """The lines of one end-to-end run `c` (its window `w`) against the baselines a and b."""
    lines = [
        f"(c) {kind}: c/a {c['tok_s'] / a['tok_s']:.3f}"
        + (f" (target >= {target})" if target else "")
        + f", c/b {c['tok_s'] / b['tok_s']:.3f}, peak c/b "
        f"{(c['peak_gib'] or 0) / (b['peak_gib'] or 1):.3f}, device idle between "
        f"batches {w.get('idle_between_batches', float('nan')):.2%} "
        f"({w.get('batches')} batches, {w['jobs']} jobs, "
        f"{w.get('graphs_recorded', 0)} graphs recorded), end to end "
        f"{w.get('idle_end_to_end', float('nan')):.2%} (target <= 2%)",
        f"(c) {kind}: {_gap_line(w)}",
    ]
    if w.get("late_launches", {}).get("gaps"):
        lines.append(f"(c) {kind}: late launches, host ms: {json.dumps(w['late_launches'])}")
    return lines


def _gap_line(w: dict) -> str:
    """Where a window's idle went: the gaps at recordings, and the host's launches."""
    unrecorded = w.get("idle_between_unrecorded", float("nan"))
    return (
        f"idle between batches less recording gaps {unrecorded:.2%}"
        f" ({w.get('gaps')} gaps, longest {w.get('max_gap_ms')} ms); launch host "
        f"{w.get('launch_ms')} ms, recording {w.get('launch_ms_recording')} ms"
    )


def _variant(text: str) -> dict[str, int]:
    """'cuda_graphs=0,batches_in_flight=1' -> consumer setting overrides."""
    pairs = [kv.split("=", 1) for kv in text.split(",") if kv.strip()]
    return {k.strip(): int(v) for k, v in pairs}


def _label(overrides: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in overrides.items())


def _variant_lines(args: argparse.Namespace, hf: dict, e2e: dict) -> list[str]:
    """(c) of every variant next to the default consumer's, window by window."""
    lines = []
    runs = {"default": e2e, **e2e.get("variants", {})}
    if len(runs) == 1:
        return lines
    lines.append(f"\n(c) side by side: {' | '.join(runs)}")
    for name in args.workloads:
        run_a = hf["runs"][name]
        a = run_a.get("hf_window", run_a["hf"])["tok_s"]  # on (c)'s documents where it ran
        for kind in ("label", "full"):
            cells = []
            for run in runs.values():
                w = run["windows"][f"{name}_{kind}"]
                tok_s = w["tokens"] / w["seconds"]
                cells.append(
                    f"{tok_s / 1e3:.1f}k tok/s c/a {tok_s / a:.2f} idle "
                    f"{w.get('idle_between_batches', float('nan')):.1%} / "
                    f"{w.get('idle_end_to_end', float('nan')):.1%} (fill {w.get('fill_ms')} "
                    f"drain {w.get('drain_ms')} ms) rec {w.get('graphs_recorded')}; " + _gap_line(w)
                )
            lines.append(f"{name} {kind}: " + " | ".join(cells))
    return lines


def main() -> None:
    MODELS.update({m: frontier(**how) for m, how in FRONTIER.items()})
    MODELS["30b-a3b-16l"] = {**MODELS["30b-a3b"], "num_hidden_layers": 16}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="1.5b,7b", help=f"of {','.join(MODELS)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {WORKLOADS}")
    parser.add_argument("--tokens-per-forward", type=int, default=16384)
    parser.add_argument(
        "--pass-forwards", type=int, default=8, help="forwards' worth of tokens a timed pass"
    )
    parser.add_argument("--iters", type=int, default=2, help="timed passes per path")
    parser.add_argument(
        "--e2e-forwards", type=int, default=24, help="forwards' worth of jobs per (c) window"
    )
    parser.add_argument(
        "--e2e-warmup-forwards",
        type=int,
        default=16,
        help="forwards' worth of jobs served before each (c) window (new CUDA graph buckets "
        "are recorded there, as a long-running consumer has them)",
    )
    parser.add_argument(
        "--long-docs", default="", help="single documents to score, e.g. 32768,65536"
    )
    parser.add_argument(
        "--head-chunk-rows",
        type=int,
        default=4096,
        help="TEACHERQ_CONSUMER__HEAD_CHUNK_ROWS of the consumer (its default is 1024)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-out", help="write every number here as JSON")
    parser.add_argument(
        "--cuda-graphs",
        type=int,
        default=128,
        help="TEACHERQ_CONSUMER__CUDA_GRAPHS of the consumer (0: eager forwards only)",
    )
    parser.add_argument(
        "--e2e-variants",
        default="",
        help="more (c) consumers serving the same windows, side by side: ';'-separated "
        "consumer settings, e.g. 'cuda_graphs=0;batches_in_flight=1'; 'fp8=1' serves the "
        "model with its linears block-quantized to FP8",
    )
    parser.add_argument(
        "--no-fused", action="store_true", help="the PyTorch reference head, no Triton kernels"
    )
    parser.add_argument("--no-direct", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fp8", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("hf", "consumer"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.workloads = [w for w in str(args.workloads).split(",") if w]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {WORKLOADS}")
    args.long_docs = [int(n) for n in str(args.long_docs).split(",") if n]
    args.e2e_variants = [_variant(v) for v in str(args.e2e_variants).split(";") if v.strip()]
    args.pass_tokens = args.pass_forwards * args.tokens_per_forward
    args.e2e_tokens = args.e2e_forwards * args.tokens_per_forward
    if args.role == "hf":
        hf_child(args)
        return
    if args.role == "consumer":
        sys.exit(consumer_child(args))

    from shared.log import configure_logging

    configure_logging(level="warning", fmt="console", rank=0)  # the client's logs stay quiet
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    everything: dict = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for model in models:
        t0 = time.perf_counter()
        hf = _run_hf(args, model)
        with tempfile.TemporaryDirectory() as tmp:
            e2e = run_e2e(args, model, Path(tmp))
        variants = {}
        for overrides in args.e2e_variants:
            with tempfile.TemporaryDirectory() as tmp:
                variants[_label(overrides)] = run_e2e(args, model, Path(tmp), overrides)
        e2e["variants"] = variants
        everything[model] = {"config": MODELS[model], "hf": hf, "e2e": e2e,
                             "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
        print(f"versions: hf side {json.dumps(hf['versions'])}", flush=True)
        print(f"head kernels: {e2e['direct'].get('kernels')}", flush=True)
        print(
            f"weights GiB: hf {hf['weights_gib']}, consumer {e2e.get('weights_gib')}; "
            f"consumer build {e2e.get('build_s')} s; wall {everything[model]['wall_s']} s",
            flush=True,
        )
        print("\n".join(summarize(args, model, hf, e2e)), flush=True)
        print("\n".join(_variant_lines(args, hf, e2e)), flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
