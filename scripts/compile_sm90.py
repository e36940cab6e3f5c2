"""Compile the consumer's Triton kernels for Hopper (sm_90a) on a machine without a GPU.

GPU time is scarce. This checks, on the CPU, the kernel variants that a consumer's warm-up
compiles. It takes the variants from the plan of `consumer/serve/precompile.py`, for a
model's config.json or for a shape of bench/gpu_common.py. Each variant must build for sm_90a
with the installed Triton. The script reports what each variant would cost on the device:
- registers per thread and bytes spilled, from `ptxas -v` (the ptxas that ships with Triton);
- shared memory;
- how many wgmma and TMA instructions its PTX holds.

Nothing is launched, and no CUDA driver is needed: Triton gets a stand-in for the active
driver that names an sm_90 target. The figures are those of the Triton release installed
here. For the GPU machine's, install its release (Triton 3.6 with torch 2.11 there) into a
Python 3.12 environment and run the script with that. The exit status is 1 if any variant
fails to compile.

    python scripts/compile_sm90.py                              # the tiny preset
    python scripts/compile_sm90.py --shape deepseek-v3          # a bench/gpu_common shape
    python scripts/compile_sm90.py --config path/to/checkpoint  # its config.json
    python scripts/compile_sm90.py --shape deepseek-v3 --kernel expert_gemm --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages


def ptxas_info(ptx: str) -> dict[str, int]:
    """Registers per thread and spilled bytes of one kernel's PTX, from `ptxas -v`."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o", os.devnull]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    info = {"registers": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}
    for line in report.splitlines():
        words = line.replace(",", "").split()
        for i, word in enumerate(words[1:], 1):
            if word == "registers":
                info["registers"] = int(words[i - 1])
            elif word == "spill" and words[i + 1] in ("stores", "loads"):
                info[f"spill_{words[i + 1][:-1]}_bytes"] = int(words[i - 2])
    return info


def variants(args: argparse.Namespace) -> list[Any]:
    """The precompile plan's variants for the model the arguments name."""
    import torch

    from consumer.checkpoints.hf_config import spec_from_hf_config
    from consumer.serve import precompile

    if args.shape:
        from bench.gpu_common import SHAPES, shape

        if args.shape not in SHAPES:
            raise SystemExit(f"--shape: {args.shape!r} is not one of {sorted(SHAPES)}")
        config = shape(args.shape)
        spec, fp8 = spec_from_hf_config(config), args.fp8
    else:
        spec, fp8 = precompile.model_shape(args.config)
        fp8 = fp8 or args.fp8
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    plan = precompile.warmup_plan(
        spec,
        tp=args.tp,
        tp_rank=0,
        ep=args.ep,
        dtype=dtype,
        fp8=fp8,
        max_top_k=args.max_top_k,
        max_sample_n=args.max_sample_n,
        token_budget=args.token_budget,
        full=True,
    )
    return [v for v in plan if not args.kernel or v.kernel in args.kernel]


def compile_all(plan: list[Any]) -> list[dict]:
    """Compile each variant for the stand-in target; one report row per compiled kernel."""
    from consumer.kernels import launch
    from consumer.serve.precompile import compile_variant

    found: list[Any] = []

    def collect(compiled: Any) -> None:  # instead of building its launcher (needs a driver)
        found.append(compiled)

    launch.build_launchers = collect
    rows = []
    for variant in plan:
        found.clear()
        began = time.monotonic()
        try:
            compile_variant(variant)
        except Exception as exc:  # noqa: BLE001 - reported per variant
            error = f"{type(exc).__name__}: {exc}"
            if exc.__cause__ is not None:  # Triton's CompilationError names the line; its cause
                error += f"\ncaused by {type(exc.__cause__).__name__}: {exc.__cause__}"
            rows.append({"variant": variant.name(), "error": error})
            continue
        seconds = time.monotonic() - began
        for kernel in found:
            for one in kernel if isinstance(kernel, list) else [kernel]:
                ptx = one.asm["ptx"]
                rows.append({
                    "variant": variant.name(),
                    "kernel": one.name,
                    "compile_s": round(seconds, 2),
                    **ptxas_info(ptx),
                    "shared_bytes": one.metadata.shared,
                    "warps": one.metadata.num_warps,
                    "wgmma": ptx.count("wgmma.mma_async"),
                    "tma": ptx.count("cp.async.bulk.tensor"),
                })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", help="a checkpoint directory (its config.json)")
    where.add_argument("--shape", help="a shape of bench/gpu_common.py (e.g. deepseek-v3)")
    p.add_argument("--fp8", action="store_true", help="as for a block-scaled FP8 checkpoint")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--max-top-k", type=int, default=64)
    p.add_argument("--max-sample-n", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--kernel", action="append", help="only this kernel module (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    args = p.parse_args(argv)

    from consumer.kernels.launch import stand_in_driver

    stand_in_driver()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # a fresh compile of each, nothing kept
        rows = compile_all(variants(args))
    out = sys.stdout
    if args.json:
        out.write(json.dumps(rows, indent=2) + "\n")
    else:
        for row in rows:
            if "error" in row:
                out.write(f"FAILED  {row['variant']}: {row['error'][:300]}\n")
                continue
            out.write(
                f"{row['registers']:4d} regs  spill {row['spill_store_bytes']:4d}/"
                f"{row['spill_load_bytes']:<4d} B  smem {row['shared_bytes'] // 1024:4d} KiB  "
                f"{row['warps']:2d} warps  wgmma {row['wgmma']:3d}  tma {row['tma']:3d}  "
                f"{row['compile_s']:5.1f} s  {row['kernel']}: {row['variant']}\n"
            )
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
