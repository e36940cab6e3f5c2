"""Write a small random-init Hugging Face checkpoint of a supported family (no download).

    python scripts/make_checkpoint.py --family qwen3 --out /tmp/qwen3-tiny --head-dim 32

The directory gets config.json and model.safetensors written by transformers' save_pretrained,
so it loads both in transformers and through `consumer.checkpoints.load_hf_checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# run as a script from a checkout: make the repository's packages importable
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from consumer.checkpoints.synthetic import write_random_hf_checkpoint
from shared.families import FAMILIES, MOE_FAMILIES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=tuple(FAMILIES), required=True)
    p.add_argument("--out", type=Path, required=True, help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.add_argument("--vocab-size", type=int, default=500)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=128, help="intermediate (MLP) size")
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument(
        "--rope-scaling",
        type=json.loads,
        default=None,
        help='JSON, e.g. \'{"rope_type": "linear", "factor": 4.0}\'',
    )
    p.add_argument("--experts", type=int, default=4, help="MoE families: routed experts")
    p.add_argument("--top-k", type=int, default=2, help="MoE families: experts per token")
    p.add_argument("--moe-ffn", type=int, default=32, help="Qwen MoE: each expert's FFN size")
    p.add_argument("--shared-ffn", type=int, default=48, help="qwen2_moe: shared expert FFN")
    p.add_argument("--norm-topk", action="store_true", help="Qwen MoE: renormalise top-k")
    p.add_argument("--max-shard-size", default=None, help='e.g. "50KB" to shard the weights')
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write the checkpoint and report its directory on stdout."""
    a = parse_args(argv)
    out = write_random_hf_checkpoint(
        a.out,
        a.family,
        seed=a.seed,
        max_shard_size=a.max_shard_size,
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        num_attention_heads=a.heads,
        num_kv_heads=a.kv_heads,
        intermediate_size=a.ffn,
        head_dim=a.head_dim,
        tie_embeddings=a.tie,
        rope_theta=a.rope_theta,
        rope_scaling=a.rope_scaling,
        **(
            {
                "num_experts": a.experts,
                "top_k": a.top_k,
                "moe_intermediate_size": a.moe_ffn,
                "shared_expert_intermediate_size": a.shared_ffn,
                "norm_topk_prob": a.norm_topk,
            }
            if a.family in MOE_FAMILIES
            else {}
        ),
    )
    sys.stdout.write(f"{out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
