"""The precompile plan (consumer/serve/precompile.py) covers every kernel the warm-up launches.

Without a GPU nothing compiles here, so the Triton kernels are replaced by recorders that note
what Triton would specialise a launch on: each pointer's dtype and 16-byte alignment, each
integer's class (1, a multiple of 16, other; none for the kernel's `do_not_specialize`
arguments), the compile-time constants and options. The warm-up's calls (every head pass of
`warmup.plan`'s batches through `rowstats.local_reduce`, the MLP's SwiGLU and q's and k's
RoPE, on real CPU tensors of the model's shapes) must each match a compile of the plan
(`kernel.warmup`, the compile-only path): the cache key Triton would compute is the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import pytest
import torch

pytest.importorskip("triton")

from consumer.forward.spec import TINY
from consumer.head_common import VocabShard
from consumer.kernels import rope, rowstats, swiglu
from consumer.serve import precompile, warmup

KERNELS = {
    (rowstats, "_row_pass_kernel"),
    (rowstats, "_candidates_kernel"),
    (swiglu, "_swiglu_kernel"),
    (rope, "_rope_kernel"),
}


def _arg_class(param: Any, value: Any) -> Any:
    if hasattr(value, "data_ptr"):
        return ("ptr", str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value).__name__
    if param.do_not_specialize:
        return ("int", -(2**31) <= value < 2**31)
    return ("int", value == 1, value % 16 == 0, -(2**31) <= value < 2**31)


class Recorder:
    """Stands in for a JITFunction: records the specialisation of launches and compiles."""

    def __init__(self, kernel: Any, name: str, seen: dict[str, set]) -> None:
        self.kernel, self.name, self.seen = kernel, name, seen

    def _record(self, kind: str, args: tuple, kwargs: dict) -> None:
        params = [p for p in self.kernel.params if not p.is_constexpr]
        assert len(args) == len(params), (self.name, len(args), len(params))
        classes = tuple(_arg_class(p, a) for p, a in zip(params, args, strict=True))
        self.seen[kind].add((self.name, classes, tuple(sorted(kwargs.items()))))

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self._record("launched", args, kwargs)

    def warmup(self, *args: Any, grid: Any, **kwargs: Any) -> None:
        self._record("compiled", args, kwargs)


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, set]:
    """Launches and compiles of the fused kernels, recorded instead of run."""
    out: dict[str, set] = {"launched": set(), "compiled": set()}
    for module, name in KERNELS:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), name, out))
    return out


def _warmup_launches(spec, batches, *, tp: int, tp_rank: int, dtype: torch.dtype) -> None:
    """What the warm-up of `batches` launches on this rank, on CPU tensors: one head pass per
    group (samples, top-k, entropy), and the forward's SwiGLU and RoPE."""
    per_rank = spec.padded_vocab_size(tp) // tp
    shard = VocabShard(start=tp_rank * per_rank, size=per_rank, vocab_size=spec.vocab_size)
    rows = 16
    logits = torch.zeros(rows, shard.size, dtype=dtype)
    for n, top_k, entropy in precompile.head_calls(batches):
        rowstats.local_reduce(
            logits_chunk=lambda r0, r1: logits[r0:r1],
            rows=rows,
            chunk_rows=4096,
            shard=shard,
            target_ids_TW=torch.zeros(rows, 2, dtype=torch.int64),
            inv_temperature_T=torch.ones(rows),
            keys_TN=torch.zeros(rows, n, dtype=torch.int64) if n else None,
            top_k=top_k,
            want_entropy=entropy,
        )
    ffn = spec.ffn_hidden_size // tp
    swiglu.swiglu(torch.zeros(rows, 2 * ffn, dtype=dtype))
    dim = spec.kv_channels
    angles = torch.zeros(rows, dim // 2)
    for heads in (spec.num_attention_heads // tp, max(1, spec.num_kv_heads // tp)):
        rope.rope(torch.zeros(rows, heads, dim, dtype=dtype), angles, angles)


@pytest.mark.parametrize(
    ("spec", "tp", "tp_rank", "max_top_k", "max_sample_n"),
    [
        (TINY, 1, 0, 8, 20),
        (TINY, 1, 0, 0, 0),
        # a Qwen2.5-1.5B-like shape over two ranks: the second rank's shard starts mid-way
        (
            replace(
                TINY,
                vocab_size=151936,
                hidden_size=1536,
                num_attention_heads=12,
                num_kv_heads=2,
                ffn_hidden_size=8960,
            ),
            2,
            1,
            64,
            8,
        ),
    ],
    ids=["tiny", "tiny-no-topk-no-samples", "qwen1.5b-shape-tp2-rank1"],
)
def test_plan_covers_every_kernel_the_warmup_launches(
    seen: dict[str, set], spec, tp: int, tp_rank: int, max_top_k: int, max_sample_n: int
) -> None:
    """Every launch of the warm-up's calls has a compile in the plan with the same
    specialisation (so the warm-up finds it in the cache), and the plan is not empty."""
    batches = warmup.plan(
        max_top_k=max_top_k,
        max_sample_n=max_sample_n,
        vocab_size=spec.vocab_size,
        max_input_tokens=spec.max_input_tokens,
        token_budget=512,
        full=True,
        graphs=True,
    )
    dtype = torch.bfloat16
    _warmup_launches(spec, batches, tp=tp, tp_rank=tp_rank, dtype=dtype)
    variants = precompile.plan(
        spec, tp=tp, tp_rank=tp_rank, batches=batches, dtype=dtype, fp8=False
    )
    for variant in variants:
        precompile.compile_variant(variant)
    launched, compiled = seen["launched"], seen["compiled"]
    assert launched, "the warm-up's calls launched nothing"
    missing = launched - compiled
    assert not missing, f"{len(missing)} launches not in the plan, e.g. {sorted(missing)[0]}"
    kernels = {name for name, _, _ in compiled}
    assert {"_row_pass_kernel", "_swiglu_kernel", "_rope_kernel"} <= kernels
    assert ("_candidates_kernel" in kernels) == (max_top_k > 0)


def test_head_variants_follow_the_kernels_specialisation(seen: dict[str, set]) -> None:
    """Sample counts that share samples-per-program (3 and 4) and top-k values (1 and 64)
    compile once: the plan lists them once."""
    shard_batches = [
        warmup.WarmupBatch([warmup.Combo(k, n, True, 0, 1.0)], 16, "outputs")
        for k, n in ((1, 3), (64, 4))
    ]
    variants = precompile.plan(
        TINY, tp=1, tp_rank=0, batches=shard_batches, dtype=torch.bfloat16, fp8=False
    )
    assert [v.kernel for v in variants].count("rowstats") == 1


def test_no_cuda_no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, or with no NVIDIA device visible, no worker starts."""
    from shared.settings import Settings

    cpu = Settings(consumer={"device": "cpu"})
    assert precompile.Precompile.start(cpu, {}) is None
    monkeypatch.setattr(precompile.glob, "glob", lambda pattern: [])
    assert precompile.Precompile.start(Settings(), {}) is None
    assert not precompile.cuda_present({"CUDA_VISIBLE_DEVICES": ""})


def test_worker_count_shares_the_host_among_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto: the cores the host's ranks leave, divided among them, at most MAX_WORKERS; the
    setting wins."""
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 64)
    assert precompile.worker_count(0, {}) == precompile.MAX_WORKERS
    assert precompile.worker_count(0, {"LOCAL_WORLD_SIZE": "8"}) == 7
    assert precompile.worker_count(3, {"LOCAL_WORLD_SIZE": "8"}) == 3


def _workers(*codes: str) -> precompile.Precompile:
    """Stand-in workers: small Python processes running `codes`."""
    import subprocess
    import sys
    import tempfile
    import time

    errs: list[IO[bytes]] = [
        tempfile.TemporaryFile()  # noqa: SIM115 - Precompile.wait closes them
        for _ in codes
    ]
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stderr=err)
        for code, err in zip(codes, errs, strict=True)
    ]
    return precompile.Precompile(procs, time.monotonic(), errs, plan="test")


def _summary(import_s: float, compile_s: float) -> str:
    """A Python statement writing a worker's summary line, as `_worker` ends (`sys` imported):
    its slowest variant took half its compile."""
    slowest = [f"kernel-{compile_s}", compile_s / 2]
    line = precompile.SUMMARY + json.dumps(
        {"import_s": import_s, "compile_s": compile_s, "variants": 3, "slowest": slowest}
    )
    return f"sys.stderr.write({line!r} + '\\n')"


def test_a_failed_worker_costs_one_warning_line() -> None:
    """The consumer goes on when a worker fails: `wait` reports it in one warning naming the
    worker and its last stderr line before its summary; a worker still compiling at the
    timeout is stopped. The workers' summaries give each one's seconds."""
    import structlog

    workers = _workers(
        "import sys; " + _summary(4.5, 2.25),
        "import sys; sys.stderr.write('rowstats n=4: CompilationError: boom\\n'); "
        + _summary(4.0, 3.5)
        + "; sys.exit(1)",
    )
    with structlog.testing.capture_logs() as logs:
        got = workers.wait(timeout_s=60)
    assert got["workers"] == 2 and got["failed"] == 1
    assert got["worker_s"] == [[4.5, 2.25], [4.0, 3.5]]
    assert got["slowest"] == ["kernel-3.5", 1.75]  # the slowest variant among the workers'
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "precompile.failed"
    assert warning["failed"] == ["worker 1: exit 1: rowstats n=4: CompilationError: boom"]
    [debug] = [e for e in logs if e["event"] == "precompile.workers"]
    assert [w["variants"] for w in debug["workers"]] == [3, 3]

    slow = _workers("import time; time.sleep(60)")
    with structlog.testing.capture_logs() as logs:
        got = slow.wait(timeout_s=0.2)
    assert got["failed"] == 1 and slow.procs[0].poll() is not None
    assert "still compiling" in logs[0]["failed"][0]


def test_fp8_plan_covers_the_quantize_launches(seen: dict[str, set], monkeypatch) -> None:
    """For an FP8 checkpoint the plan compiles the activation quantizer for every FP8 linear's
    input width, for token counts of both integer classes."""
    from consumer.kernels import fp8_quant

    monkeypatch.setattr(
        fp8_quant,
        "_quantize_kernel",
        Recorder(fp8_quant._quantize_kernel, "_quantize_kernel", seen),
    )
    spec = replace(TINY, hidden_size=256, num_attention_heads=2, ffn_hidden_size=512)
    for tokens in (16, 17, 40):
        for k in (spec.hidden_size, spec.num_attention_heads * spec.kv_channels, 512):
            fp8_quant.quantize_activations_padded(torch.zeros(tokens, k, dtype=torch.bfloat16))
    variants = precompile.plan(spec, tp=1, tp_rank=0, batches=[], dtype=torch.bfloat16, fp8=True)
    for variant in variants:
        precompile.compile_variant(variant)
    assert seen["launched"] and not seen["launched"] - seen["compiled"]


def test_no_workers_when_the_sealed_cache_holds_the_plan(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a GPU host whose sealed compile cache holds this start's plan, no worker starts
    (it would only load the cache while this process imports), and the plan is still known
    for the seal; a plan the cache does not hold starts workers. (A CUDA host is stood in by
    the device-node check; the workers are not real here.)"""
    from consumer.serve.compile_cache import apply
    from shared.settings import Settings

    monkeypatch.setattr(precompile, "cuda_present", lambda environ: True)
    started: list[list[str]] = []

    class NoProcess:
        def __init__(self, argv: list[str], **kwargs: object) -> None:
            started.append(argv)

    monkeypatch.setattr(precompile.subprocess, "Popen", NoProcess)
    settings = Settings(consumer={"precompile_workers": 2})
    cache = apply(tmp_path, tmp_path, {}, key={"torch": "x"})
    first = precompile.Precompile.start(settings, {}, cache)
    assert first is not None and len(started) == 2 and not first.skipped
    cache.seal(first.plan)
    again = precompile.Precompile.start(
        settings, {}, apply(tmp_path, tmp_path, {}, key={"torch": "x"})
    )
    assert again is not None and again.skipped == "cached" and again.plan == first.plan
    assert len(started) == 2, "a worker started for a plan the cache holds"
    assert again.wait(1.0)["skipped"] == "cached"
    other = Settings(consumer={"precompile_workers": 2}, queue={"max_top_k": 5})
    assert precompile.Precompile.start(other, {}, cache).skipped == ""  # type: ignore[union-attr]


@pytest.mark.parametrize("tail", [False, True], ids=["", "tail"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_plan_covers_the_expert_gemms_and_latent_attention(
    seen: dict[str, set], monkeypatch: pytest.MonkeyPatch, fp8: bool, tail: bool
) -> None:
    """For a DeepSeek-V3-like spec (latent attention, sigmoid routing with float32 weights)
    the plan compiles the fused expert GEMMs (bf16, or FP8 experts; with or without a tail
    launch) and the latent attention kernel as TeacherMoE and TeacherMLA launch them,
    whatever the batch's row count."""
    from consumer.forward import moe_gemm
    from consumer.kernels import expert_gemm, fp8_quant, mla_rope

    for name in ("BF16", "BF16_DOWN", "FP8", "FP8_DOWN") if tail else ():
        main = getattr(expert_gemm, name + "_TILES")
        monkeypatch.setattr(expert_gemm, name + "_TAIL_TILES", replace(main, bm=main.bm // 2))

    for module, name in (
        (expert_gemm, "_expert_gemm_kernel"),
        (mla_rope, "_mla_qkv_kernel"),
        (fp8_quant, "_quantize_kernel"),
    ):
        monkeypatch.setattr(module, name, Recorder(getattr(module, name), name, seen))
    # the CUDA path's quantizer (outer-dim-major scales), not the PyTorch one CPUs take
    monkeypatch.setattr(moe_gemm, "_quantize", fp8_quant.quantize_activations_padded)
    spec = replace(
        TINY, family="deepseek_v3", hidden_size=256, num_attention_heads=4, num_kv_heads=4,
        num_experts=8, moe_top_k=2, moe_ffn_hidden_size=128, kv_lora_rank=32, q_lora_rank=48,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True,
    )  # fmt: skip
    dtype, e, h, f, k = torch.bfloat16, spec.num_experts, spec.hidden_size, 128, 2
    weight = torch.float8_e4m3fn if fp8 else dtype
    fc1, fc2 = torch.zeros(e, 2 * f, h, dtype=weight), torch.zeros(e, h, f, dtype=weight)
    scales = {"fc1_scale": torch.ones(e, 2, 2), "fc2_scale": torch.ones(e, 2, 1)} if fp8 else {}
    for tokens in (1, 16, 37):
        rows = torch.arange(tokens * k)
        counts = torch.zeros(e, dtype=torch.int64)
        counts[0] = tokens * k
        out = torch.empty(tokens * k, h, dtype=dtype)
        moe_gemm.routed_swiglu(
            torch.zeros(tokens, h, dtype=dtype), rows // k, rows, torch.ones(tokens * k),
            counts, fc1, fc2, out, path="triton", **scales,
        )  # fmt: skip
        heads, nope, rope, v, lora = 4, 16, 8, 16, 32
        down = torch.zeros(tokens, lora + rope, dtype=dtype)
        angles = torch.zeros(tokens, rope // 2)
        mla_rope.mla_qkv(
            torch.zeros(tokens, heads * (nope + rope), dtype=dtype).view(tokens, heads, -1),
            torch.zeros(tokens, heads * (nope + v), dtype=dtype).view(tokens, heads, -1),
            down[:, lora:], angles, angles, nope=nope, interleaved=True,
        )  # fmt: skip
    variants = precompile.plan(spec, tp=1, tp_rank=0, batches=[], dtype=dtype, fp8=fp8)
    for variant in variants:
        precompile.compile_variant(variant)
    launched = {name for name, _, _ in seen["launched"]}
    assert {"_expert_gemm_kernel", "_mla_qkv_kernel"} <= launched
    missing = seen["launched"] - seen["compiled"]
    assert not missing, f"{len(missing)} launches not in the plan, e.g. {sorted(missing)[0]}"


def test_workers_sharing_a_folder_build_each_kind_of_launcher_once(tmp_path, monkeypatch) -> None:
    """With `share_launchers`, a launcher is built by the first process to claim its argument
    types (what its C source is made of): another kernel of the same types, in this process or
    another one sharing the folder, builds none; without it, every kernel builds its own."""
    from types import SimpleNamespace

    from consumer.kernels import launch

    def kernel(*kinds: str) -> SimpleNamespace:
        return SimpleNamespace(src=SimpleNamespace(signature=dict(enumerate(kinds))))

    a, same_as_a, b = kernel("*bf16", "i32"), kernel("*bf16", "i32"), kernel("*fp32", "i32")
    monkeypatch.setattr(launch, "_claims", [])
    assert launch.first_to_claim(a) and launch.first_to_claim(same_as_a)
    launch.share_launchers(tmp_path)
    assert [launch.first_to_claim(k) for k in (a, same_as_a, b, a)] == [True, False, True, False]
    other = subprocess.run(  # a second worker, sharing the folder
        [sys.executable, "-c", CLAIM_IN_ANOTHER_PROCESS, str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.split() == ["False", "True"]


CLAIM_IN_ANOTHER_PROCESS = """
import sys
from pathlib import Path
from types import SimpleNamespace
from consumer.kernels import launch
launch.share_launchers(Path(sys.argv[1]))
for kinds in (("*bf16", "i32"), ("*fp16", "i64")):
    print(launch.first_to_claim(SimpleNamespace(src=SimpleNamespace(signature=dict(enumerate(kinds))))))
"""


KERNEL_MODULES = {"rowstats", "swiglu", "rope", "fp8_quant", "expert_gemm", "mla_rope"}


def test_a_worker_ends_with_its_summary(monkeypatch, capfd) -> None:
    """A worker's last stderr line is its summary, also when its compiles fail (here: no
    GPU driver for Triton, the device check alone said CUDA), after one line per failure."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    job = precompile.Job(
        model_path=None, tp=1, tp_rank=0, dtype="bfloat16", max_top_k=4, max_sample_n=2,
        token_budget=256, full=True, workers=2,
    )  # fmt: skip
    assert precompile._worker(job, 1) == 1  # every compile failed: no driver
    *before, last = capfd.readouterr().err.strip().splitlines()
    assert last.startswith(precompile.SUMMARY)
    summary = json.loads(last.removeprefix(precompile.SUMMARY))
    failed = [line.split(": ")[0] for line in before if line.split(" ")[0] in KERNEL_MODULES]
    assert summary["variants"] == len(failed) > 0  # (an error's message may span lines)
    assert summary["slowest"][0] in failed
    assert summary["import_s"] >= 0 and summary["compile_s"] >= summary["slowest"][1]


def test_the_plan_compiles_latent_attention_where_the_kernel_takes_the_sizes() -> None:
    """DeepSeek-V3's latent attention (q/k 128 + 64, v 128) gets its attention kernel's
    variant, for this rank's heads; head sizes the compiled kernel does not take (an 8-dim
    rotary part) get none, and the flash call serves them."""
    deepseek = replace(
        TINY, family="deepseek_v3", num_attention_heads=8, num_kv_heads=8, kv_lora_rank=32,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    )  # fmt: skip
    small = replace(deepseek, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    found = {}
    for name, spec in (("deepseek", deepseek), ("small", small)):
        variants = precompile.plan(spec, tp=2, tp_rank=0, batches=[], dtype=torch.bfloat16,
                                   fp8=False)  # fmt: skip
        found[name] = [dict(v.params) for v in variants if v.kernel == "mla_attention"]
    assert found["deepseek"] == [{"heads": 4, "qk_dim": 192, "v_dim": 128, "dtype": torch.bfloat16}]
    assert found["small"] == []


@pytest.mark.parametrize("quack", [True, False], ids=["quack-serves", "no-quack"])
def test_moe_plan_covers_the_combine_launch_where_quack_serves(
    seen: dict[str, set], monkeypatch: pytest.MonkeyPatch, quack: bool
) -> None:
    """Where quack-kernels serves the experts (installed, an sm90 device), the plan compiles
    quack's GEMMs and the combine kernel that follows its down GEMM, as `routed_combined`
    launches it, and of our expert GEMMs gate/up alone (at this width it serves in quack's
    place); without quack, and for FP8 experts, our two GEMMs and nothing of quack's."""
    from consumer.forward.moe import float_routing_weights
    from consumer.kernels import expert_gemm, moe_combine

    monkeypatch.setattr(
        moe_combine, "_combine_kernel", Recorder(moe_combine._combine_kernel, "_combine", seen)
    )
    up = Recorder(expert_gemm._expert_gemm_kernel, "_expert_gemm_kernel", seen)
    monkeypatch.setattr(expert_gemm, "_expert_gemm_kernel", up)
    spec = replace(  # experts of whole 128-blocks: they load in FP8 from an FP8 checkpoint
        TINY, family="qwen3_moe", hidden_size=128, num_experts=4, moe_top_k=2,
        moe_ffn_hidden_size=128,
    )  # fmt: skip
    routing = torch.float32 if float_routing_weights(spec) else torch.bfloat16
    y = torch.zeros(6 * spec.moe_top_k, spec.hidden_size, dtype=torch.bfloat16)
    pos = torch.arange(6 * spec.moe_top_k)
    moe_combine.combine(y, pos, torch.ones(pos.numel(), dtype=routing), spec.moe_top_k)
    bf16 = torch.bfloat16
    fc1 = torch.zeros(spec.num_experts, 2 * 128, spec.hidden_size, dtype=bf16)
    for tokens in (1, 16, 37):  # our gate/up as `routed_combined` calls it at this width
        counts = torch.zeros(spec.num_experts, dtype=torch.int64)
        counts[0] = tokens
        x = torch.zeros(tokens, spec.hidden_size, dtype=bf16)
        expert_gemm.gate_up(x, torch.arange(tokens), fc1, counts)
    for fp8 in (False, True):
        variants = precompile.plan(spec, tp=1, tp_rank=0, batches=[], dtype=bf16, fp8=fp8,
                                   quack=quack)  # fmt: skip
        kernels = {v.kernel for v in variants}
        served = quack and not fp8
        assert ("moe_combine" in kernels) == served, (fp8, kernels)
        # quack's own GEMMs: gate/up, and down into the experts' 128 columns
        gemms = [dict(v.params) for v in variants if v.kernel == "quack_gemm"]
        want = [{"gemm": "gate_up", "dtype": bf16}, {"gemm": "down", "n": 128, "dtype": bf16}]
        assert gemms == (want if served else []), (fp8, gemms)
        [ours] = [dict(v.params) for v in variants if v.kernel == "expert_gemm"]
        assert ours.get("gemms", "both") == ("gate_up" if served else "both")
        for variant in variants:
            if variant.kernel == "moe_combine" or variant.kernel == "expert_gemm" and not fp8:
                precompile.compile_variant(variant)

    def of(kernel: str, kind: str) -> set:
        return {entry for entry in seen[kind] if entry[0] == kernel}

    assert (
        of("_combine", "launched")
        and (of("_combine", "launched") <= of("_combine", "compiled")) == quack
    )
    # our gate/up: compiled whether the variant holds both GEMMs or gate/up alone
    assert of("_expert_gemm_kernel", "launched") <= of("_expert_gemm_kernel", "compiled")

    compiled: list[bool] = []
    monkeypatch.setattr(expert_gemm, "_launch", lambda *a, **kw: compiled.append(kw["swiglu"]))
    experts = {"experts": 4, "hidden": 128, "ffn": 128, "dtype": bf16, "fp8": False,
               "routing_dtype": routing}  # fmt: skip
    expert_gemm.precompile(**experts, gemms="gate_up")
    assert compiled and all(compiled)  # gate/up's variants only (SwiGLU)
    compiled.clear()
    expert_gemm.precompile(**experts)
    assert True in compiled and False in compiled


def test_quack_at_deepseek_width_leaves_our_expert_gemms_out() -> None:
    """At DeepSeek-V3's width quack serves gate/up too: the plan holds none of our expert
    GEMMs, two of quack's (down at DeepSeek-V3's tile only: the start-up probe runs at the
    experts' width); FP8 experts keep ours and nothing of quack's."""
    spec = replace(
        TINY, family="qwen3_moe", hidden_size=7168, num_experts=8, moe_top_k=2,
        moe_ffn_hidden_size=256,
    )  # fmt: skip
    bf16 = torch.bfloat16
    variants = precompile.plan(spec, tp=1, tp_rank=0, batches=[], dtype=bf16, fp8=False,
                               quack=True)  # fmt: skip
    experts = [v.kernel for v in variants if v.kernel in ("expert_gemm", "quack_gemm")]
    assert experts == ["quack_gemm"] * 2
    fp8 = precompile.plan(spec, tp=1, tp_rank=0, batches=[], dtype=bf16, fp8=True, quack=True)
    assert [v.kernel for v in fp8 if v.kernel in ("expert_gemm", "quack_gemm")] == ["expert_gemm"]


def test_quack_gemms_planned_per_tile_and_skipped_off_sm90() -> None:
    """quack compiles a GEMM for symbolic sizes, so the plan holds one compile per GEMM: down
    at the experts' own width, which is also where the start-up probe runs it (on the tile
    that width takes: DeepSeek-V3's 7168 another than GLM-4.5-Air's 4096). Without an sm90
    device (here: none) a worker compiles nothing (quack is not even imported: it is not
    installed on this machine)."""
    from consumer.forward import quack_gemm

    for hidden in (7168, 4096):
        want = [{"gemm": "gate_up"}, {"gemm": "down", "n": hidden}]
        assert quack_gemm.precompile_plan(hidden) == want
    variant = precompile.Variant("quack_gemm", (("gemm", "down"), ("n", 7168),
                                                ("dtype", torch.bfloat16)))  # fmt: skip
    assert precompile.compile_variant(variant) is None
    assert "quack" not in sys.modules


@pytest.fixture
def fp8_configs(hf_checkpoint, tmp_path) -> dict[str, str]:
    """config.json folders of one small model: bf16, and block-quantized FP8 in blocks of 128
    (what FP8 GEMMs take) and of 64 (dequantized at load)."""
    source = hf_checkpoint("qwen2", "plan-fp8-src", seed=3)
    config = json.loads((source / "config.json").read_text())
    out = {"bf16": str(source)}
    for block in (128, 64):
        folder = tmp_path / f"fp8-{block}"
        folder.mkdir()
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [block, block]}  # fmt: skip
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        out[f"fp8-{block}"] = str(folder)
    return out


def test_the_plan_is_fp8_only_where_the_load_computes_in_fp8(fp8_configs) -> None:
    """The workers plan FP8 kernels (the activations' quantization, FP8 expert GEMMs) for a
    checkpoint the load keeps in FP8, and the model dtype's kernels where it dequantizes:
    under `model.fp8=dequantize`, or blocks FP8 GEMMs do not take. The setting is part of
    the plan's digest (a sealed cache holds one plan's kernels)."""
    assert precompile.model_shape(fp8_configs["bf16"])[1] is False
    assert precompile.model_shape(fp8_configs["fp8-128"])[1] is True
    assert precompile.model_shape(fp8_configs["fp8-128"], "dequantize")[1] is False
    assert precompile.model_shape(fp8_configs["fp8-64"])[1] is False
    job = precompile.Job(
        model_path=fp8_configs["fp8-128"], tp=1, tp_rank=0, dtype="bfloat16", max_top_k=4,
        max_sample_n=2, token_budget=256, full=True, workers=1,
    )  # fmt: skip
    assert job.fp8 == "auto"
    assert replace(job, fp8="dequantize").digest() != job.digest()


@pytest.mark.parametrize(("capability", "cuda", "fp8"), [
    ((9, 0), "13.0", True), ((8, 0), "13.0", False), ((9, 0), "12.4", False),
])  # fmt: skip
def test_a_worker_plans_fp8_only_where_the_device_runs_it(
    fp8_configs, monkeypatch, capability, cuda, fp8
) -> None:
    """An FP8 checkpoint loads dequantized where the device (before sm90) or CUDA (before
    12.9) has no block-scaled FP8 GEMM: a worker asks both without a CUDA context
    (`fp8_gemm.platform_problem`) and plans accordingly."""
    seen: list[dict] = []
    monkeypatch.setattr(precompile, "warmup_plan", lambda *a, **kw: seen.append(kw) or [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    job = precompile.Job(
        model_path=fp8_configs["fp8-128"], tp=1, tp_rank=0, dtype="bfloat16", max_top_k=4,
        max_sample_n=2, token_budget=256, full=True, workers=1,
    )  # fmt: skip
    assert precompile._worker(job, 0) == 0  # (quack allowed, as by default: the process's)
    assert [kw["fp8"] for kw in seen] == [fp8]


def test_workers_share_the_plan_with_quack_s_compiles_on_workers_of_their_own() -> None:
    """Every variant goes to exactly one worker. Triton's kernels alone go round the workers
    in plan order (each the next variant: as before quack's compiles were costed), and
    quack's GEMMs, about eight of Triton's compiles each, get a worker each where the plan
    leaves the others enough: for DeepSeek-V3's experts over 8 workers, the two quack workers
    compile nothing else."""
    spec = replace(
        TINY, family="qwen3_moe", hidden_size=7168, num_experts=8, moe_top_k=2,
        moe_ffn_hidden_size=256,
    )  # fmt: skip
    batches = warmup.plan(max_top_k=8, max_sample_n=4, vocab_size=spec.vocab_size,
                          max_input_tokens=spec.max_input_tokens, token_budget=4096, full=True,
                          graphs=False)  # fmt: skip
    variants = precompile.plan(spec, tp=1, tp_rank=0, batches=batches, dtype=torch.bfloat16,
                               fp8=False, quack=True)  # fmt: skip
    assert sum(v.kernel == "quack_gemm" for v in variants) == 2 and len(variants) > 8
    shares = [precompile.share(variants, 8, i) for i in range(8)]
    assert sorted(map(repr, sum(shares, []))) == sorted(map(repr, variants))  # each once
    for mine in shares:
        assert mine == [v for v in variants if v in mine]  # in plan order
    alone = [mine for mine in shares if any(v.kernel == "quack_gemm" for v in mine)]
    assert [[v.kernel for v in mine] for mine in alone] == [["quack_gemm"], ["quack_gemm"]]
    triton = [v for v in variants if v.kernel != "quack_gemm"]
    assert [precompile.share(triton, 3, i) for i in range(3)] == [triton[i::3] for i in range(3)]
    # fewer workers than the costs want: the quack workers take the rest last
    two = [precompile.share(variants, 2, i) for i in range(2)]
    assert sorted(sum(v.kernel == "quack_gemm" for v in mine) for mine in two) == [1, 1]
