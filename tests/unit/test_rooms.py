"""The consumer's rooms import one way (docs/architecture.md, "Three rooms, one way").

Floors: consumer/tp_ops, consumer/kernels and the top-level modules (parallel, cpu_compat,
head_common, transfer). Above them, in order: forward, checkpoints, group, serve. A module may
import its own room and anything below it, never above. `consumer/__main__.py` (the entry point)
may import anything. Every module's imports are read with `ast`, function-level imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

CONSUMER = Path(__file__).resolve().parents[2] / "consumer"

# The order of the floors and rooms, lowest first; a module may import only what is at or below
# its own level.
LEVEL = {"floor": 0, "forward": 1, "checkpoints": 2, "group": 3, "serve": 4, "entry": 5}
ROOMS = {"tp_ops": "floor", "kernels": "floor", "forward": "forward"}
ROOMS |= {"checkpoints": "checkpoints", "group": "group", "serve": "serve"}


def room_of(module: str) -> str:
    """The room of a dotted module name under `consumer`."""
    parts = module.split(".")
    assert parts[0] == "consumer", module
    if len(parts) == 1:
        return "floor"
    if parts[1] == "__main__":
        return "entry"
    return ROOMS.get(parts[1], "floor")


def module_name(path: Path) -> str:
    rel = path.relative_to(CONSUMER.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every `consumer` import in the file; `from consumer.x import y`
    counts as `consumer.x.y` so that `from consumer import serve` is seen too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}:{node.lineno}: relative import; use consumer.<room>...")
    return [(line, name) for line, name in found if name.split(".")[0] == "consumer"]


def violations() -> list[str]:
    bad = []
    for path in sorted(CONSUMER.rglob("*.py")):
        mine = module_name(path)
        level = LEVEL[room_of(mine)]
        for line, name in imported(path):
            theirs = room_of(name)
            if LEVEL[theirs] > level:
                rel = path.relative_to(CONSUMER.parent)
                bad.append(f"{rel}:{line} ({room_of(mine)}) imports {name} ({theirs})")
    return bad


def test_rooms_import_one_way() -> None:
    bad = violations()
    assert not bad, "imports against the rooms' order:\n" + "\n".join(bad)


def test_the_guard_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The checker catches an upward import (a forward module importing serve)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from consumer.serve.leader import Leader\n")
    assert imported(src) == [(2, "consumer.serve.leader.Leader")]
    assert LEVEL[room_of("consumer.serve.leader.Leader")] > LEVEL[room_of("consumer.forward.model")]


def test_top_level_is_thin() -> None:
    """Only the entry point and the floor modules stay at the top of consumer/."""
    top = {p.name for p in CONSUMER.glob("*.py")}
    assert top == {
        "__init__.py",
        "__main__.py",
        "parallel.py",
        "cpu_compat.py",
        "head_common.py",
        "transfer.py",
    }
