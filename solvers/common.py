"""What every solver does last: score its schedule with ``simulate`` and check the budget."""

from __future__ import annotations

from collections.abc import Iterable

from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.errors import InfeasibleBudgetError, UnsupportedModelError
from planner.solvers.simulate import simulate


def finish(
    graph: CostGraph,
    budget_bytes: float,
    regions: Iterable[Region],
    solver: str,
    note: str = "",
    gap: float | None = None,
    min_bytes: int | None = None,
) -> Schedule:
    """The schedule if ``simulate`` puts its peak within budget, else InfeasibleBudgetError.

    ``min_bytes`` is the least peak the solver found over everything it tried (defaults to
    this schedule's peak), so the error states the least feasible budget it knows of.
    """
    schedule = Schedule(tuple(sorted(regions, key=lambda r: (r.start, -r.stop))), solver, gap, note)
    spans = graph.region_spans
    if spans is not None and any((r.start, r.stop) not in spans for r in schedule.regions):
        raise UnsupportedModelError(
            f"solver {solver!r} places regions between arbitrary nodes, but this graph's regions "
            f"must each be one module call (a plan applied in place); use solver 'auto', 'dp' "
            f"or 'ilp', or plan with form='graph'"
        )
    peak_bytes = simulate(graph, schedule).peak_bytes
    if peak_bytes > budget_bytes:
        least = peak_bytes if min_bytes is None else min(min_bytes, peak_bytes)
        raise InfeasibleBudgetError(budget_bytes, least, f"(solver {solver!r})")
    return schedule


def segments_to_regions(bounds: list[int], every: int = 1) -> list[Region]:
    """One region per group of ``every`` consecutive segments between ``bounds``."""
    picked = bounds[::every]
    if picked[-1] != bounds[-1]:
        picked.append(bounds[-1])
    return [Region(a, b) for a, b in zip(picked, picked[1:]) if b > a]
