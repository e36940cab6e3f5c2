"""The family table (`shared/families.py`): one source every reader agrees with, and the
modules that read it import one way (no cycle, `TYPE_CHECKING` and function-level imports
included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shared.families import FAMILIES, MOE_FAMILIES, family_of

ROOT = Path(__file__).resolve().parents[2]
# the modules the family work reorganised; none may sit on an import cycle
WATCHED = (
    "shared.families",
    "shared.checkpoint_probe",
    "consumer.forward.spec",
    "consumer.forward.model",
    "consumer.forward.moe",
    "consumer.forward.mla",
    "consumer.forward.attention",
    "consumer.checkpoints.hf",
    "consumer.checkpoints.hf_config",
    "consumer.checkpoints.hf_files",
    "consumer.checkpoints.hf_moe",
    "consumer.checkpoints.hf_mla",
    "consumer.checkpoints.validate",
    "consumer.checkpoints.synthetic",
    "consumer.checkpoints.megatron_dist",
)


def _module_imports() -> dict[str, set[str]]:
    """Project module -> the project modules it imports anywhere in its source."""
    files = {}
    for package in ("consumer", "shared", "producer"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps.update(t for t in targets if t in files and t != name)
        graph[name] = deps
    return graph


def test_no_import_cycle_through_the_family_modules():
    """No module of the family work reaches itself again through imports (a cycle hidden in
    TYPE_CHECKING or in a function body counts)."""
    graph = _module_imports()
    for start in WATCHED:
        seen, stack = set(), [(start, (start,))]
        while stack:
            node, path = stack.pop()
            for dep in graph.get(node, ()):
                if dep == start:
                    pytest.fail("import cycle: " + " -> ".join((*path, dep)))
                if dep not in seen:
                    seen.add(dep)
                    stack.append((dep, (*path, dep)))


def test_the_table_names_transformers_own_classes():
    """Each family's model_type, config class and architecture are transformers' own."""
    import transformers

    for name, family in FAMILIES.items():
        config_class = getattr(transformers, family.config_class)
        assert config_class.model_type == name
        assert hasattr(transformers, family.architecture), family.architecture
        assert family_of(None, [family.architecture]) is family
    assert set(MOE_FAMILIES) == {n for n, f in FAMILIES.items() if f.routing != "dense"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_writes_and_loads_by_the_table(name, tmp_path):
    """The synthetic writer makes a checkpoint of each family in the table, and the loader
    reads it back as that family with a complete tensor inventory."""
    from consumer.checkpoints import validate_hf_checkpoint
    from consumer.checkpoints.synthetic import write_random_hf_checkpoint

    sizes = {"num_kv_heads": 4} if FAMILIES[name].is_moe else {}
    path = write_random_hf_checkpoint(tmp_path / name, name, vocab_size=200, **sizes)
    spec = validate_hf_checkpoint(path)
    assert spec.family == name and spec.is_moe == FAMILIES[name].is_moe
    assert spec.is_mla == (FAMILIES[name].attention == "mla")
