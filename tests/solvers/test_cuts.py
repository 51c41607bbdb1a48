"""Cuts that in-place writes forbid: which they are, and that every solver keeps off them."""

from __future__ import annotations

import random

import pytest

from planner.solvers.costgraph import Region, Schedule
from planner.solvers.cuts import allowed_cuts, forbidden_cuts, region_bounds
from planner.solvers.dp_search import solve_dp
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import SOLVERS, get_solver
from planner.solvers.simulate import simulate
from planner.solvers.validate import InvalidScheduleError
from tests.solvers.brute import score_all
from tests.solvers.synthetic import GraphBuilder, random_inplace_chain


def linear_relu_() -> tuple:
    """a (alloc) -> b = linear(a) (alloc) -> relu_(b) (writes b) -> c = linear(b) (alloc)."""
    g = GraphBuilder()
    g.add("a", out_bytes=8)
    g.add("b", reads=("a",), saves=("a",), out_bytes=16)
    g.add("relu_", reads=("b",), saves=("b",), writes=("b",))
    g.add("c", reads=("b",), saves=("b",), out_bytes=4)
    return g.build(outputs=("c",))


def test_a_storage_written_in_place_forbids_the_cuts_up_to_its_writer():
    graph = linear_relu_()
    # b is produced by node 1 and written by node 2: cut 2 (between them) is forbidden.
    assert forbidden_cuts(graph) == {2}
    assert allowed_cuts(graph) == [True, True, False, True, True]
    # Cut 3 (after the in-place node, which allocates nothing) stands for cut 2.
    assert region_bounds(graph) == [0, 1, 3, 4]


def test_simulate_refuses_a_region_at_a_forbidden_cut():
    graph = linear_relu_()
    with pytest.raises(InvalidScheduleError, match="written in place"):
        simulate(graph, Schedule((Region(2, 4),)))
    simulate(graph, Schedule((Region(1, 3),)))  # the same memory, allowed


def _boundaries(schedule: Schedule) -> set[int]:
    return {c for r in schedule.regions for c in (r.start, r.stop)}


@pytest.mark.parametrize("seed", range(6))
def test_every_registered_solver_keeps_off_forbidden_cuts(seed):
    rng = random.Random(seed)
    graph = random_inplace_chain(rng, 16)
    forbidden = forbidden_cuts(graph)
    assert forbidden  # the graph really has in-place writes
    get_solver("none")  # registers every solver
    eager = simulate(graph, Schedule()).peak_bytes
    planned = 0
    for name in sorted(SOLVERS):
        for frac in (0.5, 0.7, 0.85, 1.0):
            try:
                schedule = get_solver(name)(graph, frac * eager)
            except InfeasibleBudgetError:
                continue
            assert not _boundaries(schedule) & forbidden, (name, schedule.regions)
            planned += bool(schedule.regions)
    assert planned  # some solver did checkpoint something


@pytest.mark.parametrize("seed", range(8))
def test_dp_is_optimal_among_schedules_off_forbidden_cuts(seed):
    rng = random.Random(100 + seed)
    graph = random_inplace_chain(rng, 6)
    scored = score_all(graph, max_depth=1)  # brute force skips families on forbidden cuts
    eager = simulate(graph, Schedule()).peak_bytes
    for budget in (rng.randint(0, eager), eager):
        want = scored.best(budget)
        try:
            got = solve_dp(graph, budget, max_span=None, max_depth=1)
        except InfeasibleBudgetError as e:
            assert want is None
            assert e.min_bytes == scored.least_bytes
            continue
        assert want is not None
        assert not _boundaries(got) & forbidden_cuts(graph)
        assert simulate(graph, got).recompute_time_s == pytest.approx(want[0], abs=1e-9)
