"""Brute force: every laminar family of recompute regions on a tiny graph, scored by simulate.

The reference the exact solvers are tested against. Schedules are visited in order of
recompute time, so the first one within budget is optimal and few are simulated.
"""

from __future__ import annotations

from collections.abc import Iterator

from solvers.costgraph import CostGraph, Region, Schedule
from solvers.simulate import simulate


def families(
    lo: int, hi: int, depth: int = 0, max_depth: int | None = None, whole_ok: bool = True
) -> Iterator[list[Region]]:
    """Every laminar family of intervals inside [lo, hi) (regions at ``depth`` and deeper)."""
    if lo == hi:
        yield []
        return
    yield from families(lo + 1, hi, depth, max_depth, True)
    if max_depth is not None and depth >= max_depth:
        return
    for j in range(lo + 1, hi + 1):
        if j == hi and not whole_ok:
            continue
        for inner in families(lo, j, depth + 1, max_depth, False):
            for rest in families(j, hi, depth, max_depth, True):
                yield [Region(lo, j, depth), *inner, *rest]


def recompute_time_s(graph: CostGraph, regions: list[Region]) -> float:
    return sum(graph.node_time_s(i) for r in regions for i in range(r.start, r.stop))


def brute_force(
    graph: CostGraph, budget_bytes: float, max_depth: int | None = None
) -> tuple[float, Schedule] | None:
    """(least recompute time, a schedule reaching it) within budget, or None if none fits."""
    n = len(graph.nodes)
    scored = sorted(
        ((recompute_time_s(graph, f), len(f), f) for f in families(0, n, 0, max_depth)),
        key=lambda x: (x[0], x[1]),
    )
    for cost, _, family in scored:
        schedule = Schedule(tuple(family), "brute")
        if simulate(graph, schedule).peak_bytes <= budget_bytes:
            return cost, schedule
    return None


def least_peak(graph: CostGraph, max_depth: int | None = None) -> int:
    n = len(graph.nodes)
    return min(
        simulate(graph, Schedule(tuple(f))).peak_bytes for f in families(0, n, 0, max_depth)
    )
