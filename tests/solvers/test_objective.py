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
from planner.solvers.errors import RecomputeCapError
from planner.solvers.registry import solve
from planner.solvers.simulate import simulate
from tests.solvers.brute import families
from tests.solvers.synthetic import random_chain


def _chain_with_unrelated_times(seed: int, n: int, region_overhead_s: float = 0.0):
    rng = random.Random(seed)
    graph = random_chain(rng, n)
    nodes = tuple(replace(nd, fwd_time_s=rng.uniform(1e-3, 1.0)) for nd in graph.nodes)
    return replace(graph, nodes=nodes, region_overhead_s=region_overhead_s)


def _assert_flops_objective_exact(seed: int, n: int, region_overhead_s: float = 0.0) -> None:
    graph = _chain_with_unrelated_times(seed, n, region_overhead_s)
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


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 5))
def test_flops_objective_holds_when_checkpointing_overhead_dwarfs_the_flops(seed, n):
    """Each region's bookkeeping 10^6 s against FLOPs worth 1 s each (a tiny model's measured
    overheads against its FLOPs, exaggerated): FLOPs still decide, time only breaks ties. A
    fixed time weight of 1e-3 took fewer regions that recompute more FLOPs."""
    _assert_flops_objective_exact(seed, n, region_overhead_s=1e6)


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


def _scored_within(graph, budget):
    return [
        (sim.recompute_flops, sim.recompute_time_s)
        for sim in (simulate(graph, Schedule(tuple(f))) for f in families(0, len(graph.nodes)))
        if sim.peak_bytes <= budget
    ]


def _capped(graph, budget, cap_flops, objective="time"):
    # half a FLOP above the cap: a whole number of FLOPs at the cap keeps to it
    fraction = (cap_flops + 0.5) / graph.step_flops
    return solve(
        graph,
        budget,
        "dp",
        objective,
        max_recompute_flops_fraction=fraction,
        max_span=None,
        grid=simulate(graph, Schedule()).peak_bytes,
        selective=False,
    )


def _trade_off(scored):
    """The points of (recomputed FLOPs, time) that some FLOPs weight makes optimal: the lower
    convex hull of time against FLOPs, fewest FLOPs first."""
    hull = set()
    for w in (0.0, *(2.0**k for k in range(-30, 31))):
        best = min(t + w * f for f, t in scored)
        hull.add(min((f, t) for f, t in scored if t + w * f <= best + 1e-12))
    return sorted(hull)


def _assert_cap_reaches_the_trade_off(graph, budget):
    scored = _scored_within(graph, budget)
    hull = _trade_off(scored)
    for cap, time_s in hull:
        sim = simulate(graph, _capped(graph, budget, cap))
        assert sim.peak_bytes <= budget and sim.recompute_flops <= cap
        assert sim.recompute_time_s == pytest.approx(time_s, rel=1e-9), (cap, hull)
    return hull


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 5))
def test_flops_cap_gives_the_fastest_schedule_on_the_trade_off_within_it(seed, n):
    graph = _chain_with_unrelated_times(seed, n)
    eager = simulate(graph, Schedule()).peak_bytes
    least_peak = min(simulate(graph, Schedule(tuple(f))).peak_bytes for f in families(0, n))
    _assert_cap_reaches_the_trade_off(graph, (least_peak + eager) // 2)


def test_flops_cap_reaches_a_trade_off_between_the_fastest_and_the_fewest_flops():
    # Chain 130 of 5 nodes at 165 B trades (FLOPs, seconds) (68, 1.06), (87, 0.56), (184, 0.28):
    # a cap of 87 FLOPs needs the weight's bisection to reach the middle one.
    hull = _assert_cap_reaches_the_trade_off(_chain_with_unrelated_times(130, 5), 165)
    assert [f for f, _ in hull] == [68, 87, 184]


def test_flops_cap_reaches_the_fastest_schedule_when_it_fits_and_refuses_too_tight_a_cap():
    graph = _chain_with_unrelated_times(6, 5)
    fastest = simulate(graph, solve(graph, 159, "dp", "time", max_span=None, grid=1000))
    assert fastest.recompute_flops == 87
    loose = simulate(graph, _capped(graph, 159, 87))
    assert loose.recompute_time_s == pytest.approx(fastest.recompute_time_s)
    least = simulate(graph, _capped(graph, 159, 79))
    assert least.recompute_flops == 79
    with pytest.raises(RecomputeCapError, match="the least any recomputes is"):
        _capped(graph, 159, 78)
    with pytest.raises(ValueError, match="max_recompute_flops_fraction must be"):
        solve(graph, 159, "dp", max_recompute_flops_fraction=-0.1)
