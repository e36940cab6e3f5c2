"""The torch-free checkpoint look `teacherq update-weights` runs before committing anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.checkpoint_probe import probe_checkpoint
from shared.errors import InvalidCheckpoint
from shared.families import FAMILIES


def _hf(tmp_path: Path, config: object, *, weights: bool = True) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    return d


def test_the_probe_imports_no_torch() -> None:
    """The probe and the family table it reads stay torch-free (a CPU-only producer runs it)."""
    import subprocess
    import sys

    code = (
        "import sys, shared.checkpoint_probe, shared.families; "
        "sys.exit('torch' in sys.modules or 'megatron' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_of_the_table_passes(tmp_path: Path, family: str) -> None:
    """Every family the loaders serve passes the probe, by model_type or by architecture."""
    assert probe_checkpoint(_hf(tmp_path, {"model_type": family})) == "hf"
    arch = {"architectures": [FAMILIES[family].architecture]}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(arch))
    assert probe_checkpoint(tmp_path / "ckpt") == "hf"


@pytest.mark.parametrize(
    ("config", "weights", "expected"),
    [
        ('{"model_type": "qwen2", "hidden', True, r"config.json: line 1 column \d+: not valid"),
        ({"model_type": "deepseek_v2"}, True, "'deepseek_v2'.*llama, qwen2, qwen3, qwen3_moe"),
        ({"model_type": "llama"}, False, "no \\*.safetensors"),
        ("[1, 2]", True, "expected a JSON object"),
    ],
)
def test_refusals_name_the_file_and_the_problem(tmp_path, config, weights, expected) -> None:
    """Each refusal is one line naming what to fix."""
    with pytest.raises(InvalidCheckpoint, match=expected) as info:
        probe_checkpoint(_hf(tmp_path, config, weights=weights))
    assert "\n" not in str(info.value)


def test_missing_paths_and_megatron_trackers(tmp_path: Path) -> None:
    """A missing path says so (and how to skip the check); a Megatron tracker must name a
    step directory that exists."""
    with pytest.raises(InvalidCheckpoint, match="does not exist here.*--no-check"):
        probe_checkpoint(tmp_path / "nope")
    root = tmp_path / "megatron"
    root.mkdir()
    (root / "latest_checkpointed_iteration.txt").write_text("200")
    with pytest.raises(InvalidCheckpoint, match="iter_0000200"):
        probe_checkpoint(root)
    (root / "iter_0000200").mkdir()
    (root / "iter_0000200" / "metadata.json").write_text("{}")
    assert probe_checkpoint(root) == "megatron"
    (root / "latest_checkpointed_iteration.txt").write_text("latest")
    with pytest.raises(InvalidCheckpoint, match="expected an integer"):
        probe_checkpoint(root)
