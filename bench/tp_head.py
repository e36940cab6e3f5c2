"""Bytes and time of the TP-sharded teacher head against gathering the full logits, side by side.

At each tensor-parallel size P in `--tp`, P spawned ranks each hold one logits shard
[T, padded_V / P] (random, `--dtype`), the vocabulary padded as the consumer pads it
(consumer.forward.model.ModelSpec.padded_vocab_size). Two paths produce the teacher's outputs
(`--outputs label`: the next-token log-prob; `full`: also top-64 ids with log-probs, 8 samples
with log-probs and the entropy):

    ours:    consumer.tp_ops.head_from_logits on each rank's shard, tp_group = the world group.
             One all_gather of a few 32-bit words per row; counted by CommStats.
    gather:  dist.all_gather of the shards + torch.cat into the full [T, padded_V] logits on
             every rank (as Megatron's gather_from_tensor_model_parallel_region does), then a
             naive full-vocabulary head on rank 0's copy: fp32 log_softmax -> gather / topk /
             entropy. Its samples come from tp_ops.head_from_logits at TP = 1 on that copy (the
             same sampler definition, so sample ids must match exactly); their log-probs are
             read from the naive log_softmax.

Bytes are counted per rank as CommStats counts an all_gather (see consumer/tp_ops/exchange.py):
sent = this rank's input slice, received = the whole gathered output, own slice included, i.e.
(P + 1) x slice bytes. The gather baseline is counted with that same formula. A ring
all_gather (gloo, NCCL) actually puts 2 (P - 1) x slice bytes per rank on the wire, a factor
2 (P - 1) / (P + 1) of the counted figure for both paths alike, so the ratio holds either way.

Time: after `--warmup` untimed rounds, `--repeat` rounds alternate ours and gather; each run
sits between two barriers (and CUDA syncs), its time is the slowest rank's, and the median over
rounds is printed. Afterwards the outputs are checked against the baseline (label and top-k
log-probs within 1e-4, top-k ids equal up to exact ties, sample ids equal, entropy within
1e-3, every rank's outputs identical); the script exits non-zero, loudly, when one is not.

Memory: the gather baseline holds, on every rank, the gathered parts and their concatenation
(2 x T x padded_V x itemsize), and rank 0's naive head about 3 fp32 [T, V] tensors more. At
the defaults (T 16384, V 152064, fp32; one [T, V] tensor is 10 GB) that is ~25 GB per rank and
~45 GB on rank 0: sized for GPUs. Ours keeps one fp32 chunk of about 2**25 elements plus 20
bytes per element of sampling scratch (~0.8 GB) per rank. On a CPU box use e.g. --tokens 1024
(~2 GB per rank, ~3.5 GB on rank 0, ~10 GB in all at TP 4):

    .venv/bin/python bench/tp_head.py --tp 2,4 --tokens 1024                     # CPU, gloo
    .venv/bin/python bench/tp_head.py --tp 2,4 --tokens 1024 --outputs label
    .venv/bin/python bench/tp_head.py --tp 2 --tokens 64 --vocab 4000 --repeat 2   # smoke test
    python bench/tp_head.py --backend nccl --device cuda --tp 2,4,8 --dtype bf16    # multi-GPU

On CPU each rank gets `--threads` torch threads (default: cores / P); with more ranks than
cores the times measure contention more than the head, and the bytes are the headline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from consumer import tp_ops  # noqa: E402 - after the sys.path insert above

TOP_K, SAMPLES = 64, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOGIT_STD = 4.0  # the spread bench/head.py's scaled random head weights give the logits
# Agreement demanded of ours against the baseline (absolute, in nats).
LOGPROB_TOL, ENTROPY_TOL = 1e-4, 1e-3


def padded_vocab_size(vocab: int, tp: int) -> int:
    """The padded vocabulary the consumer uses at this TP size (ModelSpec.padded_vocab_size)."""
    with warnings.catch_warnings():  # megatron warns about missing Apex / Transformer Engine
        warnings.simplefilter("ignore")
        from consumer.forward.model import TINY
    return dataclasses.replace(TINY, vocab_size=vocab).padded_vocab_size(tp)


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------


def make_inputs(rank: int, tp: int, padded_vocab: int, device: torch.device, args) -> dict:
    """This rank's logits shard, and the per-row inputs (the same on every rank).

    The per-row inputs stay on the host, as consumer/forward/scoring.py keeps them: tp_ops checks
    them there and copies them over without a device sync.
    """
    shard_gen = torch.Generator(device=device).manual_seed(1000 + rank)
    logits_TV = torch.randn(
        args.tokens,
        padded_vocab // tp,
        generator=shard_gen,
        device=device,
        dtype=DTYPES[args.dtype],
    ).mul_(LOGIT_STD)
    row_gen = torch.Generator().manual_seed(0)
    labels_TW = torch.randint(0, args.vocab, (args.tokens, 1), generator=row_gen)
    inv_temperature_T = tp_ops.validate_temperature(temperature_T=[args.temperature] * args.tokens)
    return {
        "logits_TV": logits_TV,
        "shard": tp_ops.vocab_shard(
            rank=rank, tp_size=tp, padded_vocab=padded_vocab, vocab_size=args.vocab
        ),
        "labels_TW": labels_TW,
        "inv_temperature_T": inv_temperature_T,
        "seed_T": torch.full((args.tokens,), 7, dtype=torch.int64),
        "position_T": torch.arange(args.tokens, dtype=torch.int64),
    }


def ours(inp: dict, args, comm: tp_ops.CommStats) -> dict:
    """The sharded head: each rank passes only its own shard."""
    full = args.outputs == "full"
    call = tp_ops.HeadCall(
        shard=inp["shard"],
        tp_group=dist.group.WORLD,
        target_ids_TW=inp["labels_TW"],
        inv_temperature_T=inp["inv_temperature_T"],
        top_k=TOP_K if full else 0,
        sample_n=SAMPLES if full else 0,
        seed_T=inp["seed_T"] if full else None,
        position_T=inp["position_T"] if full else None,
        want_entropy=full,
        chunk_rows=args.chunk_rows,
        comm=comm,
        fused=not args.no_fused,
    )
    out = tp_ops.head_from_logits(logits_TV=inp["logits_TV"], call=call)
    result = {"labels": out.target_logprobs_TW}
    if full:
        result |= {
            "topk_ids": out.topk_ids_TK,
            "topk_logprobs": out.topk_logprobs_TK,
            "sample_ids": out.sample_ids_TN,
            "sample_logprobs": out.sample_logprobs_TN,
            "entropy": out.entropy_T,
        }
    return result


def gather_logits(inp: dict, comm: tp_ops.CommStats) -> torch.Tensor:
    """The baseline's collective: every rank ends up with the full [T, padded_V] logits."""
    shard_TV = inp["logits_TV"]
    parts = [torch.empty_like(shard_TV) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard_TV)
    # Counted with CommStats' all_gather formula: own slice sent, all P slices received.
    nbytes = shard_TV.numel() * shard_TV.element_size()
    comm.record(kind="all_gather", sent=nbytes, received=nbytes * len(parts))
    return torch.cat(parts, dim=1)


def naive_head(full_TV: torch.Tensor, inp: dict, args, probe_ids_TK=None) -> dict:
    """Teacher outputs from the full logits the plain way, materialising [T, V] fp32 tensors.

    probe_ids_TK: when given, also return the naive log-probs at those ids (for the tie-aware
    top-k check).
    """
    vocab, device = args.vocab, full_TV.device
    inv_temperature_T = inp["inv_temperature_T"].to(device)
    # Padding columns are not part of the distribution: drop them.
    z_TV = full_TV[:, :vocab].float() * inv_temperature_T[:, None]
    logp_TV = torch.log_softmax(z_TV, dim=-1)
    del z_TV
    result = {"labels": logp_TV.gather(1, inp["labels_TW"].to(device))}
    if args.outputs == "full":
        top = torch.topk(logp_TV, TOP_K, dim=-1)
        padded_vocab = full_TV.shape[1]
        samples = tp_ops.head_from_logits(
            logits_TV=full_TV,
            call=tp_ops.HeadCall(
                shard=tp_ops.vocab_shard(
                    rank=0, tp_size=1, padded_vocab=padded_vocab, vocab_size=vocab
                ),
                tp_group=None,
                target_ids_TW=None,
                inv_temperature_T=inp["inv_temperature_T"],
                top_k=0,
                sample_n=SAMPLES,
                seed_T=inp["seed_T"],
                position_T=inp["position_T"],
                want_entropy=False,
                fused=not args.no_fused,
            ),
        )
        result |= {
            "topk_ids": top.indices,
            "topk_logprobs": top.values,
            "sample_ids": samples.sample_ids_TN,
            "sample_logprobs": logp_TV.gather(1, samples.sample_ids_TN),
            "entropy": -(logp_TV.exp() * logp_TV).sum(dim=-1),
        }
        if probe_ids_TK is not None:
            result["probe_logprobs"] = logp_TV.gather(1, probe_ids_TK)
    return result


def baseline(inp: dict, args, comm: tp_ops.CommStats) -> dict | None:
    """Gather on every rank, naive head on rank 0 only (the other ranks return None)."""
    full_TV = gather_logits(inp, comm)
    return naive_head(full_TV, inp, args) if dist.get_rank() == 0 else None


def timed(device: torch.device, barrier, fn, *fn_args):
    """fn(*fn_args) between two barriers; returns (its result, seconds on this rank)."""
    barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = fn(*fn_args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    barrier()
    return result, seconds


def measure(rank: int, tp: int, padded_vocab: int, device: torch.device, args) -> dict:
    """Everything one rank does for one TP size; returns what the parent reports and checks."""
    inp = make_inputs(rank, tp, padded_vocab, device, args)

    def barrier() -> None:
        # NCCL wants to know the rank's GPU; gloo has none.
        dist.barrier(device_ids=[device.index] if args.backend == "nccl" else None)

    for _ in range(args.warmup):
        ours(inp, args, tp_ops.CommStats())
        baseline(inp, args, tp_ops.CommStats())

    times_ours, times_gather = [], []
    for _ in range(args.repeat):
        comm_ours = tp_ops.CommStats()  # fresh each round: the last one describes one call
        out_ours, seconds = timed(device, barrier, ours, inp, args, comm_ours)
        times_ours.append(seconds)
        comm_gather = tp_ops.CommStats()
        _, seconds = timed(device, barrier, baseline, inp, args, comm_gather)
        times_gather.append(seconds)

    result = {
        "times_ours": times_ours,
        "times_gather": times_gather,
        "comm_ours": dataclasses.asdict(comm_ours),
        "comm_gather": dataclasses.asdict(comm_gather),
        "ours": {k: v.cpu() for k, v in out_ours.items()},
    }
    # One more, untimed, baseline run for the check, probing the log-probs at our top-k ids.
    full_TV = gather_logits(inp, tp_ops.CommStats())
    if rank == 0:
        base = naive_head(full_TV, inp, args, probe_ids_TK=out_ours.get("topk_ids"))
        result["base"] = {k: v.cpu() for k, v in base.items()}
    return result


def rank_main(rank: int, tp: int, port: int, padded_vocab: int, args, out_dir: str) -> None:
    """Entry point of a spawned rank: join the group, measure, leave the result in out_dir."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback: containers may lack a hostname
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // tp))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=args.backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=tp,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        result = measure(rank, tp, padded_vocab, device, args)
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


# --------------------------------------------------------------------------------------------
# Parent: spawn, summarise, check
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(tp: int, padded_vocab: int, args) -> list[dict]:
    """Spawn tp ranks; mp.spawn re-raises a rank's exception with its traceback."""
    with tempfile.TemporaryDirectory(prefix="tp_head_") as out_dir:
        mp.spawn(
            rank_main, args=(tp, free_port(), padded_vocab, args, out_dir), nprocs=tp, join=True
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(tp)]


def total(comm: dict, key: str) -> int:
    return sum(comm[key].values())


def check(results: list[dict], outputs: str) -> tuple[dict, list[str]]:
    """Compare ours (every rank) with rank 0's baseline; returns (figures, failures)."""
    a, b = results[0]["ours"], results[0]["base"]
    failures = []
    for rank, res in enumerate(results[1:], start=1):
        if any(not torch.equal(res["ours"][k], a[k]) for k in a):
            failures.append(f"rank {rank}'s outputs differ from rank 0's")

    def maxdiff(key: str) -> float:
        return (a[key] - b[key]).abs().max().item() if a[key].numel() else 0.0

    figures = {"labels_maxdiff": maxdiff("labels")}
    if figures["labels_maxdiff"] > LOGPROB_TOL:
        failures.append(f"labels max|diff| {figures['labels_maxdiff']:.2e} > {LOGPROB_TOL:g}")
    if outputs == "full":
        figures |= {
            "topk_logprobs_maxdiff": maxdiff("topk_logprobs"),
            "sample_logprobs_maxdiff": maxdiff("sample_logprobs"),
            "entropy_maxdiff": maxdiff("entropy"),
            "topk_ids_equal": (a["topk_ids"] == b["topk_ids"]).float().mean().item(),
            "sample_ids_equal": (a["sample_ids"] == b["sample_ids"]).float().mean().item(),
        }
        # Equal logits tie (often in bf16) and torch.topk orders a tie arbitrarily, tp_ops by
        # lowest id. Our ids are right when the naive log-probs at them are, slot by slot,
        # exactly the naive top-k log-probs: then any id that differs is a tie.
        if not torch.equal(b["probe_logprobs"], b["topk_logprobs"]):
            failures.append("top-k ids differ beyond ties")
        for key, tol in (
            ("topk_logprobs", LOGPROB_TOL),
            ("sample_logprobs", LOGPROB_TOL),
            ("entropy", ENTROPY_TOL),
        ):
            if figures[f"{key}_maxdiff"] > tol:
                failures.append(f"{key} max|diff| {figures[f'{key}_maxdiff']:.2e} > {tol:g}")
        if figures["sample_ids_equal"] < 1.0:
            failures.append(f"sample ids equal only {figures['sample_ids_equal']:.2%}")
    return figures, failures


def summarise(tp: int, padded_vocab: int, results: list[dict], args) -> dict:
    """Per-rank bytes (every rank moves the same), slowest-rank times, medians."""
    comm_ours, comm_gather = results[0]["comm_ours"], results[0]["comm_gather"]
    bytes_ours = total(comm_ours, "bytes_sent") + total(comm_ours, "bytes_received")
    bytes_gather = total(comm_gather, "bytes_sent") + total(comm_gather, "bytes_received")
    slowest_ours = [max(ts) for ts in zip(*(r["times_ours"] for r in results), strict=True)]
    slowest_gather = [max(ts) for ts in zip(*(r["times_gather"] for r in results), strict=True)]
    return {
        "tp": tp,
        "padded_vocab": padded_vocab,
        "calls_ours": comm_ours["calls"],
        "bytes_per_token_ours": bytes_ours / args.tokens,
        "bytes_per_token_gather": bytes_gather / args.tokens,
        "bytes_ratio": bytes_ours / bytes_gather,
        "seconds_ours": statistics.median(slowest_ours),
        "seconds_gather": statistics.median(slowest_gather),
        "all_seconds_ours": slowest_ours,
        "all_seconds_gather": slowest_gather,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="2,4", help="comma-separated TP sizes")
    parser.add_argument("--tokens", type=int, default=16384, help="rows T (CPU: e.g. 1024)")
    parser.add_argument("--vocab", type=int, default=152064, help="real vocabulary size")
    parser.add_argument("--outputs", choices=("label", "full"), default="full")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-rows", type=int, default=None, help="default: tp_ops auto size")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-fused", action="store_true", help="cuda: tp_ops reference path")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds; the median is kept")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank; 0: auto")
    parser.add_argument("--timeout", type=float, default=600.0, help="collective timeout, s")
    parser.add_argument("--json-out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args()
    tps = [int(x) for x in args.tp.split(",")]
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.device == "cuda" and max(tps) > torch.cuda.device_count():
        parser.error(f"--tp {max(tps)} needs that many GPUs, found {torch.cuda.device_count()}")

    what = "label log-prob"
    if args.outputs == "full":
        what += f", top-{TOP_K}, {SAMPLES} samples, entropy"
    threads = args.threads or f"{os.cpu_count()} cores / P"
    print(
        f"backend={args.backend} device={args.device} torch={torch.__version__} "
        f"dtype={args.dtype} T={args.tokens} V={args.vocab} outputs={args.outputs} ({what}) "
        f"chunk_rows={args.chunk_rows or 'auto'} threads/rank={threads} "
        f"warmup={args.warmup} repeat={args.repeat}"
    )
    print(
        "bytes/token: sent + received per rank, counted as CommStats counts an all_gather "
        "(own slice sent, all P slices received); seconds: median over rounds of the slowest rank"
    )
    header = (
        f"{'tp':>3}{'padded V':>10}{'ours B/tok':>12}{'gather B/tok':>14}{'ours/gather':>13}"
        f"{'ours s':>10}{'gather s':>10}{'ours/gather':>13}  ours calls"
    )
    print(header)

    rows, failed = [], False
    for tp in tps:
        padded_vocab = padded_vocab_size(args.vocab, tp)
        results = run_ranks(tp, padded_vocab, args)
        row = summarise(tp, padded_vocab, results, args)
        figures, failures = check(results, args.outputs)
        row |= {"check": figures, "failures": failures}
        rows.append(row)
        calls = ", ".join(f"{kind} x{n}" for kind, n in row["calls_ours"].items())
        print(
            f"{tp:>3}{padded_vocab:>10}{row['bytes_per_token_ours']:>12,.0f}"
            f"{row['bytes_per_token_gather']:>14,.0f}{row['bytes_ratio']:>13.2e}"
            f"{row['seconds_ours']:>10.4f}{row['seconds_gather']:>10.4f}"
            f"{row['seconds_ours'] / row['seconds_gather']:>12.2f}x  {calls}"
        )
        line = f"    check: label max|diff| {figures['labels_maxdiff']:.1e}"
        if args.outputs == "full":
            line += (
                f", top-k lp {figures['topk_logprobs_maxdiff']:.1e}, sample lp "
                f"{figures['sample_logprobs_maxdiff']:.1e}, entropy "
                f"{figures['entropy_maxdiff']:.1e}; top-k ids equal "
                f"{figures['topk_ids_equal']:.2%} (rest exact ties), sample ids equal "
                f"{figures['sample_ids_equal']:.2%}"
            )
        print(line + ("" if failures else "  OK"))
        for failure in failures:
            print(f"    CHECK FAILED at tp={tp}: {failure}", file=sys.stderr)
        failed = failed or bool(failures)

    if args.json_out:
        meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        meta["torch"] = torch.__version__
        args.json_out.write_text(json.dumps({"args": meta, "results": rows}, indent=2) + "\n")
    if failed:
        sys.exit("tp_head: ours disagrees with the gather baseline (see CHECK FAILED above)")


if __name__ == "__main__":
    main()
