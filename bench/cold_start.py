"""Cold start, first pass and weight updates of a real consumer (issue 37), side by side.

On a fresh process (a real `python -m consumer`, an embedded valkey-server, file:// storage):

1. **Time to ready by phase** (`consumer.ready`'s `phases_s`: import, setup, build, read,
   copy, load, compile, warmup, open) in three starts: "cold", a fresh machine (an empty
   compile cache, empty Triton and CUDA homes); "shared", a fresh machine given the cache the
   first start sealed (a copy of its `consumer.compile_cache_dir`, as a volume shared by the
   consumers hands it over; empty Triton and CUDA homes); "pulled", a fresh machine with an
   empty compile cache that fetches the archive the first start stored in object storage
   (`consumer.compile_cache_url`, here file://); "warm", a restart on the first start's own
   cache and homes; "baked" (not in the default list), a fresh machine with an empty compile
   cache and no store, given a seed compiled before it without a GPU
   (`python -m consumer.serve.bake`, timed: `bake_s`) as `consumer.compile_cache_seed`.
   Each with the kernels the warm-up still compiled itself
   (`compiled_in_warmup`: 0 when the precompile or the cache had them all), the precompile
   workers' seconds, and the cache's state; against the issue's targets (10 s + weight bytes
   at 2 GB/s fresh, 8 s + bytes at 2 GB/s warm).
2. **First pass vs warm pass of every output** on documents of `--doc-tokens` tokens: for each
   output (next-token log-probs, labels, top-k, samples, entropy, temperature 0.7, all at once)
   one pass of `--docs` documents the consumer has never seen that output for, then a second
   pass of new documents; tokens/s of each and their ratio (the issue's target: >= 0.90).
3. **Weight update gap**: `update-weights` to a checkpoint of the same shape (loaded in place)
   and to one of another shape (built anew), each while a pass is being served: the
   consumer's `weights.updated` line (`in_place`, `gap_s` = last batch on the old weights to
   serving the new ones, `drain_s`) and the command's wall time.

Checkpoints are random-init Hugging Face directories written here (no network), with the same
writer as scripts/make_checkpoint.py, in bf16; kept in `--work` so a rerun reuses them.

    python bench/cold_start.py                       # Qwen2.5-1.5B shape on the GPU
    python bench/cold_start.py --parts none --out /tmp/cold.json   # time to ready only
    python bench/cold_start.py --model tiny --device cpu --docs 8 --doc-tokens 64  # plumbing
    python bench/cold_start.py --model deepseek-v3-sparse --fast-write --parts none   # MoE cut

Besides the Qwen2 shapes (MODELS), `--model` takes the frontier MoE cuts of
bench/gpu_common.py's FRONTIER (DeepSeek-V3 and GLM-4.5-Air; `tiny-deepseek` on the CPU): the
issue's "any model" readiness target.

`--out` writes the whole report (versions, GPU, the model's shape, settings, every start's
phases, the passes and the updates) as one JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from a checkout

from bench.gpu_common import (  # noqa: E402 - no torch at import
    FRONTIER,
    child_env,
    frontier,
    transformers_config,
)

# Qwen2.5-1.5B's and 7B's shapes (public config.json), and a tiny one for a smoke test.
MODELS = {
    "1.5b": {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "num_layers": 28,
        "num_attention_heads": 12,
        "num_kv_heads": 2,
        "intermediate_size": 8960,
        "tie_embeddings": True,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
    },
    # Qwen2.5-7B's shape (public config.json): ~15 GB of bf16 weights.
    "7b": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "num_layers": 28,
        "num_attention_heads": 28,
        "num_kv_heads": 4,
        "intermediate_size": 18944,
        "tie_embeddings": False,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
    },
    "tiny": {
        "vocab_size": 500,
        "hidden_size": 64,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 128,
    },
}
OUTPUTS = {
    "logprobs": {},
    "labels": {"labels": 4},
    "top_k": {"top_k": 64},
    "samples": {"sample_n": 8},
    "entropy": {"return_entropy": True},
    "temperature": {"temperature": 0.7},
    "all": {"labels": 4, "top_k": 64, "sample_n": 8, "return_entropy": True},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS) + sorted(FRONTIER), default="1.5b")
    p.add_argument("--work", type=Path, default=Path("/tmp/teacherq-cold-start"))
    p.add_argument("--device", default="auto")
    p.add_argument("--docs", type=int, default=128, help="documents per pass")
    p.add_argument("--doc-tokens", type=int, default=2048)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--outputs", default=",".join(OUTPUTS), help="comma-separated")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument(
        "--parts",
        default="passes,same_shape,other_shape",
        help="what to measure after time to ready (comma-separated): passes (first vs warm "
        "pass of every output), same_shape (update in place), other_shape (update rebuilt); "
        "none: time to ready only",
    )
    p.add_argument(
        "--starts",
        default="cold,shared,pulled,warm",
        help="which starts to measure, comma-separated, in that order (`cold` first: the "
        "others use what it leaves); `baked` also",
    )
    p.add_argument("--out", type=Path, help="write the report here as JSON")
    p.add_argument(
        "--drop-page-cache",
        action="store_true",
        help="before the cold and shared starts, drop the OS page cache (needs root; the "
        "report says whether it worked): torch's libraries are read from disk as on a fresh "
        "machine",
    )
    p.add_argument(
        "--prefetch-too",
        action="store_true",
        help="last, four more fresh-machine starts, side by side in pairs, `model.prefetch` "
        "off then on: with an empty compile cache of its own each (no compile cache store), "
        "then with a copy of the sealed cache (as `shared`): the checkpoint prefetch's gain "
        "with and without precompile workers beside it, every start after the run's first",
    )
    p.add_argument(
        "--fast-write",
        action="store_true",
        help="draw the checkpoints' tensors on the device and save them directly (7B: "
        "seconds, not minutes)",
    )
    p.add_argument(
        "--link-same-shape",
        action="store_true",
        help="the same-shape update reads hard links to the first checkpoint's files (the "
        "same bytes under another path: the reload costs the same, one checkpoint less to write)",
    )
    args = p.parse_args(argv)
    unknown = set(args.starts.split(",")) - {name for name, _, _ in STARTS}
    if unknown:
        p.error(
            f"--starts: {sorted(unknown)} are not starts; name some of "
            + ",".join(name for name, _, _ in STARTS)
        )
    return args


def model_config(model: str, **changes: int):
    """The transformers config of `model`: a Qwen2 shape of MODELS (`changes` are
    `hf_config`'s sizes), or a frontier MoE cut of FRONTIER (`changes`: `frontier`'s layers)."""
    from consumer.checkpoints.synthetic import hf_config

    if model in FRONTIER:
        return transformers_config(frontier(**{**FRONTIER[model], **changes}))
    return hf_config("qwen2", **{**MODELS[model], **changes})


def checkpoint(
    work: Path, model: str, name: str, seed: int, fast_on: str | None = None, **changes: int
) -> Path:
    """A random-init bf16 checkpoint of `model`'s shape (with `changes`), written once.

    With `fast_on` (a torch device), the tensors are drawn there and saved straight to
    safetensors shards (N(0, 0.02), norms 1): seconds instead of minutes for a 7B model,
    whose fp32 Hugging Face init on the CPU would take longer than the measurement. Frontier
    cuts are always drawn (on the CPU without `fast_on`)."""
    import torch

    from consumer.checkpoints.synthetic import write_random_hf_checkpoint

    out = work / f"{model}-{name}"
    if not (out / "config.json").is_file():
        t0 = time.monotonic()
        if fast_on is None and model not in FRONTIER:
            sizes = {**MODELS[model], **changes}
            write_random_hf_checkpoint(out, "qwen2", seed=seed, dtype=torch.bfloat16, **sizes)
        else:
            write_drawn_checkpoint(out, model_config(model, **changes), seed, fast_on or "cpu")
        print(f"# wrote {out} in {time.monotonic() - t0:.0f} s", flush=True)
    return out


def write_drawn_checkpoint(out: Path, config, seed: int, device: str) -> None:
    """A checkpoint of transformers `config` whose tensors are drawn on `device` (see
    `checkpoint`): every tensor the model's state dict holds, in its in-memory layout (MoE
    experts fused, as transformers 5 holds them; the loader reads that layout too)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    shapes = {k: v.shape for k, v in meta.state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    shard: dict = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        files.append(name)
        shard.clear()

    held = 0
    for key, shape in shapes.items():
        if key.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            t.normal_(0.0, 0.02, generator=gen)
            t = t.cpu()
        shard[key] = t
        held += t.numel() * 2
        if held >= 4 << 30:
            flush()
            held = 0
    if shard:
        flush()
    total = sum((out / f).stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)


class Consumer:
    """A real consumer process and its JSON log."""

    def __init__(
        self, settings, log_path: Path, cwd: Path, extra_env: dict[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        env = {**child_env(settings), **(extra_env or {})}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "consumer"],
                env=env,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def events(self, name: str) -> list[dict]:
        """Every logged event called `name`, in order."""
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if e.get("event") == name:
                out.append(e)
        return out

    def wait_event(self, name: str, count: int, timeout: float) -> list[dict]:
        """Block until `name` was logged `count` times (poll; raises if the process died)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.events(name)
            if len(got) >= count:
                return got
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-4000:]
                raise RuntimeError(f"consumer exited ({self.proc.returncode}):\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not logged {count} times")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, and wait for it to drain and exit."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=300)


def measure_starts(settings, run: Path, model: Path, args: argparse.Namespace, report: dict):
    """The `--starts` in order; returns the last one's consumer (still running) and each
    start's figures. `baked` first bakes a seed (`bake_s` in `report`)."""
    starts = {}
    wanted = [(n, c, m) for n, c, m in STARTS if n in args.starts.split(",")]
    for name, cache, machine in wanted:
        if name == "shared":  # the sealed cache, as another machine finds it on the volume
            shutil.copytree(run / "compile-cache", run / cache)
        chosen = settings
        if name == "baked":  # a seed compiled without the GPU, and no store to pull from
            report["bake_s"] = bake(settings, model, run / "seed", run / "bake.log")
            update = {"compile_cache_seed": run / "seed", "compile_cache_url": None}
            chosen = settings.model_copy(
                update={"consumer": settings.consumer.model_copy(update=update)}
            )
        consumer, starts[name] = start(name, chosen, run, cache, machine, args)
        print(f"# ready ({name}): {starts[name]}", flush=True)
        if name == "cold":  # its archive stored before the "pulled" machine looks
            consumer.wait_event("compile_cache.pushed", 1, args.timeout)
        if (name, cache, machine) != wanted[-1]:
            consumer.stop()
    return consumer, starts


def bake(settings, model: Path, out: Path, log_path: Path) -> float:
    """`python -m consumer.serve.bake` for the consumers' `settings` and `model`'s config.json
    into `out` (its output into `log_path`); its seconds."""
    env = child_env(settings)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        command = [sys.executable, "-m", "consumer.serve.bake", str(out), "--config", str(model)]
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return round(time.monotonic() - t0, 2)


def requests(output: str, *, docs: int, tokens: int, vocab: int, seed: int) -> list:
    """`docs` new random documents asking for `output`."""
    import numpy as np

    from shared.messages import TeacherRequest

    rng = np.random.default_rng(seed)
    opts = dict(OUTPUTS[output])
    width = opts.pop("labels", 0)
    reqs = []
    for i in range(docs):
        ids = rng.integers(0, vocab, size=tokens, dtype=np.int64)
        labels = rng.integers(0, vocab, size=(tokens - 1, width)) if width else None
        reqs.append(TeacherRequest(input_ids=ids, label_token_ids=labels, seed=i, **opts))
    return reqs


def timed_pass(client, reqs: list, timeout: float) -> float:
    """Tokens/s of submitting `reqs` and waiting for every result."""
    t0 = time.monotonic()
    results = client.wait(client.submit(reqs), timeout=timeout, progress=False)
    seconds = time.monotonic() - t0
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} jobs failed, e.g. {bad[0]}")
    return sum(len(r.input_ids) for r in reqs) / seconds


# The starts measured: (name, compile cache, machine homes). cold: a fresh machine; shared: a
# fresh machine whose consumer finds the cache the cold start sealed; warm: the cold start's
# machine again.
STARTS = (
    ("cold", "compile-cache", "machine-a"),
    ("shared", "compile-cache-shared", "machine-b"),
    ("pulled", "compile-cache-pulled", "machine-c"),
    ("warm", "compile-cache", "machine-a"),
    ("baked", "compile-cache-baked", "machine-d"),
)


def machine_env(home: Path) -> dict[str, str]:
    """Per-machine caches outside the compile cache, pointed under `home` (empty: a fresh
    machine): Triton's home (dumps, overrides) and the CUDA driver's JIT cache."""
    return {"TRITON_HOME": str(home / "triton-home"), "CUDA_CACHE_PATH": str(home / "nv-cache")}


def drop_page_cache() -> bool:
    """Drop the OS page cache (root only); whether it worked."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def versions() -> dict:
    """The software and the device the figures come from (bench/gpu_common.py's), and the
    host's CPU count."""
    from bench.gpu_common import versions as software

    return {**software(), "cpus": os.cpu_count()}


def weight_bytes(path: Path) -> int:
    """Bytes of the checkpoint's weight files."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def start(
    name: str, settings, run: Path, cache: str, machine: str, args: argparse.Namespace
) -> tuple[Consumer, dict]:
    """Start a consumer on compile cache `cache` and machine homes `machine`; its time to
    ready by phase and what its warm-up line says about compiling."""
    s = settings.model_copy(
        update={
            "consumer": settings.consumer.model_copy(update={"compile_cache_dir": str(run / cache)})
        }
    )
    dropped = drop_page_cache() if args.drop_page_cache and name != "warm" else None
    consumer = Consumer(s, run / f"consumer-{name}.log", run, machine_env(run / machine))
    t0 = time.monotonic()
    [ready] = consumer.wait_event("consumer.ready", 1, args.timeout)
    [warmed] = consumer.events("consumer.warmed_up")[:1] or [{}]
    [fetched] = consumer.events("checkpoint.prefetched")[:1] or [{}]
    return consumer, {
        "wall_s": round(time.monotonic() - t0, 2),
        **ready["phases_s"],
        "compiled_in_warmup": warmed.get("compiled_in_warmup"),
        "compiled_in_warmup_kernels": warmed.get("compiled_in_warmup_kernels"),
        "precompile": warmed.get("precompile"),
        "compile_cache_found": (warmed.get("compile_cache") or {}).get("opened"),
        "page_cache_dropped": dropped,
        "prefetch": {k: fetched.get(k) for k in ("bytes", "seconds", "finished_before_load")},
    }


def prefetch_starts(
    consumer: Consumer, settings, run: Path, args: argparse.Namespace, starts: dict
) -> Consumer:
    """`--prefetch-too`: fresh-machine starts, `model.prefetch` off then on (no compile cache
    store), first each on an empty compile cache (precompile workers read and compile beside
    the prefetch), then each on a copy of the sealed cache (nothing to compile: the warm-up
    on the shell can run while the checkpoint is read). Each starts after the consumer before
    it stopped; returns the last consumer."""
    pairs = (
        ("fresh-off", False, False),
        ("fresh-prefetch", True, False),
        ("shared-off", False, True),
        ("shared-prefetch", True, True),
    )
    for name, prefetch, sealed in pairs:
        consumer.stop()  # one consumer at a time
        other = settings.model_copy(
            update={
                "model": settings.model.model_copy(update={"prefetch": prefetch}),
                "consumer": settings.consumer.model_copy(update={"compile_cache_url": None}),
            }
        )
        cache = f"compile-cache-{name}"
        if sealed:
            shutil.copytree(run / "compile-cache", run / cache)
        consumer, starts[name] = start(name, other, run, cache, f"machine-{name}", args)
        print(f"# ready ({name}): {starts[name]}", flush=True)
    return consumer


def summary(report: dict, out: Path | None) -> None:
    """Targets, the JSON report (stdout, and `out`) and readable lines."""
    load_s = report["weight_bytes"] / 2e9  # the allowance: bytes at 2 GB/s
    report["targets_s"] = {
        "cold": 10 + load_s, "shared": 8 + load_s, "pulled": 8 + load_s, "warm": 8 + load_s,
        "baked": 10 + load_s,
        "fresh-off": 10 + load_s, "fresh-prefetch": 10 + load_s,
        "shared-off": 8 + load_s, "shared-prefetch": 8 + load_s,
    }  # fmt: skip
    print(json.dumps(report))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    skip = ("total", "wall_s", "precompile", "compile_cache_found", "page_cache_dropped",
            "prefetch")  # fmt: skip
    for name, phases in report["time_to_ready_s"].items():
        target = report["targets_s"][name]
        flag = "" if phases["total"] <= target else f"   <-- above {target:.1f} s"
        print(f"time to ready ({name}): {phases['total']:.1f} s{flag}")
        print("  phases:", {k: v for k, v in phases.items() if k not in skip})
        print("  checkpoint prefetch:", phases.get("prefetch"))
    for output, p in report["passes"].items():
        flag = "" if p["first_over_warm"] >= 0.9 else "   <-- below 0.90"
        print(f"first/warm {output:12s} {p['first_over_warm']:.2f}{flag}")
    for label, u in report["weight_updates"].items():
        print(f"update gap ({label}): {u['gap_s']} s (in_place={u['in_place']})")


def main(argv: list[str] | None = None) -> int:
    """Run the three measurements and print one JSON summary plus readable ratios."""
    from producer import TeacherClient
    from shared.redis_server import ensure_embedded, stop_embedded
    from shared.settings import Settings

    args = parse_args(argv)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(",")) - {"", "none"}
    fast = ("cuda" if args.device == "auto" else args.device) if args.fast_write else None
    a = checkpoint(work, args.model, "a", seed=1, fast_on=fast)
    targets = []
    if "same_shape" in parts:
        if args.link_same_shape:
            b = work / f"{args.model}-a-linked"
            if not b.is_dir():
                b.mkdir()
                for f in a.iterdir():
                    os.link(f, b / f.name)
        else:
            b = checkpoint(work, args.model, "b", seed=2, fast_on=fast)
        targets.append(("same_shape", b))
    if "other_shape" in parts:
        # another shape (half the layers: quicker to write than a third full model)
        config = model_config(args.model)
        layers = max(1, config.num_hidden_layers // 2)
        key = "layers" if args.model in FRONTIER else "num_layers"
        half = checkpoint(work, args.model, "half", 3, fast, **{key: layers})
        targets.append(("other_shape", half))
    run = work / f"run-{int(time.time())}"
    home = run / "valkey"
    url, _ = ensure_embedded(home)
    shape = MODELS.get(args.model) or frontier(**FRONTIER[args.model])
    vocab = shape["vocab_size"]
    report: dict = {
        "model": args.model,
        "shape": shape,
        "weight_bytes": weight_bytes(a),
        "doc_tokens": args.doc_tokens,
        "docs": args.docs,
        "token_budget": args.token_budget,
        "versions": versions(),
    }
    try:
        settings = Settings(
            redis={"url": url, "home": str(home)},
            queue={"name": "cold"},
            storage={"url": f"file://{run / 'objects'}"},
            model={"path": str(a), "dtype": "auto"},
            consumer={
                "device": args.device,
                "token_budget": args.token_budget,
                "batch_max_jobs": 256,
                "block_ms": 200,
                "compile_cache_url": f"file://{run / 'cache-store'}",
            },
            log={"format": "json"},
        )
        client = TeacherClient(settings)
        consumer, starts = measure_starts(settings, run, a, args, report)
        if args.prefetch_too:
            consumer = prefetch_starts(consumer, settings, run, args, starts)
        report["time_to_ready_s"] = starts

        passes = {}
        for i, output in enumerate(args.outputs.split(",") if "passes" in parts else []):
            rates = [
                timed_pass(
                    client,
                    requests(
                        output,
                        docs=args.docs,
                        tokens=args.doc_tokens,
                        vocab=vocab,
                        seed=100 * i + k,
                    ),
                    args.timeout,
                )
                for k in range(2)
            ]
            passes[output] = {
                "first_tok_s": round(rates[0]),
                "warm_tok_s": round(rates[1]),
                "first_over_warm": round(rates[0] / rates[1], 3),
            }
            print(f"# {output}: {passes[output]}", flush=True)
        report["passes"] = passes

        updates = {}
        for n, (label, path) in enumerate(targets, 1):
            reqs = requests(
                "logprobs", docs=args.docs, tokens=args.doc_tokens, vocab=vocab, seed=900 + n
            )
            ids = client.submit(reqs)  # served while the update comes
            t0 = time.monotonic()
            client.update_weights(str(path), timeout=args.timeout)
            wall = time.monotonic() - t0
            client.wait(ids, timeout=args.timeout, progress=False)
            line = consumer.wait_event("weights.updated", n, 60)[n - 1]
            updates[label] = {
                "in_place": line.get("in_place"),
                "gap_s": line.get("gap_s"),
                "drain_s": line.get("drain_s"),
                "command_s": round(wall, 2),
            }
            print(f"# update ({label}): {updates[label]}", flush=True)
        report["weight_updates"] = updates
        consumer.stop()
    finally:
        stop_embedded(home)

    summary(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
