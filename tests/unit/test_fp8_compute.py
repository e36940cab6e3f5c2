"""FP8 compute in the model (#40): an FP8 checkpoint's tensor-parallel linears keep their FP8
shards and block scales and multiply through consumer/forward/fp8_gemm.py. On the CPU the emulated
product stands in for cuBLAS (tests/gpu/test_fp8.py holds the two together), so what is proven
here is the wiring: which linears convert, that their fused FP8 shards and scales are exactly
the checkpoint's (dequantizing them gives the dequantized load bit for bit), and that the
model then scores as the dequantized one up to the activations' FP8 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumer.forward import fp8_gemm
from consumer.group.batching import batch_from_jobs
from tests.fp8_reference import VOCAB, fp8_jobs, write_fp8_pair
from tests.gloo import run_gloo
from tests.timing import scaled

# hidden and FFN multiples of 128 (activation groups); 32 x 64 blocks keep each KV group's
# q, k and v rows whole blocks at TP=1 and TP=2; 8 heads of 32 give o_proj 128 input columns
# per rank at TP=2 (activations are quantized in 128-channel groups)
SIZES = {"hidden_size": 128, "num_attention_heads": 8, "num_kv_heads": 2, "head_dim": 32,
         "intermediate_size": 256, "num_layers": 2}  # fmt: skip
BLOCK = [32, 64]
LINEARS = ["self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
           "mlp.linear_fc2"]  # fmt: skip
# FP8 activations (per 128-channel group) on both layers' four GEMMs with unit-scale random
# weights move log-probs by ~0.05 on average, ~0.2 at worst; a linear fed the wrong rows or
# scales moves them by nats
MEAN_ATOL, MAX_ATOL = 0.1, 0.4


@pytest.fixture(scope="module")
def pair(hf_checkpoint, tmp_path_factory) -> tuple[str, str]:
    source = hf_checkpoint("qwen3", "fp8-compute-src", seed=13, vocab_size=VOCAB, **SIZES)
    fp8, ref = write_fp8_pair(source, tmp_path_factory.mktemp("fp8c"), BLOCK)
    return str(fp8), str(ref)


def _load_both(path: str, layout):
    """The dequantized load and the FP8-compute one (emulated GEMMs) of `path`."""
    from consumer.checkpoints import load_hf_checkpoint
    from consumer.checkpoints.hf import hf_shard_readers
    from consumer.checkpoints.hf_files import HfCheckpoint
    from consumer.checkpoints.hf_fp8_linears import attach_fp8_linears

    plain, spec = load_hf_checkpoint(path, layout)
    model, _ = load_hf_checkpoint(path, layout)
    with HfCheckpoint(path) as ckpt:
        readers = hf_shard_readers(spec, layout, ckpt.shapes)
        converted = attach_fp8_linears(model, ckpt, readers, path="emulated")
    return plain, model, spec, converted


def _check_exact(plain, model, converted) -> None:
    want = {f"decoder.layers.{i}.{m}.weight" for i in range(2) for m in LINEARS}
    assert set(converted) == want
    modules = dict(model.named_modules())
    plain_params = dict(plain.named_parameters())
    for name in converted:
        module = modules[name.removesuffix(".weight")]
        assert module.weight.dtype == torch.float8_e4m3fn
        back = fp8_gemm.dequantize_weight(module.weight, module.weight_scale_inv, tuple(BLOCK))
        assert torch.equal(back, plain_params[name]), name


def _scorer(model, spec, layout):
    from consumer.forward.scoring import Scorer

    return Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu"))


def _loaded(path: str, layout):
    """A scorer of `path` as the consumer loads it (`model.fp8=auto`)."""
    from consumer.checkpoints import load_hf_checkpoint

    return _scorer(*load_hf_checkpoint(path, layout), layout)


def _score(model, spec, layout) -> list[dict]:
    return _scorer(model, spec, layout).score(batch_from_jobs(fp8_jobs()))


def _compare(fp8_scores: list[dict], plain_scores: list[dict]) -> None:
    pairs = zip(fp8_scores, plain_scores, strict=True)
    diff = np.concatenate([np.abs(got["logprobs"] - want["logprobs"]) for got, want in pairs])
    assert diff.mean() < MEAN_ATOL and diff.max() < MAX_ATOL, (diff.mean(), diff.max())
    assert diff.max() > 0, "FP8 activations changed nothing: the FP8 forward did not run"


def test_fp8_linears_hold_the_checkpoint_and_score_close(pair, layout):
    """At TP=1 the four linears of each layer convert; their FP8 shards and fused scales
    dequantize to exactly the dequantized load; scores match it within the FP8 activation
    rounding (and differ from it, so the FP8 forward ran)."""
    plain, model, spec, converted = _load_both(pair[0], layout)
    _check_exact(plain, model, converted)
    _compare(_score(model, spec, layout), _score(plain, spec, layout))


def _tp2_worker(rank: int, world: int, path: str):
    from consumer import cpu_compat
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=2, pp=1)
    plain, model, spec, converted = _load_both(path, layout)
    _check_exact(plain, model, converted)
    out = (_score(model, spec, layout), _score(plain, spec, layout))
    return out if layout.is_leader else None


@pytest.mark.slow
def test_fp8_linears_at_tp2(pair):
    """At TP=2 (gloo) each rank's FP8 shard and scales are exactly its slice, and the
    TP-reduced scores match the dequantized model's within the FP8 activation rounding."""
    fp8_scores, plain_scores = run_gloo(2, _tp2_worker, pair[0], timeout=scaled(300))[0]
    _compare(fp8_scores, plain_scores)


@pytest.fixture(scope="module")
def pair_b(hf_checkpoint, tmp_path_factory) -> str:
    """A second FP8 teacher of `pair`'s shape (another seed)."""
    source = hf_checkpoint("qwen3", "fp8-compute-src-b", seed=14, vocab_size=VOCAB, **SIZES)
    return str(write_fp8_pair(source, tmp_path_factory.mktemp("fp8c-b"), BLOCK)[0])


def _fp8_state(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        name: (module.weight.detach().clone(), module.weight_scale_inv.clone())
        for name, module in model.named_modules()
        if hasattr(module, "weight_scale_inv")
    }


def test_weight_update_between_fp8_checkpoints_is_in_place(pair, pair_b, layout, monkeypatch):
    """With FP8 compute on, an update to another FP8 checkpoint of the same shape overwrites
    the FP8 weights and scales in their own tensors (CUDA graphs recorded on them stay valid)
    and then scores exactly as a fresh load of it; an update to an unquantized checkpoint of
    the same shape rebuilds the model instead of copying its values into FP8 tensors."""
    from consumer.checkpoints import hf_fp8
    from consumer.serve.reload import Reloader

    # The CPU has no FP8 GEMM: the emulated product stands in for cuBLAS's, as above.
    monkeypatch.setattr(hf_fp8, "fp8_compute_problem", lambda *args: None)
    builds: list[str] = []

    def build(path: str):
        builds.append(path)
        return _loaded(path, layout), path

    scorer, _ = build(pair[0])
    fresh_b, _ = build(pair_b)
    builds.clear()
    held = _fp8_state(scorer.model)
    assert len(held) == 2 * len(LINEARS)
    tensors = {n: p.data_ptr() for n, p in scorer.model.named_parameters()}
    reloader = Reloader(scorer=scorer, path=pair[0], configured=None, build=build,
                        warm=lambda s: None, fp8="auto")  # fmt: skip

    got, _ = reloader(pair_b)
    assert got is scorer and reloader.last_in_place and builds == []
    assert {n: p.data_ptr() for n, p in scorer.model.named_parameters()} == tensors
    want = _fp8_state(fresh_b.model)
    for name, (weight, scale) in _fp8_state(scorer.model).items():
        assert torch.equal(weight.view(torch.uint8), want[name][0].view(torch.uint8)), name
        assert torch.equal(scale, want[name][1]), name
        assert not torch.equal(scale, held[name][1]), f"{name}: still the first teacher's"
    batch = batch_from_jobs(fp8_jobs())
    for a, b in zip(scorer.score(batch), fresh_b.score(batch), strict=True):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])

    rebuilt, _ = reloader(pair[1])  # the dequantized reference: same shape, no FP8
    assert rebuilt is not scorer and not reloader.last_in_place and builds == [pair[1]]
    assert not _fp8_state(rebuilt.model)


def test_weight_update_to_a_dequantized_fp8_checkpoint_is_in_place(pair, pair_b, layout):
    """Where FP8 checkpoints are dequantized (the CPU here), an update from one to another
    of the same shape loads in place like any other checkpoint, to the exact dequantized
    values of the new one."""
    from consumer.serve.reload import Reloader

    scorer, fresh_b = _loaded(pair[0], layout), _loaded(pair_b, layout)
    reloader = Reloader(scorer=scorer, path=pair[0], configured=None,
                        build=lambda p: (_loaded(p, layout), p),
                        warm=lambda s: None, fp8="dequantize")  # fmt: skip
    got, _ = reloader(pair_b)
    assert got is scorer and reloader.last_in_place
    want = dict(fresh_b.model.named_parameters())
    for name, param in scorer.model.named_parameters():
        assert torch.equal(param, want[name]), name
