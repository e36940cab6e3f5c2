"""The README's frontier performance table, one command per row (issue 50).

Each row is one run of bench/gpu_e2e.py (transformers against a real consumer through the
queue, on the same documents) with that row's model cut, workloads and settings; its JSON
(the command's arguments, the software versions, the model's config.json fields, both sides'
figures) goes to `--out` (default bench/results/<row>.json).

    python bench/rows.py deepseek-v3-sparse     # one row
    python bench/rows.py deepseek-v3-sparse --pass-forwards 8 --iters 2   # larger windows
    python bench/rows.py --list                 # the rows and their commands

Arguments after the row go to bench/gpu_e2e.py after the row's own (so they override them):
long-tailed lengths need larger windows than the default here, since a pass holds only a
few of the 16k-32k documents that dominate its attention.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WINDOWS = ["--pass-forwards", "4", "--iters", "1", "--e2e-forwards", "12",
           "--e2e-warmup-forwards", "8"]  # fmt: skip
ROWS = {
    # Qwen3-30B-A3B cut to 16 layers: 128 experts of 768, top-8
    "qwen3-30b-a3b-16l": ["--models", "30b-a3b-16l", "--workloads", "uniform,longtail"],
    # GLM-4.5-Air: 1 dense + 9 sparse layers, 128 experts of 1408, 1 shared
    "glm-4.5-air": ["--models", "glm-4.5-air-10l", "--workloads", "uniform,longtail"],
    # DeepSeek-V3: 1 dense + 3 sparse layers (more sparse than dense, as 3 + 58 is), MLA,
    # 256 experts of 2048 in 8 groups, top-8, 1 shared
    "deepseek-v3-sparse": ["--models", "deepseek-v3-sparse", "--workloads", "uniform,longtail"],
    # the same with 2 sparse layers: fits an H100's 78 GiB (the cut above peaks at 84-90 GiB)
    "deepseek-v3-2s": ["--models", "deepseek-v3-2s", "--workloads", "uniform,longtail"],
    # Qwen3-8B with its linears block-quantized (128 x 128, e4m3) against our own bf16
    "qwen3-8b-fp8": [
        "--models",
        "qwen3-8b",
        "--workloads",
        "uniform,grpo",
        "--e2e-variants",
        "fp8=1",
    ],  # fmt: skip
    # the DeepSeek-V3 cut above with its routed experts and dense MLP block-quantized (as
    # the published FP8 checkpoints are; latent attention and the shared expert stay bf16)
    # against our own bf16 on the same windows
    "deepseek-v3-2s-fp8": [
        "--models",
        "deepseek-v3-2s",
        "--workloads",
        "uniform",
        "--e2e-variants",
        "fp8=1",
    ],  # fmt: skip
}
# Environment a row's processes need besides the caller's: on an H100, transformers' fp32
# log_softmax of the long-tailed DeepSeek cut's longest batch needs 12.1 GiB of the last 11.5
# left free (docs/benchmarks.md, MoE run 6) unless the allocator may grow its segments.
ENV = {
    row: {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for row in ("deepseek-v3-2s", "deepseek-v3-2s-fp8")
}


def command(row: str, out: Path, extra: list[str] | None = None) -> list[str]:
    """The bench/gpu_e2e.py command line of `row`, writing its JSON to `out`; `extra`
    arguments come last (argparse keeps an option's last value)."""
    return [sys.executable, str(HERE / "gpu_e2e.py"), *ROWS[row], *WINDOWS,
            "--json-out", str(out), *(extra or [])]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("row", nargs="?", choices=sorted(ROWS))
    parser.add_argument("--out", type=Path, help="the JSON (default bench/results/<row>.json)")
    parser.add_argument("--list", action="store_true", help="print the rows' commands")
    args, extra = parser.parse_known_args()
    if args.list or args.row is None:
        for row in ROWS:
            env = " ".join(f"{k}={v}" for k, v in ENV.get(row, {}).items())
            cmd = " ".join(command(row, HERE / "results" / f"{row}.json")[1:])
            print(f"{row}: {env + ' ' if env else ''}{cmd}")
        return
    out = args.out or HERE / "results" / f"{args.row}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV.get(args.row, {})}
    sys.exit(subprocess.call(command(args.row, out, extra), env=env))


if __name__ == "__main__":
    main()
