"""The layers import downwards only: solvers/ sees nothing above it, passes/ nothing of planner/.

``solvers/`` is pure functions over a CostGraph: no torch, no planner module outside
``planner.solvers``. ``passes/`` (torch passes over a model) may use the solvers' types but no
module of the planner package that builds on it (``planner.devices``, ``planner.inplace``...):
what they need crosses in as data (``planner.solvers.rates.DeviceProfile``). Every import counts,
also those under ``if TYPE_CHECKING:`` and inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import planner.passes
import planner.solvers

LAYERS = {
    "planner.passes": (Path(planner.passes.__file__).parent, ("planner.passes", "planner.solvers")),
    "planner.solvers": (Path(planner.solvers.__file__).parent, ("planner.solvers",)),
}
# Third-party packages a layer must not import (solvers/ runs where torch is not installed).
FORBIDDEN = {"planner.solvers": ("torch",), "planner.passes": ()}


def imported_modules(source: str, package: str) -> list[str]:
    """Every module ``source`` (a module of ``package``) imports, relative imports resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append(".".join([*base, *([node.module] if node.module else [])]))
            else:
                found.append(str(node.module))
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(source: str, package: str) -> list[str]:
    """The imports of ``source`` (a module of ``package``) that break its layer's rule."""
    allowed = LAYERS[package][1]
    bad = []
    for name in imported_modules(source, package):
        if _within(name, ("planner",)) and not _within(name, allowed):
            bad.append(name)
        elif _within(name, FORBIDDEN[package]):
            bad.append(name)
    return bad


def _modules() -> list[tuple[str, Path]]:
    return [
        (package, path)
        for package, (folder, _) in LAYERS.items()
        for path in sorted(folder.glob("*.py"))
    ]


@pytest.mark.parametrize(("package", "path"), _modules(), ids=lambda v: getattr(v, "name", v))
def test_layer_imports_only_downwards(package: str, path: Path) -> None:
    assert violations(path.read_text(), package) == [], f"{package}/{path.name}"


def test_every_kind_of_import_is_seen() -> None:
    # A function-level import, one under TYPE_CHECKING, and a relative one climbing out of the
    # package: the rule must see all three, or the test above proves nothing.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from planner.devices import DeviceProfile\n"
        "def f():\n    import planner.inplace\n"
        "from ..report import x\n"
        "from .nodes import module_path\n"
        "from planner.solvers.costgraph import CostGraph\n"
    )
    assert sorted(violations(source, "planner.passes")) == [
        "planner.devices",
        "planner.inplace",
        "planner.report",
    ]
    assert violations("def f():\n    import torch.fx\n", "planner.solvers") == ["torch.fx"]
    assert violations("from planner.passes.step import x\n", "planner.solvers") == [
        "planner.passes.step"
    ]
    assert len(_modules()) >= 15  # both folders found, not an empty walk
