"""Compile the warm-up's kernels in parallel, off the start's critical path.

On a machine whose compile cache is empty, the warm-up (consumer/serve/warmup.py) would compile
every kernel variant it reaches one after another (~20-40 of them, seconds each). `main()`
starts `Precompile.start` right after the cache directories are set, before torch and
megatron are imported: a few worker processes (`python -m consumer.serve.precompile`, fresh
interpreters: CUDA does not survive a fork) compile those variants into the same
TRITON_CACHE_DIR through Triton's ahead-of-time path (`consumer/kernels/launch.py`: the
kernel's `warmup`, no launch), while the consumer imports and loads its weights. Before its
warm-up, `run` waits for them (the `compile` phase of `consumer.ready`), and the warm-up then
finds every variant in the cache. Each kernel's host-side launcher is built there too (a C
module per kind of argument list on Triton up to 3.6, which a first launch would otherwise
compile in the warm-up), once per kind among the workers (`launch.share_launchers`).

Where quack-kernels serves a MoE teacher's bf16 experts (consumer/forward/quack_gemm.py), the
workers compile its GEMMs too, into QUACK_CACHE_DIR (`quack_gemm.precompile`: a call on meta
tensors, stopped where quack would compile, so no CUDA context either).

The variants come from the warm-up's own plan (`warmup.plan`: the head-pass groups of every
warm-up batch) and the model's shape (vocabulary shard, MLP width, heads), through each
kernel module's `precompile`, which builds the launch arguments with the code its launch
uses. `tests/unit/test_precompile.py` checks that the plan covers every kernel launch the
warm-up's calls make.

Without CUDA nothing starts (a debug line says so). A worker that fails costs nothing but
time: the warm-up compiles what is missing, and one warning line says which worker failed.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from consumer.serve.compile_cache import CompileCache

log = structlog.get_logger("teacherq.consumer")

# Past this, workers slow the consumer's own import (disk and CPU) more than they speed the
# compile: a fresh 1.5B start on an H200 host (16 cores) was ready in 23.7 s with 4 workers,
# 19.0 s with 8 and 21.8 s with 15 (one start each, docs/benchmarks.md, run 6).
MAX_WORKERS = 8
# A variant's compile time, relative to a Triton kernel's, where it is far from 1: quack's
# GEMMs (CuTe DSL) compiled for 19-24 s in a worker on an H100 host where our Triton kernels
# took at most 8 s a worker for all of theirs (docs/benchmarks.md, cold-start run 17)
COST = {"quack_gemm": 8}
SUMMARY = "teacherq-precompile-summary "
"""What starts a worker's last stderr line: then, as JSON, its seconds importing and building
the plan (`import_s`), compiling (`compile_s`), its variant count and its slowest variant."""
FP8_TOKEN_CLASSES = (1, 16, 17)  # token counts Triton tells apart: 1, multiples of 16, others


@dataclass(frozen=True)
class Job:
    """What every worker is told: enough to rebuild the plan (the model's shape is read in the
    worker, where importing torch costs the consumer nothing)."""

    model_path: str | None
    tp: int
    tp_rank: int
    dtype: str  # model.dtype: auto, bfloat16, float16, float32
    max_top_k: int
    max_sample_n: int
    token_budget: int
    full: bool
    workers: int
    ep: int = 1  # expert-parallel ways of a MoE model's replica
    quack: bool = True  # consumer.expert_gemms: quack-kernels may serve the experts (auto)
    fp8: str = "auto"  # model.fp8: an FP8 checkpoint computes in FP8 (auto) or is dequantized

    @classmethod
    def for_settings(
        cls, settings, *, tp_rank: int, workers: int, model_path: str | None = None
    ) -> Job:
        """The job of a consumer with `settings` on TP rank `tp_rank`; `model_path`: the
        folder of the model's config.json (default: `model.path`)."""
        c = settings.consumer
        if model_path is None and settings.model.path is not None:
            model_path = str(settings.model.path)
        return cls(
            model_path=model_path,
            tp=settings.parallel.tp,
            tp_rank=tp_rank,
            dtype=settings.model.dtype,
            max_top_k=settings.queue.max_top_k,
            max_sample_n=settings.queue.max_sample_n,
            token_budget=c.token_budget,
            full=c.warmup == "full" or c.warmup == "auto",
            workers=workers,
            ep=settings.parallel.ep,
            quack=c.expert_gemms == "auto",
            fp8=settings.model.fp8,
        )

    def to_json(self) -> str:
        """The job as one JSON argument."""
        return json.dumps(self.__dict__)

    def digest(self) -> str:
        """What decides the plan, as a short hash: the job less its worker count, with the
        model's config.json in place of its path (the same model under another path needs
        the same kernels)."""
        fields = {k: v for k, v in self.__dict__.items() if k not in ("workers", "model_path")}
        config = Path(self.model_path or "") / "config.json"
        fields["config"] = config.read_text() if self.model_path and config.is_file() else None
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Variant:
    """One compile: a kernel module's `precompile` with these keyword arguments."""

    kernel: str  # a module of consumer/kernels ("rowstats", "swiglu", ...) or of `MODULES`
    params: tuple[tuple[str, Any], ...]

    def name(self) -> str:
        """A short label for logs, e.g. `rowstats n=3 top_k=1 want_entropy=True`."""
        return " ".join([self.kernel] + [f"{k}={v}" for k, v in self.params if k != "shard"])


def head_calls(batches: list) -> list[tuple[int, int, bool]]:
    """(samples, top-k, entropy) of every head pass the warm-up's `batches` run: the scorer
    runs one pass per group of jobs asking for the same kinds of output, and a warm-up batch
    holds one job per group (`warmup.combos`)."""
    seen: dict[tuple[int, int, bool], None] = {}
    for batch in batches:
        for combo in batch.combos:
            seen[(combo.sample_n, combo.top_k, combo.entropy)] = None
    return list(seen)


def plan(
    spec,
    *,
    tp: int,
    tp_rank: int,
    batches: list,
    dtype: Any,
    fp8: bool,
    ep: int = 1,
    quack: bool = False,
) -> list[Variant]:
    """The kernel variants a warm-up of `batches` reaches on TP rank `tp_rank` of `tp` for a
    model `spec` (consumer/forward/spec.py) with `dtype` parameters; `fp8`: its linears run
    block-scaled FP8; `ep`: a MoE model's experts split that many ways; `quack`: quack-kernels
    may serve its bf16 experts here (`quack_gemm.may_serve`). Variants that compile to the
    same kernel appear once."""
    from consumer.head_common import VocabShard
    from consumer.kernels.rowstats import samples_per_program

    per_rank = spec.padded_vocab_size(tp) // tp
    shard = VocabShard(start=tp_rank * per_rank, size=per_rank, vocab_size=spec.vocab_size)
    variants: dict[Variant, None] = {}
    for n, top_k, entropy in head_calls(batches):
        # Sample counts share a kernel by samples per program, and top-k values share one:
        # the kernels specialise on neither count (rowstats.py).
        params: tuple[tuple[str, Any], ...] = (
            ("shard", shard),
            ("dtype", dtype),
            ("n", samples_per_program(n) if n else 0),
            ("top_k", 1 if top_k else 0),
            ("want_entropy", entropy),
        )
        variants[Variant("rowstats", params)] = None
    ffns = {spec.ffn_hidden_size // tp}
    if spec.is_moe:
        ffns |= {spec.moe_ffn_hidden_size, spec.moe_ffn_hidden_size // tp}
        if spec.moe_shared_ffn_hidden_size:
            ffns.add(spec.moe_shared_ffn_hidden_size // tp)
    for ffn in sorted(f for f in ffns if f > 0):
        variants[Variant("swiglu", (("ffn", ffn), ("dtype", dtype)))] = None
    if not spec.is_mla and spec.rotary_dim == spec.kv_channels:  # else the PyTorch RoPE
        kv_heads = max(1, spec.num_kv_heads // tp)
        for heads in (spec.num_attention_heads // tp, kv_heads):
            params = (("heads", heads), ("dim", spec.kv_channels), ("dtype", dtype))
            variants[Variant("rope", params)] = None
    if spec.is_moe:
        experts = _experts_variants(spec, tp=tp, ep=ep, dtype=dtype, fp8=fp8, quack=quack)
        variants |= dict.fromkeys(experts)
    if spec.is_mla:
        params = (("heads", spec.num_attention_heads // tp), ("nope", spec.qk_nope_head_dim),
                  ("rope", spec.qk_rope_head_dim), ("v", spec.v_head_dim),
                  ("latent", spec.kv_lora_rank), ("dtype", dtype),
                  ("interleaved", spec.rope_interleave))  # fmt: skip
        variants[Variant("mla_rope", params)] = None
        from consumer.kernels.mla_attention import supports

        qk, v = spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim
        if v < qk and supports(qk, v, dtype):  # (the attention module's own conditions)
            params = (("heads", spec.num_attention_heads // tp), ("qk_dim", qk),
                      ("v_dim", v), ("dtype", dtype))  # fmt: skip
            variants[Variant("mla_attention", params)] = None
    if fp8:
        widths = {spec.hidden_size, spec.num_attention_heads // tp * spec.kv_channels}
        widths.add(spec.ffn_hidden_size // tp)
        for k in sorted(w for w in widths if w % 128 == 0):
            for tokens in FP8_TOKEN_CLASSES:
                params = (("k", k), ("tokens", tokens), ("dtype", dtype))
                variants[Variant("fp8_quant", params)] = None
    return list(variants)


def warmup_plan(
    spec,
    *,
    tp: int,
    tp_rank: int,
    ep: int,
    dtype: Any,
    fp8: bool,
    max_top_k: int,
    max_sample_n: int,
    token_budget: int,
    full: bool,
    quack: bool = False,
) -> list[Variant]:
    """`plan` of the batches a warm-up with these settings runs (`warmup.plan`) for `spec`."""
    from consumer.serve import warmup

    batches = warmup.plan(
        max_top_k=max_top_k,
        max_sample_n=max_sample_n,
        vocab_size=spec.vocab_size,
        max_input_tokens=spec.max_input_tokens,
        token_budget=token_budget,
        full=full,
        graphs=False,  # graph batches run the plain group, which every plan holds
    )
    return plan(
        spec, tp=tp, tp_rank=tp_rank, batches=batches, dtype=dtype, fp8=fp8, ep=ep, quack=quack
    )


def _experts_variant(spec, *, tp: int, ep: int, dtype: Any, fp8: bool) -> Variant:
    """The fused expert GEMMs' compile (consumer/kernels/expert_gemm.py) for this rank's
    experts: FP8 where an FP8 checkpoint's experts are whole 128-blocks (they load in FP8
    then), routing weights in float32 where the family keeps them so."""
    import torch

    from consumer.forward.moe import float_routing_weights

    ffn = spec.moe_ffn_hidden_size // max(1, max(tp, ep) // ep)  # a replica: max(tp, ep) ranks
    fp8_experts = fp8 and ffn % 128 == 0 and spec.hidden_size % 128 == 0
    float_weights = float_routing_weights(spec)
    params = (("experts", spec.num_experts // ep), ("hidden", spec.hidden_size), ("ffn", ffn),
              ("dtype", dtype), ("fp8", fp8_experts),
              ("routing_dtype", torch.float32 if float_weights else dtype))  # fmt: skip
    return Variant("expert_gemm", params)


def _experts_variants(
    spec, *, tp: int, ep: int, dtype: Any, fp8: bool, quack: bool
) -> list[Variant]:
    """The expert GEMMs' compiles: `_experts_variant`, or where quack-kernels serves the
    experts (`quack`, bf16 experts, rows of whole 16-byte units: `moe_gemm.routed_combined`'s
    conditions) quack's GEMMs (`quack_gemm.precompile_plan`), the combine kernel that follows
    them, and our gate/up alone where it serves in quack's place (`quack_gemm.takes_gate_up`):
    the warm-up launches nothing else of them."""
    import torch

    from consumer.forward import quack_gemm

    experts = _experts_variant(spec, tp=tp, ep=ep, dtype=dtype, fp8=fp8)
    params = dict(experts.params)
    hidden, ffn = spec.hidden_size, params["ffn"]
    bf16 = not params["fp8"] and dtype == torch.bfloat16
    if not (quack and bf16 and quack_gemm.takes_rows(hidden, ffn)):
        return [experts]
    combine = (("hidden", hidden), ("top_k", spec.moe_top_k), ("dtype", dtype),
               ("routing_dtype", params["routing_dtype"]))  # fmt: skip
    out = [Variant("moe_combine", combine)]
    out += [Variant("quack_gemm", (*gemm.items(), ("dtype", dtype)))
            for gemm in quack_gemm.precompile_plan(hidden)]  # fmt: skip
    if not quack_gemm.takes_gate_up(hidden):
        out.insert(0, Variant("expert_gemm", (*experts.params, ("gemms", "gate_up"))))
    return out


# Variants whose module is not in consumer/kernels
MODULES = {"quack_gemm": "consumer.forward.quack_gemm"}


def compile_variant(variant: Variant) -> None:
    """Compile one variant into Triton's cache, or quack's for `quack_gemm` (nothing is
    launched)."""
    import importlib

    module = MODULES.get(variant.kernel, f"consumer.kernels.{variant.kernel}")
    importlib.import_module(module).precompile(**dict(variant.params))


def cuda_present(environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether this host shows an NVIDIA device to this process, without importing torch."""
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def worker_count(setting: int, environ: dict[str, str] | os._Environ[str]) -> int:
    """`consumer.precompile_workers`, or (0) the cores this host's ranks leave, shared among
    them, at most MAX_WORKERS."""
    if setting > 0:
        return setting
    ranks_here = max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    free = max(1, (os.cpu_count() or 2) - ranks_here)
    return max(1, min(MAX_WORKERS, free // ranks_here))


class Precompile:
    """The running workers of one consumer rank."""

    def __init__(
        self,
        procs: list[subprocess.Popen],
        started: float,
        errs: list[IO[bytes]],
        *,
        plan: str,
        skipped: str = "",
        claims: str | None = None,
    ) -> None:
        self.procs = procs
        self.started = started
        self.errs = errs  # each worker's stderr
        self.plan = plan  # Job.digest(): sealed into the cache once the warm-up ran
        self.skipped = skipped  # why no worker was started, if none was
        self.claims = claims  # the workers' launcher claims, removed once they are done

    def _lines(self, i: int) -> list[str]:
        self.errs[i].seek(0)
        return self.errs[i].read().decode(errors="replace").strip().splitlines()

    def _last_line(self, i: int) -> str:
        """Worker i's last stderr line other than its summary (why it failed)."""
        lines = [line for line in self._lines(i) if not line.startswith(SUMMARY)]
        return lines[-1] if lines else ""

    def _summary(self, i: int) -> dict[str, Any] | None:
        """Worker i's `SUMMARY`, None where it wrote none (stopped, or no CUDA)."""
        for line in reversed(self._lines(i)):
            if line.startswith(SUMMARY):
                with contextlib.suppress(ValueError):
                    return json.loads(line.removeprefix(SUMMARY))
        return None

    @classmethod
    def start(
        cls,
        settings,
        environ: os._Environ[str] | dict[str, str],
        cache: CompileCache | None = None,
    ) -> Precompile | None:
        """Start the workers for this rank (RANK, WORLD_SIZE from torchrun), or None where
        there is nothing to do: the setting is off, the device is the CPU, or no CUDA. Where
        the sealed `cache` holds this plan already, no worker starts (they would only load
        the cache, competing with this process's import for the CPU)."""
        c = settings.consumer
        if not c.precompile or c.device == "cpu":
            log.debug("precompile.skipped", reason="off" if not c.precompile else "device=cpu")
            return None
        if not cuda_present(environ):
            log.debug("precompile.skipped", reason="no CUDA device")
            return None
        rank, tp = int(environ.get("RANK", "0")), settings.parallel.tp
        workers = worker_count(c.precompile_workers, environ)
        # megatron's order: TP ranks are the fastest-varying
        job = Job.for_settings(settings, tp_rank=rank % tp, workers=workers)
        plan = job.digest()  # reads the model's config.json: once
        if cache is not None and cache.holds(plan):
            log.debug("precompile.skipped", reason="the sealed compile cache holds this plan")
            return cls([], time.monotonic(), [], plan=plan, skipped="cached")
        env = dict(environ)
        # One folder per start in which the workers claim the launchers they build (each
        # kind once: consumer/kernels/launch.py, `share_launchers`).
        claims = tempfile.mkdtemp(prefix="tq-launchers-")
        argv = [sys.executable, "-m", "consumer.serve.precompile", job.to_json()]
        # stderr to files, not pipes: nobody reads a pipe until the wait, and a worker whose
        # pipe filled up (Triton's warnings) would stop compiling.
        errs: list[IO[bytes]] = [
            tempfile.TemporaryFile()  # noqa: SIM115 - closed by wait() or stop()
            for _ in range(workers)
        ]
        procs = [
            subprocess.Popen(
                [*argv, str(i), claims],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
            for i, err in enumerate(errs)
        ]
        log.debug("precompile.started", workers=workers, tp_rank=job.tp_rank)
        return cls(procs, time.monotonic(), errs, plan=plan, claims=claims)

    def wait(self, timeout_s: float) -> dict[str, Any]:
        """Wait for every worker (stopping those still running after `timeout_s`); returns
        what the start-up log reports. One warning line if any worker failed."""
        deadline = self.started + timeout_s
        failed: list[str] = []
        summaries: list[dict[str, Any]] = []
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                failed.append(f"worker {i}: still compiling after {timeout_s:g} s")
                continue
            summary = self._summary(i)
            if summary is not None:
                summaries.append(summary)
            if proc.returncode != 0:
                failed.append(f"worker {i}: exit {proc.returncode}: {self._last_line(i)}")
        self._close()
        if summaries:
            log.debug("precompile.workers", workers=summaries)
        if failed:
            log.warning(
                "precompile.failed",
                workers=len(self.procs),
                failed=failed,
                note="the warm-up compiles what is missing",
            )
        return {
            "workers": len(self.procs),
            "failed": len(failed),
            "seconds": round(time.monotonic() - self.started, 3),
            **({"skipped": self.skipped} if self.skipped else {}),
            # each worker's own seconds (import and plan, compiling), and the slowest variant
            # of them all with its seconds: where a long compile wait went
            **(
                {
                    "worker_s": [[w.get("import_s"), w.get("compile_s")] for w in summaries],
                    "slowest": max(
                        (w["slowest"] for w in summaries if w.get("slowest")),
                        key=lambda named: named[1],
                        default=None,
                    ),
                }
                if summaries
                else {}
            ),
        }

    def stop(self) -> None:
        """Stop the workers still running (the consumer is exiting before its warm-up)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._close()

    def _close(self) -> None:
        for err in self.errs:
            err.close()
        if self.claims is not None:
            shutil.rmtree(self.claims, ignore_errors=True)


def share(variants: list[Variant], workers: int, index: int) -> list[Variant]:
    """Worker `index`'s share of `variants` among `workers`, in plan order: the costliest
    first (`COST`; the plan's order among equals), each to the worker with the least cost so
    far (the lowest index among equals). Every worker computes the same split. A slow compile
    so gets a worker of its own where there are enough of them, instead of waiting behind
    the Triton kernels that would have shared its worker (the start waits for the last)."""
    load = [0] * workers
    owner: dict[int, int] = {}
    by_cost = sorted(range(len(variants)), key=lambda i: -COST.get(variants[i].kernel, 1))
    for i in by_cost:
        worker = min(range(workers), key=lambda w: (load[w], w))
        owner[i] = worker
        load[worker] += COST.get(variants[i].kernel, 1)
    return [v for i, v in enumerate(variants) if owner[i] == index]


def _worker(job: Job, index: int, claims: str | None = None) -> int:
    """One worker: rebuild the plan, compile its `share` of the variants, and
    build the launchers of those no other worker sharing `claims` has claimed. Its last
    stderr line is a `SUMMARY` of where its seconds went."""
    began = time.monotonic()
    import torch

    from consumer.kernels import launch

    if claims is not None:
        launch.share_launchers(Path(claims))

    if not torch.cuda.is_available():
        return 0
    # No set_device: it would create a CUDA context (memory on the GPU the consumer is
    # loading onto); compiling needs the device's capability only, the same for all of a host.
    variants = job_plan(job)
    failures = 0
    mine = share(variants, job.workers, index)
    ready = time.monotonic()
    slowest = ("", 0.0)
    for variant in mine:
        start = time.monotonic()
        try:
            compile_variant(variant)
        except Exception as exc:  # noqa: BLE001 - reported, and the warm-up compiles it
            failures += 1
            sys.stderr.write(f"{variant.name()}: {type(exc).__name__}: {exc}\n")
        took = time.monotonic() - start
        slowest = max(slowest, (variant.name(), took), key=lambda named: named[1])
    summary = {
        "import_s": round(ready - began, 3),
        "compile_s": round(time.monotonic() - ready, 3),
        "variants": len(mine),
        "slowest": [slowest[0], round(slowest[1], 3)],
    }
    sys.stderr.write(SUMMARY + json.dumps(summary) + "\n")
    return 1 if failures else 0


def job_plan(job: Job, *, sm90: bool = False) -> list[Variant]:
    """The variants `job`'s warm-up reaches, as this machine's device serves it (asked
    without a CUDA context: whether quack may serve, whether FP8 GEMMs run), or with `sm90`
    as an sm90 GPU would, whatever this machine has (a bake, consumer/serve/bake.py)."""
    from consumer.forward import quack_gemm
    from consumer.forward.fp8_gemm import cuda_problem, platform_problem
    from consumer.forward.spec import param_dtype

    quack_gemm.allow(job.quack)
    spec, fp8 = model_shape(job.model_path, job.fp8)
    if fp8:  # the load dequantizes where the device or CUDA has no block-scaled FP8 GEMM
        fp8 = (cuda_problem() if sm90 else platform_problem()) is None
    return warmup_plan(
        spec,
        tp=job.tp,
        tp_rank=job.tp_rank,
        ep=job.ep,
        dtype=param_dtype(job.dtype, "cuda"),
        fp8=fp8,
        max_top_k=job.max_top_k,
        max_sample_n=job.max_sample_n,
        token_budget=job.token_budget,
        full=job.full,
        quack=(job.quack and quack_gemm.installed()) if sm90 else quack_gemm.may_serve(),
    )


def model_shape(path: str | None, fp8: str = "auto") -> tuple[Any, bool]:
    """(ModelSpec, FP8 compute or not) of the checkpoint at `path` (None: the tiny preset),
    from its config.json alone: FP8 where it is block-quantized in a format FP8 GEMMs take
    and `fp8` (the `model.fp8` setting) does not dequantize it (the device's part of the
    question, `fp8_gemm.platform_problem`, is the caller's)."""

    from consumer.forward.spec import TINY

    if path is None:
        return TINY, False
    from consumer.checkpoints import hf_fp8
    from consumer.checkpoints.hf_config import spec_from_hf_config

    config = json.loads((Path(path) / "config.json").read_text())
    fmt = hf_fp8.fp8_format(config)
    return spec_from_hf_config(config), fmt is not None and not hf_fp8.format_problem(fp8, fmt)


if __name__ == "__main__":
    sys.exit(_worker(Job(**json.loads(sys.argv[1])), int(sys.argv[2]), *sys.argv[3:4]))
