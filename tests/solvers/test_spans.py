"""Module-granular graphs (``CostGraph.region_spans``): dp and ilp keep to the spans, and dp is
optimal against brute force over span-only schedules; solvers that cannot keep to them refuse."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solvers.costgraph import Region, Schedule
from planner.solvers.dp import solve_dp
from planner.solvers.errors import InfeasibleBudgetError, UnsupportedModelError
from planner.solvers.ilp import solve_ilp
from planner.solvers.registry import get_solver
from planner.solvers.simulate import InvalidScheduleError, simulate
from tests.solvers.brute import families, score_all
from tests.solvers.synthetic import random_chain, random_dag


def _with_spans(graph, rng):
    """The graph with a random laminar family of spans, as a module tree's calls are."""
    options = [f for f in families(0, len(graph.nodes)) if f]
    spans = frozenset((r.start, r.stop) for r in rng.choice(options))
    return dataclasses.replace(graph, region_spans=spans)


def _span_only(graph):
    """Brute force over the schedules whose regions are all spans (scored without them)."""
    spans = graph.region_spans
    scored = score_all(dataclasses.replace(graph, region_spans=None))
    entries = tuple(e for e in scored.entries if all((r.start, r.stop) in spans for r in e[2]))
    return dataclasses.replace(scored, entries=entries)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 5), dag=st.booleans())
def test_dp_is_optimal_over_span_only_schedules(seed, n, dag):
    rng = random.Random(seed)
    graph = _with_spans((random_dag if dag else random_chain)(rng, n), rng)
    _assert_dp_matches(graph, _span_only(graph), rng)


def _span_only_offload(graph):
    """Brute force over span-only schedules, offload regions (top level) included."""
    spans = graph.region_spans
    scored = score_all(dataclasses.replace(graph, region_spans=None), offload=True)
    entries = tuple(e for e in scored.entries if all((r.start, r.stop) in spans for r in e[2]))
    return dataclasses.replace(scored, entries=entries)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 4),
    dag=st.booleans(),
    link=st.sampled_from((1e8, 1e10)),
    overlap=st.sampled_from((0.0, 1.0)),
)
def test_dp_with_offload_is_optimal_over_span_only_schedules(seed, n, dag, link, overlap):
    """Offload regions on module spans (the in-place form runs them): dp's least budget and
    the time it adds to the step are brute force's at every budget."""
    rng = random.Random(seed)
    graph = _with_spans((random_dag if dag else random_chain)(rng, n), rng)
    graph = dataclasses.replace(graph, offload_bytes_per_s=link, offload_overlap=overlap)
    _assert_dp_matches(graph, _span_only_offload(graph), rng, offload=True)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 6))
def test_dp_selective_regions_and_ilp_keep_to_spans(seed, n):
    rng = random.Random(seed)
    graph = _with_spans(random_dag(rng, n), rng)
    eager = simulate(graph, Schedule()).peak_bytes
    budget = rng.randint(eager // 2, eager)
    for solve in (solve_dp, solve_ilp, get_solver("auto")):
        try:
            got = solve(graph, budget)
        except InfeasibleBudgetError:
            continue
        assert all((r.start, r.stop) in graph.region_spans for r in got.regions), got
        assert simulate(graph, got).peak_bytes <= budget


def test_simulate_refuses_regions_off_the_spans():
    graph = dataclasses.replace(random_chain(random.Random(0), 4), region_spans=frozenset({(0, 2)}))
    with pytest.raises(InvalidScheduleError, match="region spans"):
        simulate(graph, Schedule((Region(1, 3),)))


@pytest.mark.parametrize("name", ["uniform", "sqrt", "greedy", "revolve", "selective"])
def test_solvers_that_ignore_spans_refuse_clearly(name):
    rng = random.Random(1)
    graph = random_chain(rng, 12, max_bytes=64)
    graph = dataclasses.replace(graph, region_spans=frozenset({(0, 12)}))
    eager = simulate(graph, Schedule()).peak_bytes
    try:
        got = get_solver(name)(graph, eager - 1)
    except (UnsupportedModelError, InvalidScheduleError) as e:
        assert "module call" in str(e) and "'dp'" in str(e)
    except InfeasibleBudgetError:
        pass  # nothing within budget to place anywhere
    else:
        assert all((r.start, r.stop) in graph.region_spans for r in got.regions)


def _assert_dp_matches(graph, scored, rng, offload: bool = False) -> None:
    """dp on module spans against brute force's ``scored`` span-only schedules: the same least
    budget, and at each budget its cost (recompute time, or with ``offload`` the time added to
    the step), proven optimal when it does not offload."""
    eager = simulate(graph, Schedule()).peak_bytes
    for budget in (scored.least_bytes - 1, scored.least_bytes, rng.randint(0, eager), eager):
        want = scored.best(budget)
        try:
            # brute force has no selective; offload only where it scores offload too
            got = solve_dp(graph, budget, selective=False, **({"offload": True} if offload else {}))
        except InfeasibleBudgetError as e:
            assert want is None, f"dp found nothing, brute force found {want[1].regions}"
            assert e.min_bytes == scored.least_bytes
            continue
        assert want is not None, got.regions
        assert all((r.start, r.stop) in graph.region_spans for r in got.regions)
        sim = simulate(graph, got)
        assert sim.peak_bytes <= budget
        cost_s = sim.step_time_s - graph.step_time_s if offload else sim.recompute_time_s
        assert cost_s == pytest.approx(want[0], abs=1e-9), (got.regions, want[1])
        if not offload:
            assert got.gap == 0.0
