"""The house's shape: imports point down (kernels <- model <- engine <- server; training on model
and kernels only) and no module imports itself back through others, at load time or later."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a package may import the packages of a lower rank (and its own)
RANK = {"kernels": 0, "model": 1, "engine": 2, "training": 2, "server": 3}


def _modules() -> dict[str, Path]:
    out = {}
    for package in RANK:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the project's modules, at the top or inside functions (a
    `from package import submodule` counts as the submodule)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [known(f"{node.module}.{a.name}") for a in node.names]
            else:
                continue
            edges[name] |= {t for t in targets if t is not None and t != name}
    return edges


def test_imports_point_down() -> None:
    edges = _imports(_modules())
    up = sorted(
        f"{a} -> {b}"
        for a, targets in edges.items()
        for b in targets
        if RANK[b.split(".")[0]] > RANK[a.split(".")[0]]
        or {a.split(".")[0], b.split(".")[0]} == {"engine", "training"}
    )
    assert not up, up


def test_no_module_imports_itself_back() -> None:
    modules = _modules()
    edges = _imports(modules)
    cycles = []
    for start in modules:  # a path from each module back to itself, depth first
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    cycles = [c for c in cycles if not _through_package_init(c, modules)]
    assert not cycles, cycles[:5]


def _through_package_init(cycle: str, modules: dict[str, Path]) -> bool:
    """Whether the cycle passes through a package's __init__ (its re-exports), which every
    import of a submodule runs first anyway."""
    return any(modules[m].name == "__init__.py" for m in cycle.split(" -> "))


def test_no_module_imports_another_modules_private_names() -> None:
    reached = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] in RANK:
                    reached += [f"{name}: {node.module}.{a.name}" for a in node.names
                                if a.name.startswith("_") and node.module != name]  # fmt: skip
    assert not reached, reached
