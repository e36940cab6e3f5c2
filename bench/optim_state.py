"""Optimizer-state bytes of StatelessAdam vs torch.optim.Adam after one step on the same model.

    .venv/bin/python bench/optim_state.py                      # nn.Linear stack, 1024 x 4
    .venv/bin/python bench/optim_state.py --width 4096 --depth 8
    .venv/bin/python bench/optim_state.py --model gpt          # tiny megatron GPTModel, CPU

Each optimizer steps its own, identically seeded, model once on the same batch; the state is every
tensor in `optimizer.state` (exp_avg, exp_avg_sq, step for Adam), counted by storage bytes.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from producer.optim import StatelessAdam, optimizer_state_bytes

LossFn = Callable[[torch.nn.Module], torch.Tensor]


def linear_stack(width: int, depth: int) -> tuple[torch.nn.Module, LossFn]:
    """`depth` Linear(width, width) layers with GELU between; loss is the output's mean square."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if i < depth - 1:
            layers.append(torch.nn.GELU())
    model = torch.nn.Sequential(*layers)
    batch = torch.randn(8, width)

    def loss_fn(m: torch.nn.Module) -> torch.Tensor:
        return m(batch).pow(2).mean()

    return model, loss_fn


def _gloo_world_of_one() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from consumer import cpu_compat

    if dist.is_initialized():
        return
    cpu_compat.apply()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def tiny_gpt(hidden: int, layers: int) -> tuple[torch.nn.Module, LossFn]:
    """A megatron GPTModel on CPU in a gloo world of one; loss is next-token cross-entropy."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from consumer.forward.attention import SdpaCoreAttention

    _gloo_world_of_one()
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        ffn_hidden_size=4 * hidden,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    vocab, seq = 1024, 64
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        position_embedding_type="rope",
    )
    tokens = torch.randint(0, vocab, (4, seq))
    positions = torch.arange(seq).expand(4, seq)
    labels = torch.roll(tokens, -1, dims=1)

    def loss_fn(m: torch.nn.Module) -> torch.Tensor:
        return m(tokens, positions, None, labels=labels).mean()

    return model, loss_fn


def one_step(build: Callable[[], tuple[torch.nn.Module, LossFn]], optimizer_cls, **kwargs) -> int:
    """Bytes of optimizer state after one step on a freshly built model."""
    model, loss_fn = build()
    optimizer = optimizer_cls(model.parameters(), **kwargs)
    loss_fn(model).backward()
    optimizer.step()
    return optimizer_state_bytes(optimizer)


def main() -> None:
    """Parse arguments, step both optimizers once, print one comparison line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("linear", "gpt"), default="linear")
    parser.add_argument("--width", type=int, default=1024, help="Linear width / GPT hidden size")
    parser.add_argument("--depth", type=int, default=4, help="Linear layers / GPT layers")
    args = parser.parse_args()

    if args.model == "linear":
        build = functools.partial(linear_stack, args.width, args.depth)
        name = f"linear({args.width}x{args.depth})"
    else:
        build = functools.partial(tiny_gpt, args.width, args.depth)
        name = f"GPTModel(hidden={args.width}, layers={args.depth})"
    model, _ = build()
    numel = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    del model
    adam_bytes = one_step(build, torch.optim.Adam, lr=1e-3)
    ours_bytes = one_step(build, StatelessAdam, lr=1e-3)
    print(
        f"optim-state {name}: params={numel:,} ({param_bytes:,} B) | "
        f"torch.optim.Adam={adam_bytes:,} B ({adam_bytes / numel:.2f} B/param) | "
        f"StatelessAdam={ours_bytes:,} B ({ours_bytes / numel:.2f} B/param) | "
        f"ratio StatelessAdam/Adam={ours_bytes / adam_bytes:.3f} | "
        f"saved={(adam_bytes - ours_bytes) / numel:.2f} B/param"
    )


if __name__ == "__main__":
    main()
