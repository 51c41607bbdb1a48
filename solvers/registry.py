"""Solvers by name, each with its options as one frozen dataclass.

A solver is ``solve(graph, budget_bytes, options) -> Schedule``; ``register(name, options=...)``
records it with its options class. The registered function also takes its options as keyword
arguments (``solve_dp(graph, budget, max_span=4)``): they are checked against the options class,
and an unknown one is a ValueError naming the valid ones, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from planner.solvers.costgraph import CostGraph, Objective, Schedule, graph_for_objective

# Every solver returns within this many seconds unless told otherwise (the whole of plan()'s
# solve step: ``auto`` shares it among the solvers it runs).
DEFAULT_TIME_LIMIT_S = 60.0


@dataclass(frozen=True)
class SolverOptions:
    """What every solver takes. ``time_limit_s``: the solver returns within about this long
    (the exact ones stop searching and answer with the best schedule found so far)."""

    time_limit_s: float = DEFAULT_TIME_LIMIT_S

    def deadline(self) -> float:
        """``time.perf_counter()`` value by which the solver must have answered."""
        return time.perf_counter() + self.time_limit_s


def time_limit_text(options: SolverOptions) -> str:
    """How every solver's note names its time limit (``auto`` looks for it)."""
    return f"time limit ({options.time_limit_s:g} s)"


class SolverFn(Protocol):
    options: type[SolverOptions]

    def __call__(
        self,
        graph: CostGraph,
        budget_bytes: float,
        options: SolverOptions | None = None,
        **opts: Any,
    ) -> Schedule: ...


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


def make_options(cls: type[SolverOptions], opts: Mapping[str, Any], solver: str = "") -> Any:
    """``cls(**opts)``, with an unknown keyword a ValueError naming the valid ones. A field
    whose default is itself an options dataclass (``auto``'s per-solver options) also takes a
    mapping of that class's keywords."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(opts) - set(fields))
    if unknown:
        who = f"solver {solver!r}" if solver else cls.__name__
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for {who}; "
            f"valid options: {', '.join(fields)}"
        )
    values = {}
    for key, value in opts.items():
        default = fields[key].default
        if isinstance(default, SolverOptions) and isinstance(value, Mapping):
            value = make_options(type(default), value, key)
        values[key] = value
    return cls(**values)


def _shallow(options: SolverOptions) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def register(
    name: str, options: type[SolverOptions] = SolverOptions
) -> Callable[[Callable[[CostGraph, float, Any], Schedule]], SolverFn]:
    """Register ``fn(graph, budget_bytes, options)`` as solver ``name`` with ``options``."""

    cls = options

    def wrap(fn: Callable[[CostGraph, float, Any], Schedule]) -> SolverFn:
        @functools.wraps(fn)
        def solve(
            graph: CostGraph,
            budget_bytes: float,
            options: SolverOptions | None = None,
            **kw: Any,
        ) -> Schedule:
            if options is None:
                options = make_options(cls, kw, name)
            elif not isinstance(options, cls):
                raise TypeError(f"solver {name!r} takes {cls.__name__}, not {type(options)}")
            elif kw:
                options = make_options(cls, {**_shallow(options), **kw}, name)
            return fn(graph, budget_bytes, options)

        solve.options = cls  # type: ignore[attr-defined]
        SOLVERS[name] = solve  # type: ignore[assignment]
        return solve  # type: ignore[return-value]

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


def solve(
    graph: CostGraph,
    budget_bytes: float,
    solver: str = "auto",
    objective: Objective = "time",
    **opts: Any,
) -> Schedule:
    """Solver ``solver``'s schedule for ``graph`` within ``budget_bytes``, minimising
    ``objective`` (``graph_for_objective``); a "flops" schedule's note says so."""
    schedule = get_solver(solver)(graph_for_objective(graph, objective), budget_bytes, **opts)
    if objective == "time":
        return schedule
    said = "minimised recomputed FLOPs (objective='flops'), ties to the faster"
    return dataclasses.replace(schedule, note=f"{schedule.note}; {said}" if schedule.note else said)
