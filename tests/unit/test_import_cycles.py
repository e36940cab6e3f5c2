"""No import circle anywhere in producer/, consumer/, shared/ or bench/ (docs/architecture.md).

A circle means a set of modules that can only be read, tested and changed together, and an
import order that works by accident. Every import counts: top-level, inside a function, under
`if TYPE_CHECKING:` (a circle that is only there for the type checker is still one for the
reader).

How an import becomes an edge of the graph:

- `import a.b.c` is an edge to `a.b.c` only. Python runs `a/__init__.py` and `a/b/__init__.py`
  first, but counting those parents would make every package whose `__init__` re-exports a
  submodule circular with that submodule's own sibling imports; the reader depends on `a.b.c`.
- `from a.b import c` is an edge to `a.b.c` when `c` is a submodule, else to `a.b` (the name
  comes from the package's `__init__`). So a submodule that reads a name from its own
  package's `__init__`, while that `__init__` imports the submodule, is a circle, and fixed as
  one: the submodule imports the name from where it is defined. An `__init__` that only
  re-exports its submodules' names stays legal, since the submodules never import it.
- Relative imports resolve against the importing module's package.
- Only modules inside the four roots are nodes; everything else (the standard library, torch,
  tests) is left out.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("producer", "consumer", "shared", "bench")

Graph = dict[str, set[str]]


def module_files(base: Path, roots: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every `.py` file under `base/<root>` (a package's
    `__init__.py` is the package itself)."""
    files = {}
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> list[str]:
    """The modules an import statement of module `name` may reach, as dotted names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:  # relative: strip (level - 1) parts off the importer's own package
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        module = ".".join([*base, *([node.module] if node.module else [])])
    else:
        module = node.module or ""
    return [module, *(f"{module}.{a.name}" for a in node.names)]


def import_graph(base: Path, roots: Iterable[str] = ROOTS) -> Graph:
    """Module -> the modules of the roots it imports anywhere in its source (see the module
    doc for how an import becomes an edge)."""
    files = module_files(base, roots)
    graph: Graph = {}
    for name, path in files.items():
        edges = graph.setdefault(name, set())
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            module, *names = _targets(node, name, is_package)
            if isinstance(node, ast.Import):
                edges.update(t for t in (module, *names) if t in files)
                continue
            submodules = [t for t in names if t in files]
            edges.update(submodules)
            # Names that are not submodules come from the module (a package: its __init__).
            if len(submodules) < len(names) and module in files:
                edges.add(module)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """The strongly connected components of `graph` (Tarjan's algorithm, iterative so that a
    deep chain of imports cannot exhaust Python's recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _shortest_cycle(graph: Graph, start: str, within: set[str]) -> list[str]:
    """A shortest path `start -> ... -> start` through the modules of `within`."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for dep in sorted(graph[node] & within):
            if dep == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if dep not in came_from:
                came_from[dep] = node
                queue.append(dep)
    raise AssertionError(f"{start} is on no cycle inside {sorted(within)}")


def circles(graph: Graph) -> list[str]:
    """Each import circle as `a -> b -> a` (one shortest circle per strongly connected
    component, naming the component's other members when it holds more); [] when none."""
    found = []
    for component in strongly_connected(graph):
        start = component[0]
        if len(component) == 1 and start not in graph[start]:
            continue
        line = " -> ".join(_shortest_cycle(graph, start, set(component)))
        rest = set(component) - set(line.split(" -> "))
        found.append(line + (f" (with {', '.join(sorted(rest))})" if rest else ""))
    return found


def test_no_import_circle() -> None:
    """No module of producer/, consumer/, shared/ or bench/ reaches itself through imports,
    counting function-level and TYPE_CHECKING imports; the message lists each circle."""
    graph = import_graph(ROOT)
    assert len(graph) > 100, "the walk should see the whole code base"
    assert "producer.gateway.server" in graph["producer.gateway"], "edges should be seen"
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_checker_sees_a_circle(tmp_path: Path) -> None:
    """A circle hidden in a function body and under TYPE_CHECKING, a relative import, a
    package `__init__` read back by its submodule, and a self-import are all reported; a
    re-exporting `__init__` and a one-way chain are not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")  # a pure re-export
    (pkg / "a.py").write_text("A = 1\ndef f():\n    from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    (pkg / "sub" / "__init__.py").write_text("from .c import C\n")
    (pkg / "sub" / "c.py").write_text("from pkg.sub import D\nC = 1\n")  # reads its __init__
    (pkg / "d.py").write_text("import pkg.d\n")
    (pkg / "e.py").write_text("from . import a\n")  # one way: no circle

    graph = import_graph(tmp_path, ["pkg"])

    assert graph["pkg.e"] == {"pkg.a"}
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert sorted(circles(graph)) == [
        "pkg.a -> pkg.b -> pkg.a",
        "pkg.d -> pkg.d",
        "pkg.sub -> pkg.sub.c -> pkg.sub",
    ]
