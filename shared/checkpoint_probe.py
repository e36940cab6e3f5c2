"""A quick look at a checkpoint directory without torch: is it something a consumer can load?

`teacherq update-weights` runs this before anything is committed, so a mistyped path or a
truncated `config.json` is refused in the terminal, in one line, instead of reaching the
consumers. It checks what it can cheaply — the path exists; a Hugging Face directory has a
`config.json` that parses, names a family the consumers serve and has safetensors; a Megatron
directory has a tracker or step directory with `metadata.json` — and leaves the full check
(tensor inventory, parallel layout) to the first consumer that tries it.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.errors import InvalidCheckpoint
from shared.families import FAMILIES, family_of

_TRACKER = "latest_checkpointed_iteration.txt"


def probe_checkpoint(path: str | Path) -> str:
    """Raise `InvalidCheckpoint` (one line, naming the file and what is wrong) unless `path`
    looks like a servable checkpoint; returns 'hf' or 'megatron'."""
    p = Path(path)
    if not p.exists():
        raise InvalidCheckpoint(
            f"checkpoint path {str(p)!r} does not exist here (a path only the consumers can "
            "read: --no-check / check=False)"
        )
    if not p.is_dir():
        raise InvalidCheckpoint(f"checkpoint path {str(p)!r} is a file; expected a directory")
    if (p / "config.json").is_file():
        _probe_hf(p)
        return "hf"
    if (p / _TRACKER).is_file() or (p / "metadata.json").is_file():
        _probe_megatron(p)
        return "megatron"
    raise InvalidCheckpoint(
        f"{p}: not a checkpoint: no config.json (Hugging Face) and no {_TRACKER} or "
        "metadata.json (Megatron torch_dist)"
    )


def _probe_hf(p: Path) -> None:
    config_file = p / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InvalidCheckpoint(
            f"{config_file}: line {exc.lineno} column {exc.colno}: not valid JSON ({exc.msg})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidCheckpoint(f"{config_file}: unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidCheckpoint(f"{config_file}: expected a JSON object")
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if family_of(model_type, archs) is None:
        raise InvalidCheckpoint(
            f"{config_file}: model_type={model_type!r} (architectures={archs!r}) is not a "
            f"family the consumers serve: {', '.join(FAMILIES)}"
        )
    if not any(p.glob("*.safetensors")):
        raise InvalidCheckpoint(f"{p}: config.json but no *.safetensors weights")


def _probe_megatron(p: Path) -> None:
    tracker = p / _TRACKER
    if not tracker.is_file():
        return  # a step directory itself: metadata.json is there
    text = tracker.read_text().strip()
    if text != "release" and not text.isdigit():
        raise InvalidCheckpoint(f"{tracker}: holds {text!r}, expected an integer or 'release'")
    step = p / ("release" if text == "release" else f"iter_{int(text):07d}")
    if not (step / "metadata.json").is_file():
        raise InvalidCheckpoint(
            f"{tracker} names step {text!r} but {step / 'metadata.json'} does not exist"
        )
