"""Latent attention's packed causal attention: padded varlen flash against the Triton kernel.

torch's varlen flash attention with v padded to the q/k head size (what the consumer runs
today) against the Triton kernel of consumer/kernels/mla_attention.py, which takes v at its
own width, on a GPU.

DeepSeek-V3's shape at TP = 1: 128 heads, q/k 192 dims, v 128, bf16. Packs of --tokens rows
(default 16384) are cut from bench/gpu_e2e.py's workloads (`draw_packs` of
bench/attention_kernels.py: uniform 512-4096-token documents; longtail, mostly short ones and
now and then one of 16k-32k rows, alone in its pack). For each pack, on random q, k, v:

- flash: `varlen_attn` through consumer.forward.attention.varlen_attention on q, k and v
  zero-padded to 192, its output cut to 128 dims (exactly bench/attention_kernels.py's
  `run_flash`; the padding is done before and not timed);
- triton: `mla_attention` with the pack's tile plan built on the host and moved to the GPU
  before timing (the consumer builds it once per pack, for every layer).

Each path runs --warmup calls, then --repeats calls back to back, each between two CUDA events
(the host runs ahead, so launch overheads hide as they do in a forward); the median counts.
Useful TFLOP/s count causal attention's half of 2 x n^2 x (192 + 128) x heads per document
of n rows. The line per pack gives both times, both rates, flash's time over the kernel's
(> 1: the kernel is faster) and the largest absolute difference between the two outputs.

--sweep also times every tile shape (block_m 64/128, block_n 32/64/128 up to block_m, warps
4/8, stages 1-4, --head-groups) on the same packs, reports those that fail to compile or do
not fit in shared memory, and prints the fastest per workload (set it as HOPPER_CONFIG).

    python bench/mla_attention.py --workload uniform --packs 8
    python bench/mla_attention.py --workload uniform longtail --packs 4 --sweep --out sweep.json

--out writes the packs, the summaries (and the sweep) as JSON with the versions and the GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEADS, D_QK, D_V = 128, 192, 128  # DeepSeek-V3's latent attention, decompressed for prefill
WRONG = 5e-2  # a config whose output is further than this from flash's is not ranked


def useful_flops(lengths: list[int]) -> float:
    """Causal attention's useful FLOPs: half of 2 n^2 (d_qk + d_v) heads per document."""
    return sum(n * n * (D_QK + D_V) * HEADS for n in lengths)


def sweep_configs(head_groups: list[int]) -> list:
    """Every tile shape the sweep tries (block_n at most block_m)."""
    from consumer.kernels.mla_attention import Config

    return [
        Config(block_m=bm, block_n=bn, warps=w, stages=s, head_group=g)
        for bm, bn, w, s, g in itertools.product(
            (64, 128), (32, 64, 128), (4, 8), (1, 2, 3, 4), head_groups
        )
        if bn <= bm
    ]


def timed(fn, warmup: int, repeats: int):
    """(median milliseconds of `repeats` calls timed by CUDA events, the last output)."""
    import torch

    out = None
    for _ in range(warmup):
        out = fn()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for start, end in events:
        start.record()
        out = fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events), out


def pack_inputs(lengths: list[int], seed: int):
    """Random bf16 q, k [T, H, 192], v [T, H, 128] of a pack, and flash's call on them."""
    import torch
    import torch.nn.functional as F

    from consumer.forward.attention import varlen_attention

    flash = varlen_attention()
    assert flash is not None, "this torch has no varlen flash attention"
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = sum(lengths)
    q, k = (torch.randn(rows, HEADS, D_QK, device=dev, generator=gen).bfloat16() for _ in "qk")
    v = torch.randn(rows, HEADS, D_V, device=dev, generator=gen).bfloat16()
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    mx = max(lengths)
    v_flash = F.pad(v, (0, D_QK - D_V))

    def run_flash():
        return flash(q, k, v_flash, cu, cu, mx, mx, scale=D_QK**-0.5)[..., :D_V]

    return (q, k, v), run_flash


def label(config) -> str:
    return (
        f"{config.block_m}x{config.block_n} w{config.warps} s{config.stages} g{config.head_group}"
    )


def time_pack(args, workload: str, i: int, lengths: list[int], configs: list, totals, failed):
    """One pack through flash and each config not failed yet (`totals` and `failed` updated):
    (flash's ms, the row of the first config, or None if it failed)."""
    from consumer.kernels import mla_attention as ma

    (q, k, v), run_flash = pack_inputs(lengths, args.seed + i)
    t_flash, o_flash = timed(run_flash, args.warmup, args.repeats)
    flops = useful_flops(lengths)
    row = None
    for config in configs:
        name = label(config)
        if name in failed:
            continue
        tiles = ma.plan(lengths, config.block_m).to(q.device)  # host-side, not timed

        def run_triton(config=config, tiles=tiles):
            return ma.mla_attention(q, k, v, tiles, scale=D_QK**-0.5, config=config)

        try:
            t_triton, o_triton = timed(run_triton, args.warmup, args.repeats)
        except Exception as exc:  # noqa: BLE001 - compile failure or no room: reported
            failed[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
            print(f"{workload}: {name} failed: {failed[name]}")
            continue
        diff = (o_triton.float() - o_flash.float()).abs().max().item()
        totals[name]["ms"] += t_triton
        totals[name]["max_abs_diff"] = max(totals[name]["max_abs_diff"], diff)
        if config is configs[0]:
            row = {
                "docs": len(lengths),
                "rows": sum(lengths),
                "longest": max(lengths),
                "flash_ms": t_flash,
                "triton_ms": t_triton,
                "flash_tflops": flops / t_flash / 1e9,
                "triton_tflops": flops / t_triton / 1e9,
                "speedup": t_flash / t_triton,
                "max_abs_diff": diff,
            }
            print(
                f"{workload} pack {i}: {row['docs']} docs, {row['rows']} rows, longest"
                f" {row['longest']}: flash {t_flash:.2f} ms ({row['flash_tflops']:.0f}"
                f" TFLOP/s), triton {t_triton:.2f} ms ({row['triton_tflops']:.0f}),"
                f" x{row['speedup']:.2f}; max diff {diff:.2e}"
            )
    return t_flash, row


def run_workload(args, workload: str, configs: list) -> dict:
    """Every pack of `workload` through flash and each config: the per-pack rows of the
    first (default) config, the totals per config ranked, and the configs that failed."""
    import torch

    from bench.attention_kernels import draw_packs

    totals = {label(c): {"config": vars(c), "ms": 0.0, "max_abs_diff": 0.0} for c in configs}
    failed: dict[str, str] = {}
    packs_out: list[dict] = []
    flash_total = flops_total = 0.0
    for i, lengths in enumerate(draw_packs(workload, args.tokens, args.packs, args.seed)):
        t_flash, row = time_pack(args, workload, i, lengths, configs, totals, failed)
        flash_total += t_flash
        flops_total += useful_flops(lengths)
        if row is not None:
            packs_out.append(row)
        torch.cuda.empty_cache()  # the next pack's shapes differ
    ranked = []
    for name, total in totals.items():
        if name in failed or not total["ms"]:
            continue
        total["tflops"] = flops_total / total["ms"] / 1e9
        total["speedup"] = flash_total / total["ms"]
        ranked.append({"name": name, **total})
    ranked.sort(key=lambda r: r["ms"])
    default = next((r for r in ranked if r["name"] == label(configs[0])), None)
    summary = {
        "workload": workload,
        "packs": len(packs_out),
        "config": label(configs[0]),
        "flash_ms_total": flash_total,
        "flash_tflops": flops_total / flash_total / 1e9 if flash_total else None,
        "triton_ms_total": default["ms"] if default else None,
        "triton_tflops": default["tflops"] if default else None,
        "speedup": default["speedup"] if default else None,
        "max_abs_diff": default["max_abs_diff"] if default else None,
    }
    print(json.dumps(summary))
    result: dict = {"summary": summary, "packs": packs_out}
    if args.sweep:
        good = [r for r in ranked if r["max_abs_diff"] <= WRONG]
        for r in ranked:
            flag = "" if r in good else f"  WRONG (diff {r['max_abs_diff']:.2e})"
            print(
                f"{workload} {r['name']}: {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s,"
                f" x{r['speedup']:.2f} vs flash{flag}"
            )
        if good:
            best = good[0]
            print(
                f"best for {workload}: {best['name']} = Config("
                + ", ".join(f"{k}={v}" for k, v in best["config"].items())
                + f"): {best['tflops']:.0f} TFLOP/s, x{best['speedup']:.2f} vs flash"
            )
        result["sweep"] = ranked
        result["best"] = good[0] if good else None
        result["failed"] = failed
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workload",
        nargs="+",
        choices=["fixed", "uniform", "longtail"],
        default=["uniform"],
        help="one or more of bench/gpu_e2e.py's workloads",
    )
    p.add_argument("--tokens", type=int, default=16384, help="rows per pack")
    p.add_argument("--packs", type=int, default=8, help="packs per workload")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per pack and path")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per pack and path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true", help="time every tile shape too")
    p.add_argument(
        "--head-groups", default="1", help="comma-separated head group sizes for --sweep"
    )
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)

    import torch

    from bench.gpu_common import versions
    from consumer.kernels import mla_attention as ma

    if not torch.cuda.is_available():
        raise SystemExit("bench/mla_attention.py needs a CUDA GPU")
    configs = [ma.HOPPER_CONFIG]
    if args.sweep:
        groups = [int(g) for g in args.head_groups.split(",")]
        configs += [c for c in sweep_configs(groups) if c != ma.HOPPER_CONFIG]
    results = {w: run_workload(args, w, configs) for w in args.workload}
    report = {
        "versions": versions(),
        "device": torch.cuda.get_device_name(),
        "shape": {"heads": HEADS, "d_qk": D_QK, "d_v": D_V, "dtype": "bfloat16"},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "workloads": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
