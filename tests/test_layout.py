"""The package's layering: dependencies point down only, and no import circle exists, lazy imports included.

docs/design.md ("Code map") lists the layers. A module may import its own layer and the layers below it; an import
inside a function counts as much as one at the top (a lazy import must not hide a circle or an upward reach).
Deterministic: reads the source files, imports nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jointspec

PACKAGE = Path(jointspec.__file__).resolve().parent

# Lowest first. Modules of one layer may import each other (no circle, though); never a higher layer.
LAYERS = [
    ["core"],
    ["kernels"],
    ["backends"],
    ["drafts"],
    ["drafters", "verifiers"],
    ["methods"],
    ["api"],
    ["batch", "analysis"],
    ["bench", "server", "train"],
    ["cli"],
    ["__main__"],
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_imports() -> dict[str, set[str]]:
    """Every jointspec module (dotted name) -> the jointspec modules it imports, anywhere in its text."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in names else base)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {other for other in found if other in names and other != name}
    return graph


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "jointspec"


def test_every_module_belongs_to_a_layer():
    unknown = sorted({layer_of(m) for m in module_imports()} - set(RANK) - {"jointspec"})
    assert not unknown, f"modules outside every layer of docs/design.md: {unknown}"


def test_imports_point_down_only():
    def rank(module: str) -> int:
        return RANK.get(layer_of(module), -1)  # the package's own __init__ sits below every layer

    upward = [(module, other) for module, imported in module_imports().items() for other in imported
              if rank(other) > rank(module) >= 0]
    assert not upward, f"imports that reach a higher layer: {upward}"


def test_no_import_circle():
    graph = module_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                circles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, f"import circles: {circles}"


def test_the_layer_check_sees_an_upward_import(monkeypatch):
    """The check itself can fail: a core module that imports the CLI is reported."""
    graph = module_imports()
    graph["jointspec.core.loop"] = graph["jointspec.core.loop"] | {"jointspec.cli.main"}
    monkeypatch.setattr(f"{__name__}.module_imports", lambda: graph)
    try:
        test_imports_point_down_only()
    except AssertionError as error:
        assert "jointspec.cli.main" in str(error)
    else:
        raise AssertionError("an upward import went unreported")


def test_the_circle_check_sees_a_circle(monkeypatch):
    graph = module_imports()
    graph["jointspec.core.draft"] = graph["jointspec.core.draft"] | {"jointspec.core.loop"}  # loop imports draft
    monkeypatch.setattr(f"{__name__}.module_imports", lambda: graph)
    try:
        test_no_import_circle()
    except AssertionError as error:
        assert "jointspec.core.loop" in str(error)
    else:
        raise AssertionError("an import circle went unreported")
