"""FP8 compute for MoE experts: an FP8 checkpoint's routed experts (128 x 128 blocks) are held
in float8_e4m3fn with their block scales and computed by `routed_swiglu` in FP8. On the CPU
its emulated float32 path stands in for the Triton kernel (tests/gpu holds the two together),
so what is proven here is the loading: that each rank holds exactly its experts' stored FP8
values and scales (dequantizing them gives the dequantized load bit for bit, at EP=2 and for
each expert tensor-parallel slice too), that a layer then computes what a hand-written
reference of the FP8 recipe computes from the dequantized weights, that the model scores as the
dequantized one up to the activations' FP8 rounding, and what stays dequantized, and why."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from consumer.forward import fp8_gemm
from consumer.group.batching import batch_from_jobs
from tests.fp8_reference import VOCAB, fp8_jobs, write_fp8_pair
from tests.gloo import run_gloo
from tests.timing import scaled

BLOCK = [128, 128]
# hidden 128 and expert FFNs of whole 128-blocks; 4 heads of 32 give o_proj 128 input columns
BASE = {"hidden_size": 128, "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "num_layers": 2, "num_experts": 4, "top_k": 2}  # fmt: skip
# experts 256 wide: each of two expert tensor-parallel ranks owns one whole 128-block of every
# expert's FFN (and at EP=2 each rank one of DeepSeek's 256-wide shared expert)
CASES = {
    # two sparse layers
    "qwen3_moe": ("qwen3_moe", {**BASE, "moe_intermediate_size": 256}),
    # float32 sigmoid routing, an (unconverted) shared expert, a dense first layer, MLA
    "deepseek_v3": ("deepseek_v3", {**BASE, "moe_intermediate_size": 256}),
}
# FP8 activations on every FP8 GEMM (each expert's two, o_proj) with unit-scale random weights
# move log-probs here by ~0.05 on average, ~0.4 at worst; one layer's experts applied to the
# wrong tokens (their fc2 rolled by one expert) moves them by ~0.6 on average, 1.5 at worst.
# The exact checks (`_check_exact`, the recipe by hand) are what hold the values and scales.
MEAN_ATOL, MAX_ATOL = 0.1, 0.6


def fp8_auto_on_cpu(real):
    """`hf_fp8.fp8_compute_problem` with `model.fp8=auto` finding nothing against FP8 compute
    on the CPU (whose emulated products stand in for cuBLAS and the Triton expert kernel);
    `dequantize` still dequantizes."""

    def problem(mode, device, fmt):
        return None if mode == "auto" else real(mode, device, fmt)

    return problem


@pytest.fixture
def fp8_auto(monkeypatch) -> None:
    from consumer.checkpoints import hf_fp8

    monkeypatch.setattr(hf_fp8, "fp8_compute_problem", fp8_auto_on_cpu(hf_fp8.fp8_compute_problem))


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8x")
    out = {}
    for name, (family, sizes) in CASES.items():
        source = hf_checkpoint(family, f"fp8x-src-{name}", seed=21, vocab_size=VOCAB, **sizes)
        out[name] = str(write_fp8_pair(source, root / name, BLOCK)[0])
    return out


def _load_both(path: str, layout):
    """The FP8-compute load (`model.fp8=auto`) and the dequantized one of `path`."""
    from consumer.checkpoints import load_hf_checkpoint

    model, spec = load_hf_checkpoint(path, layout, fp8="auto")
    plain, _ = load_hf_checkpoint(path, layout, fp8="dequantize")
    return model, plain, spec


def _moes(model) -> dict:
    from consumer.forward.moe import TeacherMoE

    return {n: m for n, m in model.named_modules() if isinstance(m, TeacherMoE)}


def _check_exact(model, plain) -> None:
    """Every layer's experts are FP8 with scales, and dequantize to the dequantized load."""
    plain_moes = _moes(plain)
    assert plain_moes
    for name, moe in _moes(model).items():
        want = plain_moes[name]
        assert want.expert_scale("fc1") is None
        fc1, fc2 = moe.experts_fc1, moe.experts_fc2
        s1, s2 = moe.expert_scale("fc1"), moe.expert_scale("fc2")
        assert fc1.dtype == fc2.dtype == torch.float8_e4m3fn, name
        assert not fc1.requires_grad and not fc2.requires_grad
        assert s1 is not None and s2 is not None and s1.dtype == s2.dtype == torch.float32
        e, _, f, h = fc1.shape
        assert s1.shape == (e, 2 * f // 128, h // 128) and s2.shape == (e, h // 128, f // 128)
        for local in range(e):
            back1 = fp8_gemm.dequantize_weight(fc1[local].flatten(0, 1), s1[local])
            back2 = fp8_gemm.dequantize_weight(fc2[local], s2[local])
            assert torch.equal(back1, want.experts_fc1[local].flatten(0, 1)), (name, local)
            assert torch.equal(back2, want.experts_fc2[local]), (name, local)


def _score(model, spec, layout) -> list[dict]:
    from consumer.forward.scoring import Scorer

    scorer = Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu"))
    return scorer.score(batch_from_jobs(fp8_jobs()))


def _logprob_diff(got: list[dict], want: list[dict]) -> np.ndarray:
    pairs = zip(got, want, strict=True)
    return np.concatenate([np.abs(a["logprobs"] - b["logprobs"]) for a, b in pairs])


def _compare(fp8_scores: list[dict], plain_scores: list[dict]) -> None:
    diff = _logprob_diff(fp8_scores, plain_scores)
    assert diff.mean() < MEAN_ATOL and diff.max() < MAX_ATOL, (diff.mean(), diff.max())
    assert diff.max() > 0, "FP8 activations changed nothing: the FP8 forward did not run"


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_experts_hold_the_checkpoint_and_score_close(name, checkpoints, layout, fp8_auto):
    """With FP8 compute on, every sparse layer holds its experts' stored FP8 values and block
    scales, which dequantize bit for bit to the dequantized load's experts (the log counts the
    layers); log-probs stay within the FP8 activation rounding of the dequantized model's."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        model, plain, spec = _load_both(checkpoints[name], layout)
    _check_exact(model, plain)
    events = {e["event"]: e for e in logs}
    assert events["checkpoint.fp8_compute"]["fp8_expert_layers"] == len(_moes(model))
    assert "checkpoint.fp8_experts_dequantized" not in events
    _compare(_score(model, spec, layout), _score(plain, spec, layout))


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x rounded as FP8 activations are: per row and 128-column group, back in float32."""
    q, scale = fp8_gemm.quantize_activations(x)
    groups = q.float().view(x.shape[0], -1, 128) * scale[..., None]
    return groups.view(x.shape)


def _reference_layer(plain, x: torch.Tensor) -> torch.Tensor:
    """The FP8 recipe written out from the dequantized layer's weights: each routed expert's
    input and SwiGLU output quantized per row and 128 channels, float32 products, the routing
    weight, plus the (dequantized) shared expert. Each expert's tokens are multiplied together
    in token order, as a grouped GEMM takes them: a product of one row at a time can differ
    in float32's last bit, which now and then moves an activation to the next FP8 value."""
    weights, ids = plain.route(x)
    out = torch.zeros_like(x)
    for e in range(plain.num_local):
        tokens, choice = (ids == e).nonzero(as_tuple=True)  # token order
        if not len(tokens):
            continue
        up = _fake_quant(x[tokens]) @ plain.experts_fc1[e].flatten(0, 1).T
        gate, up = up.chunk(2, dim=-1)
        y = _fake_quant(F.silu(gate) * up) @ plain.experts_fc2[e].T
        out.index_add_(0, tokens, weights[tokens, choice, None] * y)
    if plain.shared:
        assert not plain.shared_gated  # neither family here gates it
        gate, up = (x @ plain.shared_fc1.flatten(0, 1).T).chunk(2, dim=-1)
        out += (F.silu(gate) * up) @ plain.shared_fc2.T
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_expert_layer_equals_the_recipe_by_hand(name, checkpoints, layout, fp8_auto):
    """A sparse layer's forward with FP8 experts equals the FP8 recipe computed by hand from
    the dequantized load's weights (to float32 rounding), and differs from the dequantized
    layer's own forward (so the FP8 path ran)."""
    model, plain, _ = _load_both(checkpoints[name], layout)
    moe_name, moe = next(iter(_moes(model).items()))
    reference = _moes(plain)[moe_name]
    x = torch.randn(24, moe.experts_fc2.shape[1], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, _ = moe(x)
        want = _reference_layer(reference, x)
        plain_out, _ = reference(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain_out).abs().max() > 1e-3


def _ep2_worker(rank: int, world: int, paths: dict[str, str]):
    from consumer import cpu_compat
    from consumer.checkpoints import hf_fp8
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    hf_fp8.fp8_compute_problem = fp8_auto_on_cpu(hf_fp8.fp8_compute_problem)
    layout = init_parallel(tp=1, pp=1, ep=2)
    out = {}
    for name, path in paths.items():
        model, plain, spec = _load_both(path, layout)
        _check_exact(model, plain)
        first = _moes(model)[next(iter(_moes(model)))].first_expert
        assert first == rank * CASES[name][1]["num_experts"] // 2
        out[name] = (_score(model, spec, layout), _score(plain, spec, layout))
    return out if layout.is_leader else None


def test_fp8_experts_at_ep2(checkpoints, layout, fp8_auto):
    """At EP=2 (gloo) each rank holds its own half of the experts in FP8, exactly the blocks
    the dequantized load reads; the scores equal the TP=1 FP8 model's (to float32 rounding
    of the partial sums) and stay close to the dequantized model's."""
    got = run_gloo(2, _ep2_worker, checkpoints, timeout=scaled(300))[0]
    for name, path in checkpoints.items():
        model, _, spec = _load_both(path, layout)
        fp8_scores, plain_scores = got[name]
        assert _logprob_diff(fp8_scores, _score(model, spec, layout)).max() < 1e-4, name
        _compare(fp8_scores, plain_scores)


def test_expert_tensor_parallel_slices_are_whole_blocks(checkpoints):
    """Each of two expert tensor-parallel ranks (tp=2, ep=1) reads, through the same readers,
    FP8 slices and scale blocks of its experts that dequantize exactly to its dequantized
    shard: [gate; up] rows and down columns each one whole 128-block."""
    from consumer.checkpoints import HfCheckpoint, spec_from_hf_config
    from consumer.checkpoints.hf import hf_shard_readers
    from consumer.checkpoints.hf_fp8_linears import StoredView
    from consumer.parallel import ParallelLayout

    path = checkpoints["qwen3_moe"]  # (its attention's 128 rows would cut blocks at tp=2)
    spec = spec_from_hf_config(HfCheckpoint(path).config)
    for rank in range(2):
        layout = ParallelLayout(
            world_size=2, rank=rank, tp=2, pp=1, dp=1, tp_rank=rank, pp_rank=0, dp_rank=0,
            tp_group=None, leader_rank=0,
        )  # fmt: skip
        with HfCheckpoint(path) as ckpt:
            readers = hf_shard_readers(spec, layout, ckpt.shapes)
            stored, scales = StoredView(ckpt, "weight"), StoredView(ckpt, "scale")
            for i in range(2):
                fc1 = readers[f"decoder.layers.{i}.mlp.experts_fc1"]
                fc2 = readers[f"decoder.layers.{i}.mlp.experts_fc2"]
                w1, s1, want1 = fc1(stored), fc1(scales), fc1(ckpt)
                w2, s2, want2 = fc2(stored), fc2(scales), fc2(ckpt)
                assert w1.shape == (4, 2, 128, 128) and s1.shape == (4, 2, 1, 1)
                assert w2.shape == (4, 128, 128) and s2.shape == (4, 1, 1)
                for e in range(4):
                    for part in range(2):  # gate, up
                        back = fp8_gemm.dequantize_weight(w1[e, part], s1[e, part])
                        assert torch.equal(back, want1[e, part]), (rank, i, e, part)
                    assert torch.equal(fp8_gemm.dequantize_weight(w2[e], s2[e]), want2[e])


def _fused_copy(src: str, dst) -> None:
    """`src` (per-expert FP8 tensors) with each layer's experts fused as transformers 5 holds
    them: gate_up_proj [E, 2f, h] and down_proj [E, h, f], each with its fused scales."""
    import shutil

    tensors = load_file(f"{src}/model.safetensors")
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    experts = range(BASE["num_experts"])
    for i in range(BASE["num_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        for suffix in ("", "_scale_inv"):
            gate, up, down = (
                [tensors[f"{p}{e}.{which}.weight{suffix}"] for e in experts]
                for which in ("gate_proj", "up_proj", "down_proj")
            )
            out[f"{p}gate_up_proj{suffix}"] = torch.stack(
                [torch.cat(pair) for pair in zip(gate, up, strict=True)]
            )
            out[f"{p}down_proj{suffix}"] = torch.stack(down)
    dst.mkdir()
    shutil.copy(f"{src}/config.json", dst / "config.json")
    save_file(out, str(dst / "model.safetensors"))


def test_fused_expert_layout_loads_the_same_fp8_experts(checkpoints, layout, tmp_path, fp8_auto):
    """Experts stored fused (gate_up_proj, down_proj, with fused scales) load in FP8 to the
    same values and scales as the per-expert storage of the same checkpoint."""
    from consumer.checkpoints import load_hf_checkpoint

    _fused_copy(checkpoints["qwen3_moe"], tmp_path / "fused")
    fused, _ = load_hf_checkpoint(tmp_path / "fused", layout)
    per_expert, _ = load_hf_checkpoint(checkpoints["qwen3_moe"], layout)
    want = _moes(per_expert)
    for name, moe in _moes(fused).items():
        for which in ("fc1", "fc2"):
            got_w, want_w = (getattr(m, f"experts_{which}") for m in (moe, want[name]))
            assert got_w.dtype == torch.float8_e4m3fn
            assert torch.equal(got_w.view(torch.uint8), want_w.view(torch.uint8)), name
            assert torch.equal(moe.expert_scale(which), want[name].expert_scale(which))


def test_fp8_experts_start_no_quack_import(checkpoints, layout, fp8_auto, monkeypatch):
    """quack-kernels serves bf16 experts only: a bf16 MoE build asks for its import ahead
    (`quack_gemm.preload`, which on this CPU starts nothing), a load that holds the experts in
    FP8 does not; the dequantized load of the same checkpoint does."""
    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward import quack_gemm

    asked: list[str] = []
    monkeypatch.setattr(quack_gemm, "preload", lambda device: asked.append(str(device)))
    path = checkpoints["deepseek_v3"]
    model, _ = load_hf_checkpoint(path, layout, params_dtype=torch.bfloat16, fp8="auto")
    assert all(moe.expert_scale("fc1") is not None for moe in _moes(model).values())
    assert asked == []
    load_hf_checkpoint(path, layout, params_dtype=torch.bfloat16, fp8="dequantize")
    assert asked == ["cpu"]


def test_ffn_slice_not_whole_blocks_stays_dequantized(hf_checkpoint, tmp_path, layout, fp8_auto):
    """Experts 64 wide cannot be held in 128 x 128 FP8 blocks: they load dequantized, exactly
    as under `model.fp8=dequantize`, with one log line saying why (the linears still run
    FP8)."""
    from structlog.testing import capture_logs

    sizes = {**BASE, "moe_intermediate_size": 64}
    source = hf_checkpoint("qwen3_moe", "fp8x-src-narrow", seed=22, vocab_size=VOCAB, **sizes)
    path = str(write_fp8_pair(source, tmp_path, BLOCK)[0])
    with capture_logs() as logs:
        model, plain, _ = _load_both(path, layout)
    why = [e for e in logs if e["event"] == "checkpoint.fp8_experts_dequantized"]
    assert len(why) == 1 and "64 wide" in why[0]["reason"] and "128" in why[0]["reason"]
    compute = next(e for e in logs if e["event"] == "checkpoint.fp8_compute")
    assert compute["fp8_expert_layers"] == 0 and compute["fp8_linears"] > 0
    plain_moes = _moes(plain)
    for name, moe in _moes(model).items():
        assert moe.expert_scale("fc1") is None and moe.expert_scale("fc2") is None
        assert torch.equal(moe.experts_fc1, plain_moes[name].experts_fc1)
        assert torch.equal(moe.experts_fc2, plain_moes[name].experts_fc2)


def test_weight_update_between_fp8_moe_checkpoints_is_in_place(
    checkpoints, hf_checkpoint, tmp_path, layout, fp8_auto
):
    """An update to another FP8 MoE checkpoint of the same shape overwrites the FP8 experts
    and their scales in their own tensors, and then scores exactly as a fresh load of it."""
    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward.scoring import Scorer
    from consumer.serve.reload import Reloader

    family, sizes = CASES["qwen3_moe"]
    source = hf_checkpoint(family, "fp8x-src-b", seed=23, vocab_size=VOCAB, **sizes)
    other = str(write_fp8_pair(source, tmp_path, BLOCK)[0])

    def build(path: str):
        model, spec = load_hf_checkpoint(path, layout)
        return Scorer(model=model, spec=spec, layout=layout, device=torch.device("cpu")), path

    scorer, _ = build(checkpoints["qwen3_moe"])
    fresh, _ = build(other)
    tensors = {n: t.data_ptr() for n, t in [*scorer.model.named_parameters(),
                                            *scorer.model.named_buffers()]}  # fmt: skip
    reloader = Reloader(scorer=scorer, path=checkpoints["qwen3_moe"], configured=None,
                        build=build, warm=lambda s: None, fp8="auto")  # fmt: skip
    got, _ = reloader(other)
    assert got is scorer and reloader.last_in_place
    assert {n: t.data_ptr() for n, t in [*scorer.model.named_parameters(),
                                         *scorer.model.named_buffers()]} == tensors  # fmt: skip
    want = _moes(fresh.model)
    for name, moe in _moes(scorer.model).items():
        for which in ("fc1", "fc2"):
            got_w, want_w = (getattr(m, f"experts_{which}") for m in (moe, want[name]))
            assert torch.equal(got_w.view(torch.uint8), want_w.view(torch.uint8)), name
            assert torch.equal(moe.expert_scale(which), want[name].expert_scale(which))
    batch = batch_from_jobs(fp8_jobs())
    for a, b in zip(scorer.score(batch), fresh.score(batch), strict=True):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])


def test_torch_dist_save_refuses_fp8_experts(checkpoints, layout, tmp_path, fp8_auto):
    """A torch_dist save would write the FP8 experts without their scales: refused, naming
    the setting that loads the teacher dequantized."""
    from consumer.checkpoints import CheckpointError, load_hf_checkpoint, save_megatron_checkpoint

    model, _ = load_hf_checkpoint(checkpoints["qwen3_moe"], layout)
    with pytest.raises(CheckpointError, match=r"FP8 weights .* model\.fp8=dequantize"):
        save_megatron_checkpoint(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
