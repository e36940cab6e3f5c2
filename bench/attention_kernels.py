"""Packed causal attention: the varlen flash kernel against cuDNN's ragged kernel and against
the consumer's pieces path at a lower threshold (GPU).

The consumer attends a pack of documents with one varlen flash call (`varlen_attn`; its v
padded to the q/k head size where they differ, as latent attention's 192/128 are). cuDNN ran
single long documents 2.2x faster (docs/benchmarks.md), but it builds a plan for every new
shape. Its ragged form (`aten._cudnn_attention_forward` with cumulative lengths, what nested
tensors call) keys the plan on the buffer's rows, the document count and the longest document;
this bench pads those three to buckets (rows to a multiple of --row-bucket, documents to a
power of two with empty ones, the longest to a power of two) so that traffic whose lengths
never repeat meets few plans, and measures, on packs of bench/gpu_e2e.py's workloads:

- each path's warm time and TFLOP/s (causal: half of 2 x rows x keys x (d_qk + d_v) x heads);
- cuDNN's first call of each new plan key (the plan's build), and how many keys the packs met;
- the largest difference from the flash path's output.

A third path is the consumer's own (`SdpaCoreAttention.attend_pieces`, what long-tailed packs
take for documents of LONG_DOCUMENT = 4096 rows or more) with the threshold lowered to
--pieces-at and the length bucket to --pieces-bucket: each document from that length on
through SDPA's dense cuDNN kernel at v's own width, padded to the bucket, the documents
between through one varlen call each. It answers whether uniform traffic (512-4096 tokens)
gains from it, and what its plans (one per padded length) cost the first time.

The flash and ragged kernels alone are timed: the padding each needs (v's head size for
flash; rows for cuDNN) is done before. The pieces path is timed whole, its row padding
included, as the consumer runs it. A shape cuDNN refuses is reported as such, and the bench
goes on.

    python bench/attention_kernels.py --shape mla --workload uniform
    python bench/attention_kernels.py --shape gqa --workload longtail --packs 24

Prints one line per pack and a summary; --out writes both as JSON with the versions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# heads (q, kv) and head sizes (q/k, v) per GPU at TP = 1
SHAPES = {
    "mla": (128, 128, 192, 128),  # DeepSeek-V3's latent attention, decompressed for prefill
    "gqa": (12, 2, 128, 128),  # Qwen2.5-1.5B
    "mha": (32, 32, 128, 128),
}


def draw_packs(workload_name: str, tokens: int, count: int, seed: int) -> list[list[int]]:
    """`count` packs' document lengths: bench/gpu_e2e.py's `workload` lengths cut, in their
    order, into packs of at most `tokens` rows (a longer document alone)."""
    from bench.gpu_e2e import docs_of, workload

    packs: list[list[int]] = []
    pack: list[int] = []
    draw = 0
    while len(packs) < count:
        calls = workload(workload_name, tokens=tokens * count, vocab=2, seed=seed + draw)
        draw += 1
        for n in (len(d) for d in docs_of(calls)):
            if pack and sum(pack) + n > tokens:
                packs.append(pack)
                pack = []
            pack.append(n)
    return packs[:count]


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pack_calls(lengths: list[int], shape: tuple[int, int, int, int], row_bucket: int):
    """Random q, k, v of a pack and its two calls: (rows, longest, flash(), cudnn(), the
    cuDNN call's plan key)."""
    import torch
    import torch.nn.functional as F

    from consumer.forward.attention import varlen_attention

    hq, hk, dqk, dv = shape
    dev = torch.device("cuda")
    flash = varlen_attention()
    assert flash is not None, "this torch has no varlen flash attention"
    scale = dqk**-0.5
    t = sum(lengths)
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    mx = max(lengths)
    q = torch.randn(t, hq, dqk, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, hk, dqk, device=dev, dtype=torch.bfloat16)
    v = torch.randn(t, hk, dv, device=dev, dtype=torch.bfloat16)
    v_flash = F.pad(v, (0, dqk - dv)) if dv < dqk else v

    def run_flash():
        return flash(q, k, v_flash, cu, cu, mx, mx, scale=scale)[..., :dv]

    # cuDNN's ragged call on bucketed shapes: padded rows, empty documents, a rounded max
    rows = -(-t // row_bucket) * row_bucket
    docs = pow2(len(lengths))
    cu_pad = torch.tensor(cu_list + [t] * (docs - len(lengths)), dtype=torch.int32, device=dev)
    max_pad = pow2(mx)
    qp, kp, vp = (F.pad(x, (0, 0, 0, 0, 0, rows - t)) for x in (q, k, v))

    def run_cudnn():
        out = torch.ops.aten._cudnn_attention_forward(
            qp, kp, vp, None, cu_pad, cu_pad, max_pad, max_pad, False, 0.0, True, False,
            scale=scale,
        )[0]  # fmt: skip
        return out[:t]

    return t, mx, run_flash, run_cudnn, (rows, docs, max_pad), (q, k, v_flash)


def pieces_call(lengths: list[int], qkv, dv: int, scale: float, at: int, bucket: int):
    """The consumer's pieces path over this pack with LONG_DOCUMENT = `at` and LONG_BUCKET =
    `bucket`: (run(), the padded lengths its cuDNN calls plan for)."""
    from consumer.forward import attention

    attention.LONG_DOCUMENT, attention.LONG_BUCKET = at, bucket
    segments = attention.TreeBounds.documents(lengths).segments
    q, k, v_flash = qkv
    pieces = attention.long_document_pieces(segments, q.device) or (
        attention.Piece(0, sum(lengths), attention.VarlenLayout.of(segments, q.device)),
    )  # no document reaches the threshold: the one varlen call
    core = attention.SdpaCoreAttention(config=None, softmax_scale=scale, value_dim=dv)
    padded = {-(-n // bucket) * bucket for n in lengths if n >= at}
    return (lambda: core.attend_pieces(q, k, v_flash, pieces)), padded


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="mla")
    p.add_argument("--workload", choices=["fixed", "uniform", "longtail"], default="uniform")
    p.add_argument("--tokens", type=int, default=16384, help="rows per pack")
    p.add_argument("--packs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per pack and path")
    p.add_argument("--row-bucket", type=int, default=4096)
    p.add_argument("--pieces-at", type=int, default=1024, help="0: no pieces path")
    p.add_argument("--pieces-bucket", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    import torch

    hq, hk, dqk, dv = SHAPES[args.shape]
    plans: set[int] = set()  # the pieces path's padded lengths met so far

    def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
        out = fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats, out

    keys: set[tuple[int, int, int]] = set()
    rows_out: list[dict] = []
    for i, lengths in enumerate(draw_packs(args.workload, args.tokens, args.packs, args.seed)):
        t, mx, run_flash, run_cudnn, key, qkv = pack_calls(
            lengths, SHAPES[args.shape], args.row_bucket
        )
        first = None
        if key not in keys:
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                run_cudnn()
            except RuntimeError as exc:
                print(f"pack {i}: cuDNN refused {key}: {str(exc).splitlines()[0]}")
                rows_out.append({"lengths": lengths, "cudnn_error": str(exc).splitlines()[0]})
                continue
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            keys.add(key)
        t_flash, o_flash = timed(run_flash, args.repeats)
        t_cudnn, o_cudnn = timed(run_cudnn, args.repeats)
        flops = sum(2 * n * n * (dqk + dv) * hq for n in lengths) / 2
        diff = (o_cudnn.float() - o_flash.float()).abs().max().item()
        pieces = {}
        if args.pieces_at and hq == hk:  # the pieces path takes as many key as query heads
            run_pieces, padded = pieces_call(
                lengths, qkv, dv, dqk**-0.5, args.pieces_at, args.pieces_bucket
            )
            new = padded - plans
            torch.cuda.synchronize()
            start = time.perf_counter()
            run_pieces()
            torch.cuda.synchronize()
            first_pieces = time.perf_counter() - start
            plans |= padded
            t_pieces, o_pieces = timed(run_pieces, args.repeats)
            want = o_flash.reshape(t, -1).float()
            pieces = {
                "pieces_ms": t_pieces * 1e3,
                "pieces_tflops": flops / t_pieces / 1e12,
                "pieces_first_ms": first_pieces * 1e3 if new else None,
                "pieces_new_plans": len(new),
                "pieces_max_abs_diff": (o_pieces.float() - want).abs().max().item(),
            }
        row = {
            "docs": len(lengths),
            "rows": t,
            "longest": mx,
            "key": list(key),
            "flash_ms": t_flash * 1e3,
            "cudnn_ms": t_cudnn * 1e3,
            "flash_tflops": flops / t_flash / 1e12,
            "cudnn_tflops": flops / t_cudnn / 1e12,
            "cudnn_first_ms": None if first is None else first * 1e3,
            "max_abs_diff": diff,
            **pieces,
        }
        rows_out.append(row)
        print(
            f"pack {i}: {len(lengths)} docs, {t} rows, longest {mx}: flash {t_flash * 1e3:.2f} ms"
            f" ({row['flash_tflops']:.0f} TFLOP/s), cuDNN {t_cudnn * 1e3:.2f} ms"
            f" ({row['cudnn_tflops']:.0f}), x{t_flash / t_cudnn:.2f}; new plan"
            f" {'-' if first is None else f'{first * 1e3:.0f} ms'}; max diff {diff:.2e}"
            + (
                f"; pieces {pieces['pieces_ms']:.2f} ms ({pieces['pieces_tflops']:.0f}),"
                f" x{t_flash / t_pieces:.2f}, {pieces['pieces_new_plans']} new plans,"
                f" diff {pieces['pieces_max_abs_diff']:.2e}"
                if pieces
                else ""
            )
        )
    timed_rows = [r for r in rows_out if "flash_ms" in r]
    summary = {
        "shape": args.shape,
        "workload": args.workload,
        "packs": len(rows_out),
        "plan_keys": len(keys),
        "flash_ms_total": sum(r["flash_ms"] for r in timed_rows),
        "cudnn_ms_total": sum(r["cudnn_ms"] for r in timed_rows),
        "plan_build_ms_total": sum(r["cudnn_first_ms"] or 0 for r in timed_rows),
        "median_plan_build_ms": statistics.median(
            [r["cudnn_first_ms"] for r in timed_rows if r["cudnn_first_ms"]] or [0]
        ),
        "max_abs_diff": max((r["max_abs_diff"] for r in timed_rows), default=None),
        "versions": {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()},
        "device": torch.cuda.get_device_name(),
    }
    if timed_rows:
        summary["speedup_warm"] = summary["flash_ms_total"] / summary["cudnn_ms_total"]
    with_pieces = [r for r in timed_rows if "pieces_ms" in r]
    if with_pieces:
        summary["pieces"] = {
            "at": args.pieces_at,
            "bucket": args.pieces_bucket,
            "plans": len(plans),
            "speedup_warm": sum(r["flash_ms"] for r in with_pieces)
            / sum(r["pieces_ms"] for r in with_pieces),
            "first_calls_ms_total": sum(r["pieces_first_ms"] or 0 for r in with_pieces),
            "max_abs_diff": max(r["pieces_max_abs_diff"] for r in with_pieces),
        }
    print(json.dumps({k: v for k, v in summary.items() if k != "versions"}))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "packs": rows_out}, indent=1))
    return summary


if __name__ == "__main__":
    main()
