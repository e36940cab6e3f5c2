"""Pipeline parallelism on the CPU (#24): micro-batches in flight against one at a time.

`--pp` spawned ranks (gloo over loopback, `--threads` torch threads each) form one replica of
`--pp` stages of a random-init dense model (`--layers` layers split over the stages, hidden
`--hidden`). Each rank builds its stage as the consumer does (consumer.forward.model.build_model)
and scores the same batch of `--docs` documents (lengths uniform in `--min-len`..`--max-len`, drawn
from `--seed`; next-token log-probs only) through consumer.forward.pipeline.PipelineScorer, once per
micro-batch count in `--microbatches`:

    1        the whole batch goes through stage 0, then stage 1, ...: one stage works at a time;
    pp + 1   the consumer's default: the batch is cut at document boundaries and stage s works
             on micro-batch m while stage s + 1 works on m - 1.

After `--warmup` untimed rounds, `--repeat` rounds cycle through the settings; each run sits
between barriers, and the median is printed per setting, with tokens/s and the speed-up over
one micro-batch. The outputs of every setting are compared with those of one micro-batch
(log-probs within 1e-5): the script exits non-zero, loudly, if they differ.

    python bench/pipeline.py                        # pp=2, micro-batches 1 and 3
    python bench/pipeline.py --pp 2 --microbatches 1,3,6 --repeat 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _requests(args) -> list:
    from shared.messages import Job, TeacherRequest

    rng = np.random.default_rng(args.seed)
    jobs = []
    for i in range(args.docs):
        n = int(rng.integers(args.min_len, args.max_len + 1))
        req = TeacherRequest(input_ids=rng.integers(0, args.vocab, n).tolist())
        jobs.append(Job(job_id=f"d{i}", entry_id=f"{i}-0", request=req, submitted_at=0))
    return jobs


def _rank(rank: int, args, port: int, out) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.pp
    )
    from consumer import cpu_compat
    from consumer.forward.model import ModelSpec, build_model
    from consumer.forward.pipeline import PipelineScorer
    from consumer.group.batching import batch_from_jobs
    from consumer.parallel import init_parallel, shutdown

    cpu_compat.apply()
    layout = init_parallel(tp=1, pp=args.pp)
    spec = ModelSpec(
        family="bench",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_kv_heads=args.kv_heads,
        ffn_hidden_size=args.ffn,
        max_position_embeddings=max(4096, args.max_len),
    )
    model = build_model(spec, layout, seed=args.seed)
    batch = batch_from_jobs(_requests(args))
    counts = [int(m) for m in args.microbatches.split(",")]
    scorers = {
        m: PipelineScorer(
            model=model, spec=spec, layout=layout, device=torch.device("cpu"), microbatches=m
        )
        for m in counts
    }
    times: dict[int, list[float]] = {m: [] for m in counts}
    outputs: dict[int, list] = {}
    for round_ in range(args.warmup + args.repeat):
        for m in counts:
            dist.barrier()
            t0 = time.perf_counter()
            result = scorers[m].score(batch)
            dist.barrier()
            if round_ >= args.warmup:
                times[m].append(time.perf_counter() - t0)
            outputs[m] = result
    if layout.is_leader:
        ref = outputs[counts[0]]
        for m in counts[1:]:
            for a, b in zip(outputs[m], ref, strict=True):
                np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
        out.put({m: statistics.median(ts) for m, ts in times.items()})
    shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", default="1,3", help="comma-separated counts; 1 first")
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(args.pp)]
    for proc in procs:
        proc.start()
    medians = out.get(timeout=3600)
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    tokens = sum(j.request.num_tokens for j in _requests(args))
    base = medians[min(medians)]
    rows = []
    for m, t in sorted(medians.items()):
        rows.append(
            {
                "microbatches": m,
                "median_s": round(t, 4),
                "tokens_per_s": round(tokens / t),
                "speedup_vs_1": round(base / t, 3),
            }
        )
    print(json.dumps({"pp": args.pp, "docs": args.docs, "tokens": tokens, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
