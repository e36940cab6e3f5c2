"""Checkpoint validation, per-rank shard reads, Megatron torch_dist save / resolve / reshard.

Numerical parity with transformers is in test_hf_parity.py; here the references are exact:
a shard must equal the slice of the full tensor megatron's layout implies, and a Megatron
checkpoint must restore the weights it was saved from (bit for bit at the same TP size, to
float tolerance at another, where only the reduction order changes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from consumer.checkpoints import CheckpointError
from tests.gloo import run_gloo
from tests.timing import scaled

REPO = Path(__file__).resolve().parents[2]
VOCAB = 300  # pads to 384 at TP=1, 512 at TP=2: the vocab rows differ between TP sizes
SEQ = 24


# --------------------------------------------------------------------------------------------
# configs as they appear on the hub (hand-written: no download)


def _llama31_config(**over) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    config.update(over)
    return config


def _qwen3_moe_config() -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,  # present, like the dense field: must not fool detection
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "rope_theta": 1000000.0,
    }


def _mixtral_config() -> dict:
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 1000000.0,
    }


def _small_config(family: str = "llama", **sizes) -> dict:
    from consumer.checkpoints.synthetic import hf_config

    return hf_config(family, **sizes).to_dict()


def test_spec_from_old_style_llama31_config():
    from consumer.checkpoints import spec_from_hf_config

    spec = spec_from_hf_config(_llama31_config())
    assert (spec.family, spec.num_kv_heads, spec.kv_channels) == ("llama", 8, 128)
    assert (spec.rope_theta, spec.norm_eps, spec.qkv_bias, spec.qk_norm) == (
        5e5,
        1e-5,
        False,
        False,
    )
    assert spec.rope_scaling["rope_type"] == "llama3" and spec.rope_scaling["factor"] == 8.0


def test_spec_from_transformers5_configs():
    from consumer.checkpoints import spec_from_hf_config

    qwen3 = spec_from_hf_config(_small_config("qwen3", head_dim=32, tie_embeddings=True))
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias, qwen3.tie_embeddings) == (
        32,
        True,
        False,
        True,
    )
    assert spec_from_hf_config(_small_config("qwen2")).qkv_bias
    # Qwen3Config's default head_dim is 128 whatever hidden_size / heads is
    bare = {k: v for k, v in _small_config("qwen3").items() if k != "head_dim"}
    assert spec_from_hf_config(bare).kv_channels == 128


def test_hub_moe_configs_give_moe_specs():
    """Qwen3-30B-A3B- and Mixtral-8x7B-shaped configs as on the hub (#23)."""
    from consumer.checkpoints import validate_hf_config

    qwen = validate_hf_config(_qwen3_moe_config(), tp=2, ep=8)
    assert (qwen.family, qwen.num_experts, qwen.moe_top_k, qwen.moe_ffn_hidden_size) == (
        "qwen3_moe",
        128,
        8,
        768,
    )
    assert not qwen.moe_norm_topk and qwen.moe_dense_layers == () and qwen.qk_norm
    by_arch = {k: v for k, v in _qwen3_moe_config().items() if k != "model_type"}
    assert validate_hf_config(by_arch) == validate_hf_config(_qwen3_moe_config())
    mixtral = validate_hf_config(_mixtral_config(), tp=8, ep=8)
    assert (mixtral.num_experts, mixtral.moe_top_k, mixtral.moe_ffn_hidden_size) == (8, 2, 14336)
    assert mixtral.moe_norm_topk


@pytest.mark.parametrize(
    "config",
    [
        {**_llama31_config(), "num_local_experts": 8},  # by field, under a dense model_type
        {
            "model_type": "deepseek_v2",
            "n_routed_experts": 256,
            "hidden_size": 7168,
            "moe_intermediate_size": 2048,  # no dense intermediate_size at all
        },
    ],
    ids=["moe_field", "no_intermediate_size"],
)
def test_moe_configs_are_refused(config):
    from consumer.checkpoints import validate_hf_config

    with pytest.raises(CheckpointError, match="mixture-of-experts"):
        validate_hf_config(config)


def test_other_architectures_are_refused():
    from consumer.checkpoints import validate_hf_config

    with pytest.raises(CheckpointError, match="unsupported architecture: model_type='gpt2'"):
        validate_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize(
    ("sizes", "tp", "message"),
    [
        (
            {"num_attention_heads": 4, "num_kv_heads": 4},
            3,
            "num_attention_heads=4 is not divisible",
        ),
        (
            {"hidden_size": 96, "num_attention_heads": 12, "num_kv_heads": 6},
            4,
            "num_key_value_heads=6 is not divisible by tp=4",
        ),
        ({"num_attention_heads": 8, "num_kv_heads": 2}, 4, "num_key_value_heads=2 is smaller than"),
        ({"num_attention_heads": 4, "num_kv_heads": 1}, 2, "num_key_value_heads=1 is smaller than"),
        ({"intermediate_size": 130}, 4, r"intermediate \(ffn\) size 130 is not divisible by tp=4"),
    ],
)
def test_tp_must_divide_the_model(sizes, tp, message):
    from consumer.checkpoints import validate_hf_config

    config = _small_config("llama", **sizes)
    validate_hf_config(config, tp=1)
    with pytest.raises(CheckpointError, match=message):
        validate_hf_config(config, tp=tp)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
        (
            {"rope_scaling": {**_llama31_config()["rope_scaling"], "low_freq_factor": 2.0}},
            r"cannot reproduce: low_freq_factor=2.0 \(megatron uses 1\)",
        ),
        (
            {
                "rope_scaling": {
                    **_llama31_config()["rope_scaling"],
                    "original_max_position_embeddings": 4096,
                }
            },
            "original_max_position_embeddings=4096 .megatron uses 8192",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_theta": 10000.5, "rope_scaling": None}, "not an integer"),
    ],
)
def test_unsupported_rope_is_refused(over, message):
    from consumer.checkpoints import validate_hf_config

    with pytest.raises(CheckpointError, match=message):
        validate_hf_config(_llama31_config(**over))


@pytest.mark.parametrize(
    ("family", "over", "message"),
    [
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
            "sliding-window",
        ),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"vocab_size": None}, "lacks required fields: vocab_size"),
    ],
)
def test_unsupported_features_are_refused(family, over, message):
    from consumer.checkpoints import validate_hf_config

    with pytest.raises(CheckpointError, match=message):
        validate_hf_config({**_small_config(family), **over})


# --------------------------------------------------------------------------------------------
# checkpoint files


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A qwen2 checkpoint (q/k/v biases), 64 hidden, 4 heads / 2 KV heads of 16, vocab 300."""
    from transformers.utils import logging as hf_logging

    from consumer.checkpoints.synthetic import write_random_hf_checkpoint

    hf_logging.disable_progress_bar()
    return write_random_hf_checkpoint(
        tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", vocab_size=VOCAB, seed=3
    )


def _tampered(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            "missing: model.layers.1.mlp.up_proj.weight (expected [128, 64])",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}),
            "unexpected: model.layers.0.mlp.extra_proj.weight [2, 2]",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)}),
            "model.layers.0.self_attn.q_proj.weight: expected [64, 64], found [64, 32]",
        ),
        (
            lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"),
            "missing: model.layers.0.self_attn.k_proj.bias (expected [32])",
        ),
    ],
    ids=["missing", "unexpected", "wrong_shape", "missing_bias"],
)
def test_tensor_inventory_is_checked(hf_dir, tmp_path, layout, edit, message):
    from consumer.checkpoints import load_hf_checkpoint, validate_hf_checkpoint

    bad = _tampered(hf_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as info:
        validate_hf_checkpoint(bad)
    assert message in str(info.value)
    with pytest.raises(CheckpointError, match="does not match its config.json"):
        load_hf_checkpoint(bad, layout)


def test_tied_checkpoint_may_carry_an_lm_head_copy(hf_dir, tmp_path):
    from consumer.checkpoints import validate_hf_checkpoint

    def tie(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    tied = _tampered(hf_dir, tmp_path / "tied", tie)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert validate_hf_checkpoint(tied).tie_embeddings


def test_directory_problems_are_named(hf_dir, tmp_path):
    from consumer.checkpoints import validate_hf_checkpoint

    with pytest.raises(CheckpointError, match="directory not found"):
        validate_hf_checkpoint(tmp_path / "nowhere")
    no_config = tmp_path / "no_config"
    shutil.copytree(hf_dir, no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        validate_hf_checkpoint(no_config)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(hf_dir / "config.json", no_weights)
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        validate_hf_checkpoint(no_weights)
    index = no_weights / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="lists absent files: .'model-00002.safetensors'"):
        validate_hf_checkpoint(no_weights)


class _RecordingCheckpoint:
    """Wraps an HfCheckpoint, recording every read (to see that ranks read only shards)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def read(self, name, rows=None, cols=None):
        out = self.inner.read(name, rows=rows, cols=cols)
        self.reads.append((name, rows, cols, out.numel()))
        return out


def test_rank_reads_only_its_shard_in_megatron_layout(hf_dir):
    from safetensors.torch import load_file

    from consumer.checkpoints import HfCheckpoint, spec_from_hf_config
    from consumer.checkpoints.hf import hf_shard_readers
    from consumer.parallel import ParallelLayout

    full = load_file(hf_dir / "model.safetensors")
    ckpt = HfCheckpoint(hf_dir)
    spec = spec_from_hf_config(ckpt.config)
    rank1 = ParallelLayout(
        world_size=2, rank=1, tp=2, pp=1, dp=1, tp_rank=1, pp_rank=0, dp_rank=0,
        tp_group=None, leader_rank=0,
    )  # fmt: skip
    recorder = _RecordingCheckpoint(ckpt)
    shard = {name: read(recorder) for name, read in hf_shard_readers(spec, rank1).items()}

    # the fused QKV rows of rank 1 are query group 1: q heads 2 and 3, then k_1, then v_1
    p, d = "model.layers.0.self_attn.", 16
    expected_qkv = torch.cat(
        [full[p + "q_proj.weight"][2 * d : 4 * d], full[p + "k_proj.weight"][d : 2 * d],
         full[p + "v_proj.weight"][d : 2 * d]]
    )  # fmt: skip
    assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.weight"], expected_qkv)
    expected_bias = torch.cat(
        [full[p + "q_proj.bias"][2 * d : 4 * d], full[p + "k_proj.bias"][d : 2 * d],
         full[p + "v_proj.bias"][d : 2 * d]]
    )  # fmt: skip
    assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.bias"], expected_bias)
    m = "model.layers.0.mlp."
    assert torch.equal(
        shard["decoder.layers.0.mlp.linear_fc1.weight"],
        torch.cat([full[m + "gate_proj.weight"][64:], full[m + "up_proj.weight"][64:]]),
    )
    assert torch.equal(
        shard["decoder.layers.0.mlp.linear_fc2.weight"], full[m + "down_proj.weight"][:, 64:]
    )
    assert torch.equal(
        shard["decoder.layers.0.self_attention.linear_proj.weight"],
        full[p + "o_proj.weight"][:, 32:],
    )
    # vocab rows 256..511 of the 512 padded: 256..299 real, the rest zero
    emb = shard["embedding.word_embeddings.weight"]
    assert emb.shape == (256, 64)
    assert torch.equal(emb[:44], full["model.embed_tokens.weight"][256:])
    assert emb[44:].abs().max() == 0
    assert torch.equal(shard["output_layer.weight"][:44], full["lm_head.weight"][256:])
    # no 2-D tensor was read whole, and the rank read half of the big tensors' elements
    for name, rows, cols, _ in recorder.reads:
        assert full[name].ndim == 1 or rows is not None or cols is not None, name
    read_2d = sum(n for name, _, _, n in recorder.reads if full[name].ndim == 2)
    total_2d = sum(t.numel() for t in full.values() if t.ndim == 2)
    assert read_2d < 0.5 * total_2d  # half of each, less the vocab rows beyond 300


def test_lower_precision_load(hf_dir, layout):
    from consumer.checkpoints import load_hf_checkpoint

    fp32, _ = load_hf_checkpoint(hf_dir, layout)
    bf16, _ = load_hf_checkpoint(hf_dir, layout, params_dtype=torch.bfloat16)
    for (name, a), b in zip(fp32.named_parameters(), bf16.parameters(), strict=True):
        # Norms included: megatron builds them in float32 and build_model casts them, since
        # torch.rms_norm on CUDA falls back to an unfused form when the dtypes differ.
        assert b.dtype == torch.bfloat16, name
        assert torch.equal(a.to(b.dtype), b), name


def test_make_checkpoint_script(tmp_path):
    from consumer.checkpoints import validate_hf_checkpoint

    spec_ = importlib.util.spec_from_file_location(
        "make_checkpoint", REPO / "scripts/make_checkpoint.py"
    )
    script = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(script)
    out = tmp_path / "q3"
    argv = ["--family", "qwen3", "--out", str(out), "--head-dim", "32", "--tie", "--seed", "5"]
    assert script.main(argv) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    spec = validate_hf_checkpoint(out, tp=2)
    assert (spec.family, spec.head_dim, spec.qk_norm, spec.tie_embeddings) == (
        "qwen3",
        32,
        True,
        True,
    )


# --------------------------------------------------------------------------------------------
# Megatron checkpoint paths


def _fake_step(root: Path, name: str, backend: str = "torch_dist") -> Path:
    step = root / name
    step.mkdir(parents=True)
    (step / "metadata.json").write_text(json.dumps({"sharded_backend": backend}))
    return step


@pytest.fixture
def ckpt_root(tmp_path) -> Path:
    root = tmp_path / "run"
    for name in ("iter_0000010", "iter_0000020", "release"):
        _fake_step(root, name)
    (root / "latest_checkpointed_iteration.txt").write_text("20\n")
    return root


def test_resolve_follows_tracker_and_steps(ckpt_root):
    from consumer.checkpoints import resolve_megatron_checkpoint

    assert resolve_megatron_checkpoint(ckpt_root) == ckpt_root / "iter_0000020"
    assert resolve_megatron_checkpoint(ckpt_root, step=10) == ckpt_root / "iter_0000010"
    assert resolve_megatron_checkpoint(str(ckpt_root), step="release") == ckpt_root / "release"
    step_dir = ckpt_root / "iter_0000010"
    assert resolve_megatron_checkpoint(step_dir) == step_dir
    assert resolve_megatron_checkpoint(step_dir, step=10) == step_dir
    (ckpt_root / "latest_checkpointed_iteration.txt").write_text("release")
    assert resolve_megatron_checkpoint(ckpt_root) == ckpt_root / "release"


@pytest.mark.parametrize(
    ("setup", "step", "message"),
    [
        (lambda r: None, 99, r"step 99: looked for .*iter_0000099/metadata.json; steps present"),
        (
            lambda r: (r / "latest_checkpointed_iteration.txt").write_text("30"),
            None,
            r"latest_checkpointed_iteration.txt = '30': looked for .*iter_0000030/metadata.json; "
            r"steps present in .*: \['iter_0000010', 'iter_0000020', 'release'\]",
        ),
        (
            lambda r: (r / "latest_checkpointed_iteration.txt").unlink(),
            None,
            r"nor a checkpoint root \(no latest_checkpointed_iteration.txt\); steps present: "
            r"\['iter_0000010', 'iter_0000020', 'release'\]",
        ),
        (
            lambda r: (r / "latest_checkpointed_iteration.txt").write_text("best"),
            None,
            "holds 'best', expected an integer or 'release'",
        ),
        (lambda r: None, "latest", "step must be an integer or 'release', got 'latest'"),
        (
            lambda r: (r / "iter_0000040" / "mp_rank_00").mkdir(parents=True),
            40,
            "legacy",
        ),
        (lambda r: _fake_step(r, "iter_0000050", backend="zarr"), 50, "'zarr'"),
    ],
    ids=["no_such_step", "tracker_to_absent", "no_tracker", "bad_tracker", "bad_step", "legacy",
         "zarr"],
)  # fmt: skip
def test_resolve_errors_name_what_and_where(ckpt_root, setup, step, message):
    from consumer.checkpoints import resolve_megatron_checkpoint

    setup(ckpt_root)
    with pytest.raises(CheckpointError, match=message):
        resolve_megatron_checkpoint(ckpt_root, step=step)


def test_resolve_rejects_disagreeing_step_and_absent_path(ckpt_root):
    from consumer.checkpoints import resolve_megatron_checkpoint

    with pytest.raises(CheckpointError, match="is the checkpoint directory 'iter_0000010', but"):
        resolve_megatron_checkpoint(ckpt_root / "iter_0000010", step=20)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_megatron_checkpoint(ckpt_root / "elsewhere")


# --------------------------------------------------------------------------------------------
# Megatron checkpoints: save, reload, reshard


@torch.no_grad()
def _local_logits(model, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(ids.shape[1])[None], attention_mask=None)
    return hidden[:, 0].double() @ model.output_weight_shard().double().T


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def saved_tp1(hf_dir, layout, tmp_path_factory):
    """The HF checkpoint loaded at TP=1, its logits, and its Megatron save at iteration 123."""
    from consumer.checkpoints import load_hf_checkpoint, save_megatron_checkpoint

    model, spec = load_hf_checkpoint(hf_dir, layout)
    root = tmp_path_factory.mktemp("megatron") / "tp1"
    step_dir = save_megatron_checkpoint(model, root, iteration=123)
    return model, spec, _local_logits(model, _ids()), root, step_dir


def test_save_writes_the_trainer_layout(saved_tp1):
    from consumer.checkpoints import read_megatron_spec

    _, spec, _, root, step_dir = saved_tp1
    assert step_dir == root / "iter_0000123"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "123"
    assert json.loads((step_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert read_megatron_spec(step_dir) == spec


def test_reload_at_same_tp_restores_every_weight(saved_tp1, layout):
    from consumer.checkpoints import load_megatron_checkpoint

    model, spec, logits, root, _ = saved_tp1
    again, spec2 = load_megatron_checkpoint(root, layout)
    assert spec2 == spec
    for (name, a), b in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(_local_logits(again, _ids()), logits)


def _reshard_worker(rank: int, world_size: int, tp1_root: Path, tp2_root: Path) -> torch.Tensor:
    from consumer import cpu_compat
    from consumer.checkpoints import load_megatron_checkpoint, save_megatron_checkpoint
    from consumer.parallel import init_parallel

    cpu_compat.apply()
    layout = init_parallel(tp=world_size, pp=1)
    model, _ = load_megatron_checkpoint(tp1_root, layout)
    assert model.output_weight_shard().shape[0] == 256  # 512 padded rows over two ranks
    save_megatron_checkpoint(model, tp2_root)  # a release checkpoint, saved at TP=2
    return _local_logits(model, _ids())


def test_reshard_tp1_to_tp2_and_back(saved_tp1, layout, tmp_path):
    from consumer.checkpoints import load_megatron_checkpoint

    model, _, logits, root, _ = saved_tp1
    tp2_root = tmp_path / "tp2"
    shards = run_gloo(2, _reshard_worker, root, tp2_root, timeout=scaled(120))
    gathered = torch.cat(shards, dim=1)
    torch.testing.assert_close(gathered[:, :VOCAB], logits[:, :VOCAB], atol=1e-5, rtol=0)
    assert gathered[:, VOCAB:].abs().max() == 0  # padded vocab rows are zero
    assert (tp2_root / "latest_checkpointed_iteration.txt").read_text() == "release"
    back, _ = load_megatron_checkpoint(tp2_root, layout)  # 512 stored rows into 384
    for (name, a), b in zip(model.named_parameters(), back.parameters(), strict=True):
        assert torch.equal(a, b), name


def _as_trainer_checkpoint(step_dir: Path, root: Path, args: argparse.Namespace) -> Path:
    # what Megatron-LM leaves: no teacherq json; args, iteration and version in common.pt
    shutil.copytree(step_dir, root / "iter_0000005")
    (root / "iter_0000005" / "teacherq_spec.json").unlink()
    common = {"args": args, "iteration": 5, "checkpoint_version": 3.0}
    torch.save(common, root / "iter_0000005" / "common.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    return root


def _trainer_args(**over) -> argparse.Namespace:
    from megatron.core.transformer.enums import AttnBackend

    args = {
        "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
        "group_query_attention": True, "num_query_groups": 2, "kv_channels": 16,
        "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
        "rotary_base": 10000, "norm_epsilon": 1e-6, "add_qkv_bias": True,
        "add_bias_linear": False, "qk_layernorm": False,
        "untie_embeddings_and_output_weights": True, "max_position_embeddings": 4096,
        "padded_vocab_size": 384, "vocab_size": None, "params_dtype": torch.float32,
        "attention_backend": AttnBackend.auto, "num_experts": None,
    }  # fmt: skip
    args.update(over)
    return argparse.Namespace(**args)


class _Foreign:
    """A class no trainer pickles into its args."""


def test_trainer_checkpoint_spec_from_args(saved_tp1, layout, tmp_path):
    from consumer.checkpoints import load_megatron_checkpoint, read_megatron_spec

    _, spec, logits, _, step_dir = saved_tp1
    root = _as_trainer_checkpoint(step_dir, tmp_path / "trainer", _trainer_args())
    with pytest.raises(CheckpointError, match="do not record the unpadded vocabulary size"):
        read_megatron_spec(root / "iter_0000005")
    from_args = read_megatron_spec(root / "iter_0000005", vocab_size=VOCAB)
    assert from_args == type(spec)(**{**spec.__dict__, "family": "megatron"})
    model, _ = load_megatron_checkpoint(root, layout, vocab_size=VOCAB)
    assert torch.equal(_local_logits(model, _ids()), logits)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"num_experts": 8}, "mixture-of-experts"),
        ({"swiglu": False}, "no SwiGLU"),
        ({"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
        ({"vocab_size": VOCAB, "extra": _Foreign()}, "pickles classes outside"),
    ],
)
def test_trainer_args_refusals(saved_tp1, tmp_path, over, message):
    from consumer.checkpoints import read_megatron_spec

    step_dir = saved_tp1[4]
    root = _as_trainer_checkpoint(step_dir, tmp_path / "trainer", _trainer_args(**over))
    with pytest.raises(CheckpointError, match=message):
        read_megatron_spec(root / "iter_0000005", vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"ffn_hidden_size": 256},
            "decoder.layers.mlp.linear_fc1.weight: expected [2, 512, 64], found [2, 256, 64]",
        ),
        ({"tie_embeddings": True}, "unexpected: output_layer.weight [384, 64]"),
        ({"qkv_bias": False}, "unexpected: decoder.layers.self_attention.linear_qkv.bias"),
        ({"qk_norm": True}, "missing: decoder.layers.self_attention.q_layernorm.weight"),
    ],
)
def test_megatron_mismatch_is_named(saved_tp1, layout, tmp_path, change, message):
    from consumer.checkpoints import load_megatron_checkpoint

    step_dir = tmp_path / "iter_0000123"
    shutil.copytree(saved_tp1[4], step_dir)
    spec_file = step_dir / "teacherq_spec.json"
    data = json.loads(spec_file.read_text())
    data["spec"].update(change)
    spec_file.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        load_megatron_checkpoint(step_dir, layout)
    assert message in str(info.value)


def test_save_needs_a_spec(layout, tmp_path):
    from consumer.checkpoints import save_megatron_checkpoint
    from consumer.forward.model import TINY, build_model

    with pytest.raises(ValueError, match="needs the model's spec"):
        save_megatron_checkpoint(build_model(TINY, layout), tmp_path)
