"""No import circle among planner's modules, not even through type-only imports.

Every ``import`` and ``from ... import`` counts: at module level, under ``if TYPE_CHECKING:``
and inside functions (a circle that only a function-level import closes still means two
modules that cannot be read, tested or replaced apart). The repository keeps ``passes/`` and
``solvers/`` at its top level; they install as ``planner.passes`` and ``planner.solvers``
(pyproject.toml), so their modules are named that way here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "planner": ROOT / "planner",
    "planner.passes": ROOT / "passes",
    "planner.solvers": ROOT / "solvers",
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the three packages."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imported(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules among ``modules`` that the module ``name`` imports anywhere in ``tree``."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from planner import inplace`` imports the module planner.inplace
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            # the innermost module of ours the name falls in (planner.x.y -> planner.x)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> nx.DiGraph:
    files = module_files()
    graph = nx.DiGraph()
    for name, path in files.items():
        graph.add_node(name)
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in imported(tree, name, path.name == "__init__.py", set(files)):
            graph.add_edge(name, target)
    return graph


def test_the_walk_sees_imports_of_every_kind():
    """The walk finds imports under TYPE_CHECKING, inside functions and relative ones."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "import planner.report\n"
        "if TYPE_CHECKING:\n    from planner.plots import plot_pareto\n"
        "def f():\n    from planner import inplace\n    from .solvers import registry\n"
    )
    modules = {
        "planner",
        "planner.report",
        "planner.plots",
        "planner.inplace",
        "planner.solvers",
        "planner.solvers.registry",
        "planner.x",
    }
    assert imported(ast.parse(source), "planner.x", False, modules) == {
        "planner.report",
        "planner.plots",
        "planner.inplace",
        "planner.solvers.registry",
    }


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40 and graph.has_edge("planner.priced", "planner.solvers.registry")
    # The package's __init__ names everything (lazily, and for type checkers): it is the top,
    # which nothing inside may import back.
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert not cycles, "import circles (each module imports the next, the last the first):\n" + (
        "\n".join(" -> ".join(c + [c[0]]) for c in sorted(cycles, key=len)[:20])
    )
