"""Brute force: every laminar family of recompute regions on a tiny graph, scored by simulate.

The reference the exact solvers are tested against. ``n`` nodes have 2, 8, 48, 352, 2880, ...
families with nesting, so keep ``n`` at 5 or below (7 or so with ``max_depth=1``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import pytest

from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.cuts import forbidden_cuts
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.simulate import simulate


def families(
    lo: int,
    hi: int,
    depth: int = 0,
    max_depth: int | None = None,
    whole_ok: bool = True,
    offload: bool = False,
) -> Iterator[list[Region]]:
    """Every laminar family of intervals inside [lo, hi) (regions at ``depth`` and deeper);
    with ``offload``, each top-level region with nothing nested in it may also be an offload
    region."""
    if lo == hi:
        yield []
        return
    yield from families(lo + 1, hi, depth, max_depth, True, offload)
    if max_depth is not None and depth >= max_depth:
        return
    for j in range(lo + 1, hi + 1):
        if j == hi and not whole_ok:
            continue
        for rest in families(j, hi, depth, max_depth, True, offload):
            for inner in families(lo, j, depth + 1, max_depth, False):
                yield [Region(lo, j, depth), *inner, *rest]
            if offload and depth == 0:
                yield [Region(lo, j, depth, "offload"), *rest]


@dataclass(frozen=True)
class Scored:
    """Every family of a graph with its simulated peak and recompute time."""

    entries: tuple[tuple[float, int, tuple[Region, ...]], ...]  # (time_s, peak_bytes, regions)

    @property
    def least_bytes(self) -> int:
        return min(peak for _, peak, _ in self.entries)

    def best(self, budget_bytes: float) -> tuple[float, Schedule] | None:
        """(least recompute time, a schedule reaching it) within budget, or None."""
        fits = [(t, len(r), r) for t, peak, r in self.entries if peak <= budget_bytes]
        if not fits:
            return None
        t, _, regions = min(fits, key=lambda e: (e[0], e[1]))
        return t, Schedule(regions, "brute")


def score_all(graph: CostGraph, max_depth: int | None = None, offload: bool = False) -> Scored:
    """Every family scored by recompute time, or with ``offload`` by the time the schedule adds
    to the step (recompute, exposed transfers, region bookkeeping)."""
    forbidden = forbidden_cuts(graph)  # in-place writes rule these boundaries out
    out = []
    for family in families(0, len(graph.nodes), 0, max_depth, offload=offload):
        if any(r.start in forbidden or r.stop in forbidden for r in family):
            continue
        sim = simulate(graph, Schedule(tuple(family)))
        added_s = sim.step_time_s - graph.step_time_s if offload else sim.recompute_time_s
        out.append((added_s, sim.peak_bytes, tuple(family)))
    return Scored(tuple(out))


def brute_force(
    graph: CostGraph, budget_bytes: float, max_depth: int | None = None
) -> tuple[float, Schedule] | None:
    """(least recompute time, a schedule reaching it) within budget, or None if none fits."""
    return score_all(graph, max_depth).best(budget_bytes)


def assert_matches(
    solve: Callable[[CostGraph, float], Schedule],
    graph: CostGraph,
    scored: Scored,
    rng: random.Random,
    offload: bool = False,
    budgets: Iterable[int] | None = None,
) -> None:
    """``solve`` (a solver with its options bound) against brute force's ``scored`` schedules
    (over the same space): the same least budget, and at each budget a schedule within it, on
    the graph's region spans if it has them, that costs brute force's least -- recompute time,
    or with ``offload`` the time added to the step -- proven optimal when it does not offload.
    ``budgets``: by default brute force's least, one byte less, one at random and the eager
    peak."""
    eager = simulate(graph, Schedule()).peak_bytes
    if budgets is None:
        budgets = (scored.least_bytes - 1, scored.least_bytes, rng.randint(0, eager), eager)
    for budget in budgets:
        want = scored.best(budget)
        try:
            got = solve(graph, budget)
        except InfeasibleBudgetError as e:
            assert want is None, f"solver found nothing, brute force found {want[1].regions}"
            assert e.min_bytes == scored.least_bytes
            continue
        assert want is not None, got.regions
        spans = graph.region_spans
        assert spans is None or all((r.start, r.stop) in spans for r in got.regions)
        sim = simulate(graph, got)
        assert sim.peak_bytes <= budget
        cost_s = sim.step_time_s - graph.step_time_s if offload else sim.recompute_time_s
        assert cost_s == pytest.approx(want[0], abs=1e-9), (got.regions, want[1])
        if not offload:
            assert got.gap == 0.0
