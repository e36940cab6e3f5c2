"""Teacher throughput end to end on one GPU: Hugging Face vs the bare forward vs teacherq.

Random-init models of the Qwen2.5-1.5B and Qwen2.5-7B shapes in bf16, documents of `--seqlens`
tokens packed `--tokens-per-forward` tokens to a forward, the same for every path:

  (a) hf     transformers Qwen2ForCausalLM, attn_implementation="sdpa", batch [B, S]: the
             forward with logits, a full-vocabulary fp32 log_softmax and a gather of the
             next-token log-probs -- what a user would write;
  (b) bare   the forward to the final hidden states only, HF `model.model(...)` -- the ceiling;
      (b')   the same for teacherq's TeacherGPTModel on a packed (thd) batch, with CUDA
             graphs as the consumer serves it; (b'e) the same, eager;
  (c) e2e    teacherq end to end: an embedded valkey-server, a real consumer process
             (`consumer.service.run`, serving a random-init TeacherGPTModel built on the
             device), jobs submitted with TeacherClient and waited for, results through
             Redis and file:// object storage. Once for next-token log-probs only ("label"),
             once with top-k 64, 8 samples and the entropy as well ("full").
             (c-direct) is Scorer.score called back to back in the consumer process: the
             device-bound rate of (c) without the queue.

Each side runs in its own process (HF in one, the consumer in another), so each peak of
device memory (torch.cuda.max_memory_allocated, weights included) belongs to one path.

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

    python bench/gpu_e2e.py --models 1.5b,7b --seqlens 2048,8192 --tokens-per-forward 16384
    python bench/gpu_e2e.py --models tiny --seqlens 64 --tokens-per-forward 256 --iters 2 \\
        --device cpu                                    # a smoke test of the plumbing
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
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

PEAK_FLOPS = 790e12
TOP_K, SAMPLES = 64, 8

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


# --------------------------------------------------------------------------------------------
# Arithmetic
# --------------------------------------------------------------------------------------------


def forward_flops(cfg: dict, *, seqlen: int, tokens: int, with_head: bool) -> float:
    """FLOPs of one prefill forward over `tokens` tokens in documents of `seqlen` (see doc)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * cfg["intermediate_size"]
    n_mm = layers * per_layer + (cfg["vocab_size"] * h if with_head else 0)
    attention = layers * (tokens // seqlen) * 2 * seqlen**2 * heads * hd
    return 2.0 * n_mm * tokens + attention


def _gib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**30, 3)


def _timed(fn: Callable[[], object], *, iters: int, warmup: int, cuda: bool) -> dict:
    """Median/min seconds of fn over `iters` runs after `warmup`, and the device peak."""
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out
    peak = torch.cuda.max_memory_allocated() if cuda else None
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "times_s": [round(t, 5) for t in times],
        "peak_gib": _gib(peak),
        "peak_reserved_gib": _gib(reserved),
    }


def _versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "triton", "megatron.core"):
        try:
            mod = __import__(name, fromlist=["__version__"])
            out[name] = getattr(mod, "__version__", "?")
        except ImportError:
            out[name] = None
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
    return out


# --------------------------------------------------------------------------------------------
# (a) and (b): Hugging Face, in its own process
# --------------------------------------------------------------------------------------------


def hf_child(args: argparse.Namespace) -> None:
    """Build the HF model on the device and time (a) and (b) for every seqlen; print JSON."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = MODELS[args.model]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config = Qwen2Config(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with device:  # parameters are created (and randomly initialised) on the device
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.eval().requires_grad_(False)
    weights = torch.cuda.memory_allocated() if cuda else None
    out = {"versions": _versions(), "weights_gib": _gib(weights), "runs": {}}

    @torch.inference_mode()
    def path_a(ids: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=ids, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)

    @torch.inference_mode()
    def path_b(ids: torch.Tensor) -> torch.Tensor:
        return model.model(input_ids=ids, use_cache=False).last_hidden_state

    for seqlen in args.seqlens:
        gen = torch.Generator(device=device).manual_seed(seqlen)
        ids = torch.randint(
            0, cfg["vocab_size"], (args.tokens_per_forward // seqlen, seqlen),
            generator=gen, device=device,
        )  # fmt: skip
        run = {}
        for name, fn in (("hf", path_a), ("bare_hf", path_b)):

            def call(fn=fn, ids=ids):
                return fn(ids)

            run[name] = _timed(call, iters=args.iters, warmup=2, cuda=cuda)
        out["runs"][str(seqlen)] = run
    print(json.dumps(out))


# --------------------------------------------------------------------------------------------
# (c): the consumer process
# --------------------------------------------------------------------------------------------

SPANS: list[list[float]] = []  # [start, end, tokens] of every batch while serving
DEVICE_SPANS: list = []  # CUDA: (start event, end event, tokens) of every batch while serving


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


def _jobs(vocab: int, *, seqlen: int, count: int, full: bool, seed: int) -> list:
    import numpy as np

    from shared.messages import Job, TeacherRequest

    rng = np.random.default_rng(seed)
    extra = {"top_k": TOP_K, "sample_n": SAMPLES, "return_entropy": True} if full else {}
    return [
        Job(
            job_id=f"direct-{seed}-{i}",
            entry_id="0-0",
            request=TeacherRequest(
                input_ids=rng.integers(0, vocab, seqlen).tolist(), seed=i, **extra
            ),
            submitted_at=0,
        )
        for i in range(count)
    ]


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


def _head_check(scorer, vocab: int, seqlen: int) -> dict:
    """The consumer's outputs for one document against full-vocabulary PyTorch on the same
    hidden states: max |diff| of label log-probs, top-k log-probs and entropy."""
    import torch

    from consumer.batching import batch_from_jobs

    batch = batch_from_jobs(_jobs(vocab, seqlen=min(seqlen, 2048), count=1, full=True, seed=99))
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
        "mean_sampled_logprob": float(got["sampled_logprobs"].mean()),
        "mean_entropy": float(ref_ent.mean()),
    }


def _direct(scorer, args: argparse.Namespace, cfg: dict) -> dict:
    """Device-bound rates in the consumer process before it serves: (b'), (c-direct), the head
    alone (fused kernels and reference path), kernel occupancy, and a numerical check."""
    import torch

    from consumer import tp_ops
    from consumer.batching import batch_from_jobs

    cuda = scorer.device.type == "cuda"
    vocab = cfg["vocab_size"]
    out: dict = {"versions": _versions(), "kernels": _kernel_mode(args)}
    for seqlen in args.seqlens:
        count = args.tokens_per_forward // seqlen
        label = batch_from_jobs(_jobs(vocab, seqlen=seqlen, count=count, full=False, seed=1))
        full = batch_from_jobs(_jobs(vocab, seqlen=seqlen, count=count, full=True, seed=2))
        res: dict = {}
        t = dict(iters=args.iters, warmup=2, cuda=cuda)
        res["bare_ours"] = _timed(lambda b=label: scorer.hidden_states(b), **t)
        res["direct_label"] = _timed(lambda b=label: scorer.score(b), **t)
        res["direct_full"] = _timed(lambda b=full: scorer.score(b), **t)
        res["busy_label"] = _kernel_busy(lambda b=label: scorer.score(b), cuda)
        res["busy_full"] = _kernel_busy(lambda b=full: scorer.score(b), cuda)
        if scorer.graphs is not None:  # the same without CUDA graphs, for comparison
            e = dataclasses.replace(scorer, graphs=None)
            res["bare_ours_eager"] = _timed(lambda b=label, e=e: e.hidden_states(b), **t)
            res["direct_label_eager"] = _timed(lambda b=label, e=e: e.score(b), **t)
            res["direct_full_eager"] = _timed(lambda b=full, e=e: e.score(b), **t)
            res["busy_label_eager"] = _kernel_busy(lambda b=label, e=e: e.score(b), cuda)
        out[str(seqlen)] = res
        if seqlen != args.seqlens[0]:
            continue  # the head does not depend on the document length
        # The head alone on the same hidden states: fused kernels against the reference path.
        hidden = scorer.hidden_states(full)
        rows = hidden.shape[0]
        dev = scorer.device
        head_args = dict(
            hidden_TH=hidden,
            weight_VH=scorer.model.output_weight_shard(),
            shard=scorer.shard,
            tp_group=None,
            target_ids_TW=full.input_ids_T[:, None].to(dev),
            inv_temperature_T=torch.ones(rows, device=dev),
            seed_T=torch.zeros(rows, dtype=torch.int64, device=dev),
            position_T=torch.arange(rows, device=dev),
            chunk_rows=scorer.chunk_rows,
        )
        kinds = {
            "label": dict(top_k=0, sample_n=0, want_entropy=False),
            "full": dict(top_k=TOP_K, sample_n=SAMPLES, want_entropy=True),
            "samples_only": dict(top_k=0, sample_n=SAMPLES, want_entropy=False),
        }
        for fused in (True, False):
            use_kernels = fused and not args.no_fused
            for kind, kw in kinds.items():
                n = args.iters if fused else 1  # the reference path takes seconds a call
                res[f"head_{kind}_{'fused' if fused else 'reference'}"] = _timed(
                    lambda kw=kw, ha=head_args, f=use_kernels: tp_ops.chunked_head(
                        **ha, **kw, fused=f
                    ),
                    iters=n,
                    warmup=1 if fused else 0,
                    cuda=cuda,
                )
        del hidden
    out["check"] = _head_check(scorer, vocab, args.seqlens[0])
    return out


def _kernel_mode(args: argparse.Namespace) -> str:
    """The head's mode under --no-fused (the scorer's `fused_head`), by name."""
    return "reference (no fused kernels)" if args.no_fused else "fused"


def consumer_child(args: argparse.Namespace) -> int:
    """`python -m consumer` with the scorer swapped for a random-init model of the shape,
    built on the device; measures (b') and (c-direct) first, then serves until SIGTERM."""
    import torch

    import consumer.service as service
    from consumer.checkpoints import spec_from_hf_config
    from consumer.model import build_model
    from consumer.scoring import Scorer
    from shared.log import configure_logging
    from shared.settings import load_settings

    settings = load_settings()
    configure_logging(level=settings.log.level, fmt=settings.log.format, rank=0)
    cfg = MODELS[args.model]
    spec = spec_from_hf_config(cfg)
    report: dict = {}

    def build_scorer(settings, layout, path=None):
        device = service.pick_device(settings.consumer.device)
        t0 = time.perf_counter()
        # Zero-filled on the host, moved, then drawn on the device: no checkpoint on disk.
        model = build_model(
            spec, layout, params_dtype=torch.bfloat16, device=device, init_weights=False
        )
        _randomize(model, seed=1234)
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
        if not report.get("direct"):
            report["direct"] = _direct(scorer, args, cfg)
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
        Path(args.out).write_text(json.dumps(report))


def _instrument_scoring() -> None:
    """Record when the device worked on each batch while serving, for idle time.

    On CUDA: an event queued before a batch's work (Scorer.launch) and one after it; the
    device reaches the first when it starts the batch (or finishes the one before) and the
    second when the batch is done, so their union over batches is the device's busy time even
    though the consumer queues a batch before collecting the previous one. Elsewhere: host
    times from launch to collection (PendingScore.result)."""
    import torch

    from consumer.scoring import PendingScore, Scorer

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
        if self.device.type == "cuda":
            before = torch.cuda.Event(enable_timing=True)
            before.record()
        pending = launch(self, batch, clock)
        if self.device.type == "cuda":
            after = torch.cuda.Event(enable_timing=True)
            after.record()
            DEVICE_SPANS.append((before, after, int(batch.num_tokens)))
        started[id(pending)] = t0
        return pending

    def result_timed(self):
        try:
            return result(self)
        finally:
            SPANS.append([started.pop(id(self), time.time()), time.time(),
                          int(self.batch.num_tokens)])  # fmt: skip

    Scorer.launch = launch_timed
    PendingScore.result = result_timed


def _device_spans() -> list[list[float]]:
    """DEVICE_SPANS as [start, end, tokens] on the host clock."""
    import torch

    torch.cuda.synchronize()
    (ref, t_ref), batches = DEVICE_SPANS[0], DEVICE_SPANS[1:]
    return [
        [t_ref + ref.elapsed_time(a) / 1e3, t_ref + ref.elapsed_time(b) / 1e3, tokens]
        for a, b, tokens in batches
    ]


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------


def _child_args(args: argparse.Namespace, role: str, model: str) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--model", model]
    cmd += ["--seqlens", ",".join(map(str, args.seqlens)), "--iters", str(args.iters)]
    cmd += ["--tokens-per-forward", str(args.tokens_per_forward), "--device", args.device]
    cmd += ["--e2e-forwards", str(args.e2e_forwards)]
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


def _submit_and_wait(client, reqs: list, timeout: float) -> tuple[float, float, list]:
    t0 = time.time()
    ids = client.submit(reqs)
    results = client.wait(ids, timeout=timeout, progress=False)
    return t0, time.time(), results


def _serve_window(spans: list, t0: float, t1: float) -> dict:
    inside = sorted(s for s in spans if s[0] >= t0 and s[1] <= t1)
    if not inside:
        return {}
    # Batches overlap (one is queued while the previous is collected): busy is their union.
    busy, end = 0.0, float("-inf")
    for s, e, _ in inside:
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    first, last = min(s for s, _, _ in inside), max(e for _, e, _ in inside)
    return {
        "batches": len(inside),
        "busy_s": round(busy, 4),
        # Device idle between batches: time from the first batch's start to the last batch's
        # end during which no batch was between launch and collection.
        "idle_between_batches": round(1 - busy / (last - first), 4),
        # Everything that is not scoring in the client's view: submit, queue, store, wait.
        "idle_end_to_end": round(1 - busy / (t1 - t0), 4),
    }


def run_e2e(args: argparse.Namespace, model: str, tmp: Path) -> dict:
    """Start valkey and a consumer process, submit and wait for (c); returns its numbers."""
    import numpy as np

    from producer import TeacherClient
    from shared.messages import TeacherRequest
    from shared.redis_server import ensure_embedded, stop_embedded
    from shared.settings import Settings, to_env

    home = tmp / "valkey"
    url, _ = ensure_embedded(home)
    try:
        settings = Settings(
            redis={"url": url, "home": str(home)},
            queue={
                "name": f"bench-{model.replace('.', '')}",
                "max_input_tokens": max(args.seqlens),
            },
            storage={"url": f"file://{tmp / 'objects'}"},
            model={"dtype": "bfloat16"},
            consumer={
                "token_budget": args.tokens_per_forward,
                "head_chunk_rows": args.head_chunk_rows,
                "cuda_graphs": args.cuda_graphs,
                "device": args.device,
                "store_threads": 4,
                "block_ms": 200,
            },
            log={"format": "json", "level": "info"},
        )
        out_json = tmp / f"consumer-{model}.json"
        log_path = tmp / f"consumer-{model}.log"
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, **to_env(settings), "PYTHONPATH": path}
        cmd = _child_args(args, "consumer", model) + ["--out", str(out_json)]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT)
        client = TeacherClient(settings)
        windows: dict = {}
        try:
            _wait_ready(client, proc, log_path, timeout=1800)
            vocab = MODELS[model]["vocab_size"]
            rng = np.random.default_rng(7)
            for seqlen in args.seqlens:
                per_forward = args.tokens_per_forward // seqlen
                for kind in ("label", "full"):
                    extra = (
                        {"top_k": TOP_K, "sample_n": SAMPLES, "return_entropy": True}
                        if kind == "full"
                        else {}
                    )

                    def reqs(n: int, extra=extra, seqlen=seqlen) -> list:
                        return [
                            TeacherRequest(
                                input_ids=rng.integers(0, vocab, seqlen).tolist(),
                                seed=int(rng.integers(1 << 30)), **extra,
                            )
                            for _ in range(n)
                        ]  # fmt: skip

                    _submit_and_wait(client, reqs(per_forward), timeout=1800)  # warm-up
                    t0, t1, results = _submit_and_wait(
                        client, reqs(per_forward * args.e2e_forwards), timeout=1800
                    )
                    bad = [r.job_id for r in results if r.error]
                    if bad:
                        raise RuntimeError(f"{len(bad)} jobs failed: {results[0].error}")
                    r0 = results[0]
                    shapes = {
                        k: list(np.asarray(getattr(r0, k)).shape)
                        for k in ("logprobs", "topk_token_ids", "sampled_token_ids", "entropy")
                        if getattr(r0, k, None) is not None
                    }
                    windows[f"{seqlen}_{kind}"] = {
                        "t0": t0, "t1": t1, "seconds": round(t1 - t0, 4),
                        "tokens": seqlen * per_forward * args.e2e_forwards, "shapes": shapes,
                    }  # fmt: skip
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
        for w in windows.values():
            w.update(_serve_window(report["spans"], w["t0"], w["t1"]))
        report["windows"] = windows
        report.pop("spans")
        return report
    finally:
        stop_embedded(home)


def _row(name: str, seconds: float | None, tokens: int, flops: float, peak: float | None) -> dict:
    if not seconds:
        return {"path": name}
    return {
        "path": name,
        "s": seconds,
        "tok_s": tokens / seconds,
        "mfu": flops / seconds / PEAK_FLOPS,
        "peak_gib": peak,
    }


def summarize(args: argparse.Namespace, model: str, hf: dict, e2e: dict) -> list[str]:
    """Human-readable table and ratios for one model."""
    cfg = MODELS[model]
    tpf = args.tokens_per_forward
    lines = []
    for seqlen in args.seqlens:
        key = str(seqlen)
        fl_head = forward_flops(cfg, seqlen=seqlen, tokens=tpf, with_head=True)
        fl_bare = forward_flops(cfg, seqlen=seqlen, tokens=tpf, with_head=False)
        h, d = hf["runs"][key], e2e["direct"][key]
        rows = [
            _row("(a) hf fwd+fp32 log_softmax", h["hf"]["median_s"], tpf, fl_head,
                 h["hf"]["peak_gib"]),
            _row("(b) bare fwd, HF", h["bare_hf"]["median_s"], tpf, fl_bare,
                 h["bare_hf"]["peak_gib"]),
            _row("(b') bare fwd, ours (thd)", d["bare_ours"]["median_s"], tpf, fl_bare,
                 d["bare_ours"]["peak_gib"]),
            _row("(c-direct) score label", d["direct_label"]["median_s"], tpf, fl_head,
                 d["direct_label"]["peak_gib"]),
            _row("(c-direct) score full", d["direct_full"]["median_s"], tpf, fl_head,
                 d["direct_full"]["peak_gib"]),
        ]  # fmt: skip
        for kind in ("label", "full"):
            w = e2e["windows"][f"{seqlen}_{kind}"]
            sec = w["seconds"] * tpf / w["tokens"]  # seconds per forward's worth of tokens
            rows.append(_row(f"(c) e2e {kind}", sec, tpf, fl_head, e2e.get("serve_peak_gib")))
        for name, key_, fl in (
            ("(b'e) bare fwd, ours, eager", "bare_ours_eager", fl_bare),
            ("(c-direct e) label, eager", "direct_label_eager", fl_head),
            ("(c-direct e) full, eager", "direct_full_eager", fl_head),
        ):
            if key_ in d:
                rows.append(_row(name, d[key_]["median_s"], tpf, fl, d[key_]["peak_gib"]))
        lines.append(
            f"\nmodel {model}  seqlen {seqlen}  tokens/forward {tpf}  "
            f"({tpf // seqlen} docs; FLOPs/forward {fl_head / 1e12:.1f} T with head, "
            f"{fl_bare / 1e12:.1f} T without)"
        )
        lines.append(f"{'path':<32}{'s/fwd':>9}{'tok/s':>11}{'MFU':>8}{'peak GiB':>10}")
        for r in rows:
            if "s" in r:
                peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
                lines.append(
                    f"{r['path']:<32}{r['s']:>9.4f}{r['tok_s']:>11.0f}{r['mfu']:>8.1%}{peak:>10}"
                )
        by = {r["path"]: r for r in rows}
        a, b = by["(a) hf fwd+fp32 log_softmax"], by["(b) bare fwd, HF"]
        want_a = 1.2 if model == "1.5b" else 1.05
        for kind in ("label", "full"):
            c = by[f"(c) e2e {kind}"]
            w = e2e["windows"][f"{seqlen}_{kind}"]
            lines.append(
                f"(c) {kind}: c/a {c['tok_s'] / a['tok_s']:.3f} (target >= {want_a}), "
                f"c/b {c['tok_s'] / b['tok_s']:.3f} (target >= 0.95), peak c/b "
                f"{(c['peak_gib'] or 0) / (b['peak_gib'] or 1):.3f} (target <= 1.25), device "
                f"idle between batches {w.get('idle_between_batches', float('nan')):.2%} "
                f"({w.get('batches')} batches for {w['tokens'] // tpf} forwards' worth), "
                f"end to end {w.get('idle_end_to_end', float('nan')):.2%} (target <= 2%)"
            )
        busy = [d.get("busy_label"), d.get("busy_full")]
        if busy[0] is not None:
            lines.append(
                f"kernel busy inside one Scorer.score call (profiler): label {busy[0]:.1%}, "
                f"full {busy[1]:.1%}"
            )
        heads = [k for k in d if k.startswith("head_")]
        if heads:
            lines.append(
                "head alone (s): " + ", ".join(f"{k[5:]} {d[k]['median_s']:.4f}" for k in heads)
            )
        if "busy_label_eager" in d:
            lines.append(f"kernel busy, label, eager forward: {d['busy_label_eager']:.1%}")
        lines.append(
            "peak reserved GiB (allocator pools, CUDA graphs included): (a) "
            f"{h['hf'].get('peak_reserved_gib')}, (b) {h['bare_hf'].get('peak_reserved_gib')}, "
            f"(c) serving {e2e.get('serve_peak_reserved_gib')}"
        )
    lines.append(f"check vs full-vocab PyTorch: {json.dumps(e2e['direct']['check'])}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="1.5b,7b", help=f"of {','.join(MODELS)}")
    parser.add_argument("--seqlens", default="2048,8192")
    parser.add_argument("--tokens-per-forward", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=8, help="timed forwards per path")
    parser.add_argument(
        "--e2e-forwards", type=int, default=16, help="forwards' worth of jobs per (c) window"
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
        default=4,
        help="TEACHERQ_CONSUMER__CUDA_GRAPHS of the consumer (0: eager forwards only)",
    )
    parser.add_argument(
        "--no-fused", action="store_true", help="the PyTorch reference head, no Triton kernels"
    )
    parser.add_argument("--role", choices=("hf", "consumer"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seqlens = [int(s) for s in str(args.seqlens).split(",")]
    for s in args.seqlens:
        if args.tokens_per_forward % s:
            parser.error(f"--tokens-per-forward must be a multiple of every seqlen ({s})")
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
        everything[model] = {"hf": hf, "e2e": e2e, "wall_s": round(time.perf_counter() - t0, 1)}
        print(f"versions: hf side {json.dumps(hf['versions'])}", flush=True)
        print(f"head kernels: {e2e['direct'].get('kernels')}", flush=True)
        print(f"weights GiB: hf {hf['weights_gib']}, consumer {e2e.get('weights_gib')}; "
              f"consumer build {e2e.get('build_s')} s", flush=True)  # fmt: skip
        print("\n".join(summarize(args, model, hf, e2e)), flush=True)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
