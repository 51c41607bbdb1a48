"""The "flops" objective: dp minimises recomputed FLOPs (ties to the faster schedule), checked
against brute force under simulate on random chains whose node times have nothing to do with
their FLOPs."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solvers.costgraph import Schedule, graph_for_objective
from planner.solvers.registry import solve
from planner.solvers.simulate import simulate
from tests.solvers.brute import families
from tests.solvers.synthetic import random_chain


def _chain_with_unrelated_times(seed: int, n: int):
    rng = random.Random(seed)
    graph = random_chain(rng, n)
    nodes = tuple(replace(nd, fwd_time_s=rng.uniform(1e-3, 1.0)) for nd in graph.nodes)
    return replace(graph, nodes=nodes)


def _assert_flops_objective_exact(seed: int, n: int) -> None:
    graph = _chain_with_unrelated_times(seed, n)
    scored = [
        (sim.recompute_flops, sim.recompute_time_s, sim.peak_bytes)
        for sim in (simulate(graph, Schedule(tuple(f))) for f in families(0, n))
    ]
    eager = simulate(graph, Schedule()).peak_bytes
    least = min(peak for _, _, peak in scored)
    for budget in sorted({least, (least + eager) // 2, eager}):
        schedule = solve(graph, budget, "dp", "flops", max_span=None, grid=eager, selective=False)
        sim = simulate(graph, schedule)
        assert sim.peak_bytes <= budget
        fitting = [(f, t) for f, t, peak in scored if peak <= budget]
        least_flops = min(f for f, _ in fitting)
        assert sim.recompute_flops == least_flops, (budget, schedule.regions)
        fastest = min(t for f, t in fitting if f == least_flops)
        assert sim.recompute_time_s == pytest.approx(fastest, rel=1e-9), schedule.regions
        assert "objective='flops'" in schedule.note


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 5))
def test_flops_objective_is_least_recompute_flops_then_least_time(seed, n):
    _assert_flops_objective_exact(seed, n)


def test_flops_objective_where_the_fastest_plan_recomputes_more_flops():
    # Chain 6 of 5 nodes at budget 159 B: the least recompute time (0.97 s) recomputes 87
    # FLOPs, the least FLOPs are 79; dp under "time" takes the former, under "flops" the latter.
    graph = _chain_with_unrelated_times(6, 5)
    by_time = solve(graph, 159, "dp", "time", max_span=None, grid=1000, selective=False)
    assert simulate(graph, by_time).recompute_flops == 87
    _assert_flops_objective_exact(6, 5)


def test_time_objective_is_the_graph_itself_and_unknown_objectives_are_refused():
    graph = _chain_with_unrelated_times(0, 4)
    assert graph_for_objective(graph, "time") is graph
    with pytest.raises(ValueError, match="objective must be one of"):
        graph_for_objective(graph, "memory")
