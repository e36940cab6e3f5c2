"""StatelessAdam inside megatron-core's get_megatron_optimizer, on CPU through gloo (world of 1).

megatron's DistributedDataParallel allocates its grad buffers on torch.cuda.current_device(),
so it cannot be built here; get_megatron_optimizer only reads `ddp_config` from the model chunk
on the non-distributed path, so the bare GPTModel carries a default DistributedDataParallelConfig
and autograd's param.grad plays the role of main_grad.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from megatron.core import optimizer as megatron_optimizer
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

from consumer import cpu_compat
from consumer.forward.attention import SdpaCoreAttention
from producer.optim import (
    MegatronStatelessAdamError,
    StatelessAdam,
    get_megatron_stateless_adam,
    optimizer_state_bytes,
    stateless_adam_in_megatron,
)

VOCAB, SEQ, BATCH = 128, 16, 4


@pytest.fixture(scope="module", autouse=True)
def gloo_world():
    """A world of one on gloo with megatron's groups; reuses one another test already made."""
    cpu_compat.apply()  # before any model or optimizer is built; a no-op with CUDA
    made_world = not dist.is_initialized()
    set_ifname = made_world and "GLOO_SOCKET_IFNAME" not in os.environ
    if made_world:
        # Loopback only: containers often have no resolvable hostname for gloo to bind to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("needs a world of one process")
    made_groups = not parallel_state.model_parallel_is_initialized()
    if made_groups:
        parallel_state.initialize_model_parallel(1, 1)
    yield
    if made_groups:
        parallel_state.destroy_model_parallel()
    if made_world:
        dist.destroy_process_group()
    if set_ifname:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def _model(seed: int = 0, **ddp_kwargs) -> GPTModel:
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
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
    # megatron's DotProductAttention takes its score buffer from a CUDA memory pool.
    spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    model.ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
    return model


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return tokens, positions, torch.roll(tokens, -1, dims=1)


def _backward(model: GPTModel, optimizer) -> float:
    optimizer.zero_grad()
    tokens, positions, labels = _batch()
    loss = model(tokens, positions, None, labels=labels).mean()
    loss.backward()
    return loss.item()


def _inner(optimizer):
    (part,) = optimizer.chained_optimizers
    return part.optimizer


def test_trains_a_gpt_model_without_optimizer_state():
    model = _model()
    opt = get_megatron_stateless_adam(OptimizerConfig(optimizer="adam", lr=1e-2), [model])
    assert isinstance(_inner(opt), StatelessAdam)
    assert all(g["adam_w_mode"] for g in _inner(opt).param_groups)  # decoupled_weight_decay
    losses = []
    for _ in range(8):
        losses.append(_backward(model, opt))
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 0
        assert optimizer_state_bytes(opt) == 0 and len(_inner(opt).state) == 0
    losses.append(_backward(model, opt))
    assert losses[-1] < 0.8 * losses[0], losses

    # The measurement is not vacuous: megatron's usual Adam on the same model holds moments.
    reference = _model()
    adam = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2), [reference])
    assert not isinstance(_inner(adam), StatelessAdam)
    _backward(reference, adam)
    adam.step()
    numel = sum(p.numel() for p in reference.parameters())
    assert optimizer_state_bytes(adam) >= 2 * 4 * numel


def test_megatron_step_is_the_fresh_adam_update():
    model = _model()
    config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, adam_eps=1e-6)
    opt = get_megatron_stateless_adam(config, [model])
    for group in opt.param_groups:  # what megatron's OptimizerParamScheduler sets per group
        group["weight_decay"] = config.weight_decay * group["wd_mult"]
    assert {g["weight_decay"] for g in opt.param_groups} == {0.0, 0.1}
    _backward(model, opt)
    params = [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in params]
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
    assert norm > config.clip_grad  # so the step below clips

    ok, grad_norm, _ = opt.step()
    assert ok
    assert grad_norm == pytest.approx(norm, rel=1e-5)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
    assert clipped == pytest.approx(config.clip_grad, rel=1e-4)
    for group in opt.param_groups:
        for p in group["params"]:
            p0 = before[next(i for i, q in enumerate(params) if q is p)]
            g = p.grad  # megatron clips in place and leaves the grad for the optimizer
            expected = p0 * (1 - config.lr * group["weight_decay"]) - config.lr * g / (
                g.abs() + config.adam_eps
            )
            torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-8)


def test_l2_mode_follows_decoupled_weight_decay_false():
    config = OptimizerConfig(optimizer="adam", lr=1e-3, decoupled_weight_decay=False)
    opt = get_megatron_stateless_adam(config, [_model()])
    assert not any(g["adam_w_mode"] for g in _inner(opt).param_groups)


def test_context_manager_covers_an_imported_get_megatron_optimizer_and_restores():
    config = OptimizerConfig(optimizer="adam", lr=1e-3)
    saved = (megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER)
    with stateless_adam_in_megatron():
        opt = get_megatron_optimizer(config, [_model()])  # imported before the block
    assert isinstance(_inner(opt), StatelessAdam)
    assert (megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER) == saved
    assert not isinstance(_inner(get_megatron_optimizer(config, [_model()])), StatelessAdam)

    with pytest.raises(RuntimeError, match="boom"), stateless_adam_in_megatron():
        raise RuntimeError("boom")
    assert (megatron_optimizer.Adam, megatron_optimizer.USING_PYTORCH_OPTIMIZER) == saved


def _refused_configs():
    precision_aware = OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True)
    # Building it for real needs Transformer Engine; the flag is what megatron reads.
    precision_aware.use_precision_aware_optimizer = True
    return [
        pytest.param(
            OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True),
            {},
            "use_distributed_optimizer",
            id="distributed-optimizer",
        ),
        pytest.param(precision_aware, {}, "use_precision_aware_optimizer", id="precision-aware"),
        pytest.param(
            OptimizerConfig(optimizer="adam", lr=1e-3, optimizer_cpu_offload=True),
            {},
            "optimizer_cpu_offload",
            id="cpu-offload",
        ),
        pytest.param(OptimizerConfig(optimizer="sgd", lr=1e-3), {}, "'sgd'", id="sgd"),
        pytest.param(
            OptimizerConfig(optimizer="adam", lr=1e-3),
            {"use_distributed_optimizer": True},
            "ddp_config.use_distributed_optimizer",
            id="ddp-distributed-buffers",
        ),
    ]


@pytest.mark.parametrize(("config", "ddp_kwargs", "reason"), _refused_configs())
def test_setups_that_keep_moment_state_are_refused(config, ddp_kwargs, reason):
    with pytest.raises(MegatronStatelessAdamError, match=reason):
        get_megatron_stateless_adam(config, [_model(**ddp_kwargs)])
    with pytest.raises(MegatronStatelessAdamError, match=reason), stateless_adam_in_megatron():
        get_megatron_optimizer(config, [_model(**ddp_kwargs)])


def test_loading_megatron_adam_state_drops_moments():
    adam_model = _model()
    adam = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.02), [adam_model])
    _backward(adam_model, adam)
    adam.step()
    saved = adam.state_dict()
    assert any("exp_avg" in s for s in saved["state"].values())

    model = _model()
    opt = get_megatron_stateless_adam(OptimizerConfig(optimizer="adam", lr=0.5), [model])
    opt.load_state_dict(saved)
    assert optimizer_state_bytes(opt) == 0
    assert all(g["lr"] == 0.02 for g in opt.param_groups)
    _backward(model, opt)
    assert opt.step()[0] and optimizer_state_bytes(opt) == 0


def test_checkpoint_template_for_loading_allocates_no_moments():
    # megatron builds the state dict a checkpoint is loaded into by first calling init_state_fn,
    # which for Adam fills exp_avg / exp_avg_sq with zeros.
    model = _model()
    opt = get_megatron_stateless_adam(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
    template = opt.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
    assert optimizer_state_bytes(opt) == 0
    assert not template["state"]

    reference = _model()
    adam = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [reference])
    adam_template = adam.sharded_state_dict(reference.sharded_state_dict(), is_loading=True)
    assert optimizer_state_bytes(adam) > 0 and adam_template["state"]
