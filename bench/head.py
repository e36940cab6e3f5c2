"""Time and memory of the chunked teacher head against the naive full-logits path (TP = 1).

Both paths start from the same hidden states and output weight and produce label log-probs,
top-k 64 ids with log-probs, 8 samples with log-probs and the entropy:

    naive:  logits = hidden @ weight.T -> fp32 -> log_softmax -> gather / topk /
            torch.multinomial / entropy            (full [T, V] fp32 tensors exist)
    head:   consumer.tp_ops.chunked_head            (one [chunk_rows, V] chunk at a time)

Each path runs in a fresh child process so that one path's allocator state cannot hide the
other's peak. Peak extra memory is measured, not estimated:
    cuda: torch.cuda.max_memory_allocated() minus the allocation before the run;
    cpu:  the process RSS high-water mark (VmHWM, reset through /proc/self/clear_refs just
          before the run) minus the RSS before the run.
The theoretical size of the full fp32 logits is printed for scale.

    python bench/head.py --tokens 1024 --chunk-rows 256            # CPU-sized
    python bench/head.py --device cuda                             # default Qwen2-7B-like size
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from consumer.tp_ops import HeadCall, chunked_head, vocab_shard  # noqa: E402 - after the sys.path insert

TOP_K, SAMPLES = 64, 8
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _inputs(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    hidden_TH = torch.randn(args.tokens, args.hidden, generator=gen, device=device).to(dtype)
    # Scaled so the logits spread over a few nats, as a trained head's do.
    weight_VH = (
        torch.randn(args.vocab, args.hidden, generator=gen, device=device)
        * (4.0 / args.hidden**0.5)
    ).to(dtype)
    return {
        "hidden_TH": hidden_TH,
        "weight_VH": weight_VH,
        "labels_TW": torch.randint(0, args.vocab, (args.tokens, 1), generator=gen, device=device),
        "inv_temperature_T": torch.ones(args.tokens, device=device),
        "seed_T": torch.full((args.tokens,), 7, dtype=torch.int64, device=device),
        "position_T": torch.arange(args.tokens, dtype=torch.int64, device=device),
    }


def _naive(inp: dict) -> dict:
    logits_TV = (inp["hidden_TH"] @ inp["weight_VH"].t()).float()
    logp_TV = torch.log_softmax(logits_TV * inp["inv_temperature_T"][:, None], dim=-1)
    del logits_TV
    top = torch.topk(logp_TV, TOP_K, dim=-1)
    probs_TV = logp_TV.exp()
    samples_TN = torch.multinomial(probs_TV, SAMPLES, replacement=True)
    return {
        "labels": logp_TV.gather(1, inp["labels_TW"]),
        "topk_ids": top.indices,
        "topk_logprobs": top.values,
        "sample_logprobs": logp_TV.gather(1, samples_TN),
        "entropy": -(probs_TV * logp_TV).sum(-1),
    }


def _head(inp: dict, chunk_rows: int | None) -> dict:
    vocab = inp["weight_VH"].shape[0]
    call = HeadCall(
        shard=vocab_shard(rank=0, tp_size=1, padded_vocab=vocab, vocab_size=vocab),
        tp_group=None,
        target_ids_TW=inp["labels_TW"],
        inv_temperature_T=inp["inv_temperature_T"],
        top_k=TOP_K,
        sample_n=SAMPLES,
        seed_T=inp["seed_T"],
        position_T=inp["position_T"],
        want_entropy=True,
        chunk_rows=chunk_rows,
    )
    out = chunked_head(hidden_TH=inp["hidden_TH"], weight_VH=inp["weight_VH"], call=call)
    return {
        "labels": out.target_logprobs_TW,
        "topk_ids": out.topk_ids_TK,
        "topk_logprobs": out.topk_logprobs_TK,
        "sample_logprobs": out.sample_logprobs_TN,
        "entropy": out.entropy_T,
    }


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} missing from /proc/self/status")


def _worker(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    inp = _inputs(args)
    cuda = args.device == "cuda"
    run = (lambda: _naive(inp)) if args.worker == "naive" else (lambda: _head(inp, args.chunk_rows))
    for _ in range(args.warmup):
        run()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        base = _status_kib("VmRSS") * 1024
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        result = run()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024
    # Small outputs only travel back, for the agreement check.
    torch.save({k: v.cpu() for k, v in result.items()}, args.out)
    print(json.dumps({"seconds": min(times), "peak_extra_bytes": peak - base}))


def _child(args: argparse.Namespace, which: str, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", which, "--out", str(out)]
    for key in ("vocab", "tokens", "hidden", "device", "dtype", "repeat", "warmup", "threads"):
        cmd += [f"--{key}", str(getattr(args, key))]
    if args.chunk_rows:
        cmd += ["--chunk-rows", str(args.chunk_rows)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--chunk-rows", type=int, default=None, help="default: tp_ops auto size")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs; the best is kept")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default")
    parser.add_argument("--worker", choices=("naive", "head"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return

    res, outs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for which in ("naive", "head"):
            path = Path(tmp) / f"{which}.pt"
            res[which] = _child(args, which, path)
            outs[which] = torch.load(path)

    full_logits = args.tokens * args.vocab * 4
    print(
        f"T={args.tokens} V={args.vocab} H={args.hidden} dtype={args.dtype} "
        f"device={args.device} chunk_rows={args.chunk_rows or 'auto'} threads="
        f"{args.threads or torch.get_num_threads()} top_k={TOP_K} samples={SAMPLES} "
        f"(full fp32 logits would be {full_logits / 2**20:.0f} MiB)"
    )
    mem_kind = "cuda max_memory_allocated" if args.device == "cuda" else "RSS high-water mark"
    print(f"{'path':<8}{'time s':>10}{'peak extra MiB':>17}   ({mem_kind} delta)")
    for w in ("naive", "head"):
        print(f"{w:<8}{res[w]['seconds']:>10.3f}{res[w]['peak_extra_bytes'] / 2**20:>17.1f}")
    t_ratio = res["head"]["seconds"] / res["naive"]["seconds"]
    m_ratio = res["head"]["peak_extra_bytes"] / max(res["naive"]["peak_extra_bytes"], 1)
    print(f"{'head/naive':<8}{t_ratio:>10.2f}x{m_ratio:>16.3f}x")

    a, b = outs["head"], outs["naive"]
    ids_equal = float((a["topk_ids"] == b["topk_ids"]).float().mean()) * 100

    def maxdiff(key: str) -> float:
        return (a[key] - b[key]).abs().max().item()

    print(
        f"agreement: label logprob max|diff| {maxdiff('labels'):.2e}, top-k logprob max|diff| "
        f"{maxdiff('topk_logprobs'):.2e}, entropy max|diff| {maxdiff('entropy'):.2e}, top-k ids "
        f"equal {ids_equal:.2f}% (low-precision logits tie often: the head gives ties to the "
        "lowest id, torch.topk picks any)"
    )
    print(
        f"mean sampled logprob: head {a['sample_logprobs'].mean().item():.4f}, naive "
        f"{b['sample_logprobs'].mean().item():.4f}, expected -mean(entropy) "
        f"{-b['entropy'].mean().item():.4f} (independent random streams)"
    )


if __name__ == "__main__":
    main()
