"""Checkpoint load from a cold page cache: the loader's own page faults against reads ahead.

Writes a random-init Hugging Face checkpoint of a model shape (bench/cold_start.py's MODELS,
bf16, 4 GB shards), builds the model once on --device, then times `load_hf_weights` into it
with each --threads value (0: the copy's page faults read the file, as before
`consumer/checkpoints/parallel_read.py`), side by side, the order rotated every repeat. Before
each cold load the checkpoint's pages are evicted from the page cache (fsync, then
POSIX_FADV_DONTNEED: no root needed); a warm load (pages cached) follows each, to show the
read-ahead costs nothing there. A `d` variant (`--threads d8`) reads straight into staging
buffers with O_DIRECT, past the page cache: its "warm" load reads the disk again. A `g`
variant (`--threads g8`) populates through Python's own `mmap.madvise`, which holds the GIL
while the kernel reads (the loader before 2026-12-06), against the ctypes call that lets it go.

    python bench/checkpoint_read.py --model 1.5b --layers 12      # CPU: ~1.6 GB
    python bench/checkpoint_read.py --model 7b --device cuda      # GPU: 15 GB

Prints one line per load and the medians; --out writes them as JSON with the versions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    from bench.cold_start import MODELS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="1.5b")
    p.add_argument("--layers", type=int, help="cut the model to this many layers")
    p.add_argument("--work", type=Path, default=Path("/tmp/teacherq-checkpoint-read"))
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads",
        default="0,4,8,16",
        help="comma-separated read threads; d8 is 8 threads reading straight into staging "
        "buffers (consumer/checkpoints/direct_read.py) instead of the page cache; g8 is 8 "
        "threads populating through mmap.madvise, holding the GIL while they read",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the report here as JSON")
    return p.parse_args(argv)


def write_checkpoint(args: argparse.Namespace) -> Path:
    """The bench's checkpoint, written once per shape (kept in --work between runs)."""
    import torch

    from bench.cold_start import MODELS
    from consumer.checkpoints.synthetic import write_random_hf_checkpoint

    sizes = dict(MODELS[args.model])
    if args.layers:
        sizes["num_layers"] = args.layers
    out = args.work / f"{args.model}-{sizes['num_layers']}l"
    if not (out / "config.json").is_file():
        write_random_hf_checkpoint(
            out, "qwen2", seed=0, dtype=torch.bfloat16, max_shard_size="4GB", **sizes
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    from bench.cold_start import versions
    from consumer import cpu_compat
    from consumer.checkpoints import HfCheckpoint, page_cache, spec_from_hf_config
    from consumer.checkpoints.hf import load_hf_weights
    from consumer.checkpoints.page_cache import evict
    from consumer.forward.model import build_model
    from consumer.parallel import init_parallel
    from shared.log import configure_logging

    configure_logging(level="warning", fmt="console")

    path = write_checkpoint(args)
    files = sorted(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    device = torch.device(args.device)
    spec = spec_from_hf_config(HfCheckpoint(path).config)
    cpu_compat.apply()
    layout = init_parallel(tp=1, pp=1)
    model = build_model(
        spec, layout, params_dtype=torch.bfloat16, device=device, init_weights=False
    )

    def load(variant: str) -> float:
        start = time.perf_counter()
        direct = variant.startswith("d")
        threads = int(variant.lstrip("dg"))
        # g: no address for ctypes, so `populate` falls back to Python's mmap.madvise
        address = page_cache._address
        page_cache._address = (lambda _: None) if variant.startswith("g") else address
        try:
            load_hf_weights(model, spec, path, layout, read_threads=threads, read_direct=direct)
        finally:
            page_cache._address = address
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    threads = args.threads.split(",")
    runs: list[dict] = []
    for repeat in range(args.repeats):
        order = threads[repeat % len(threads) :] + threads[: repeat % len(threads)]
        for t in order:
            evict(files)
            cold = load(t)
            warm = load(t)
            runs.append({"threads": t, "cold_s": cold, "warm_s": warm})
            print(
                f"threads {t:>3}: cold {cold:6.2f} s ({size / cold / 1e9:5.2f} GB/s), "
                f"warm {warm:6.2f} s ({size / warm / 1e9:5.2f} GB/s)",
                flush=True,
            )
    summary = {}
    for t in threads:
        cold = statistics.median(r["cold_s"] for r in runs if r["threads"] == t)
        warm = statistics.median(r["warm_s"] for r in runs if r["threads"] == t)
        summary[t] = {"cold_s": cold, "warm_s": warm, "cold_gb_s": size / cold / 1e9}
    base = summary[threads[0]]
    print(f"\n{args.model}, {len(files)} file(s), {size / 1e9:.2f} GB, device {device}, medians:")
    for t, row in summary.items():
        print(
            f"  threads {t:>3}: cold {row['cold_s']:6.2f} s ({row['cold_gb_s']:5.2f} GB/s, "
            f"{base['cold_s'] / row['cold_s']:4.2f}x threads {threads[0]}), "
            f"warm {row['warm_s']:6.2f} s ({base['warm_s'] / row['warm_s']:4.2f}x)"
        )
    report = {
        "model": args.model,
        "layers": len(model.decoder.layers),
        "bytes": size,
        "files": len(files),
        "device": str(device),
        "versions": versions(),
        "runs": runs,
        "medians": summary,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
