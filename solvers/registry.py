"""Solvers by name. A solver is ``solve(graph, budget_bytes, **opts) -> Schedule``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

from planner.solvers.costgraph import CostGraph, Schedule


class SolverFn(Protocol):
    def __call__(self, graph: CostGraph, budget_bytes: float, **opts) -> Schedule: ...


SOLVERS: dict[str, SolverFn] = {}

# Modules whose import registers solvers; loaded on first lookup so that importing a solver
# module directly never recurses through this one.
_MODULES = (
    "planner.solvers.basic",
    "planner.solvers.greedy",
    "planner.solvers.revolve",
    "planner.solvers.selective",
    "planner.solvers.dp",
    "planner.solvers.ilp",
    "planner.solvers.auto",
)


def register(name: str) -> Callable[[SolverFn], SolverFn]:
    def wrap(fn: SolverFn) -> SolverFn:
        SOLVERS[name] = fn
        return fn

    return wrap


def _load() -> None:
    for module in _MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # a missing dependency inside it is a real error
                raise


def get_solver(name: str) -> SolverFn:
    """The solver registered as ``name``; ValueError naming the known ones otherwise."""
    _load()
    try:
        return SOLVERS[name]
    except KeyError:
        known = ", ".join(sorted(SOLVERS))
        raise ValueError(f"unknown solver {name!r}; known solvers: {known}") from None
