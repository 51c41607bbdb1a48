"""Module-granular graphs (``CostGraph.region_spans``): dp and ilp keep to the spans, and dp is
optimal against brute force over span-only schedules; solvers that cannot keep to them refuse."""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solvers.costgraph import Region, Schedule
from planner.solvers.dp_search import solve_dp
from planner.solvers.errors import InfeasibleBudgetError, UnsupportedModelError
from planner.solvers.ilp import solve_ilp
from planner.solvers.registry import get_solver
from planner.solvers.simulate import simulate
from planner.solvers.validate import InvalidScheduleError
from tests.solvers.brute import assert_matches, families, score_all
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
    # brute force has no selective regions
    assert_matches(functools.partial(solve_dp, selective=False), graph, _span_only(graph), rng)


def _span_only_offload(graph, max_depth=None):
    """Brute force over span-only schedules, offload regions (top level) included."""
    spans = graph.region_spans
    scored = score_all(dataclasses.replace(graph, region_spans=None), max_depth, offload=True)
    entries = tuple(e for e in scored.entries if all((r.start, r.stop) in spans for r in e[2]))
    return dataclasses.replace(scored, entries=entries)


@pytest.mark.parametrize("solver", ["dp", "ilp"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 4),
    dag=st.booleans(),
    link=st.sampled_from((1e8, 1e10)),
    overlap=st.sampled_from((0.0, 1.0)),
)
def test_dp_and_ilp_with_offload_are_optimal_over_span_only_schedules(
    solver, seed, n, dag, link, overlap
):
    """Offload regions on module spans (the in-place form runs them): dp's least budget and
    the time it adds to the step are brute force's at every budget; so are ilp's (its MILP
    alone, no warm start from dp) over non-nested span schedules."""
    rng = random.Random(seed)
    graph = _with_spans((random_dag if dag else random_chain)(rng, n), rng)
    graph = dataclasses.replace(graph, offload_bytes_per_s=link, offload_overlap=overlap)
    if solver == "dp":
        solve, max_depth = functools.partial(solve_dp, selective=False, offload=True), None
    else:
        solve, max_depth = functools.partial(solve_ilp, offload=True, warm=False, rel_gap=0.0), 1
    assert_matches(solve, graph, _span_only_offload(graph, max_depth), rng, offload=True)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 6), host_link=st.booleans())
def test_dp_selective_regions_and_ilp_keep_to_spans(seed, n, host_link):
    """With a host link, their offload regions too."""
    rng = random.Random(seed)
    graph = dataclasses.replace(_with_spans(random_dag(rng, n), rng), host_link=host_link)
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


@pytest.mark.parametrize("name", ["uniform", "sqrt", "greedy", "revolve", "selective", "sac"])
def test_block_solvers_on_spans_without_blocks_refuse_clearly(name):
    """In place the classic strategies count the model's repeated blocks; a graph with none
    (this chain's nodes belong to no module) gets an error naming the solvers that apply."""
    rng = random.Random(1)
    graph = random_chain(rng, 12, max_bytes=64)
    graph = dataclasses.replace(graph, region_spans=frozenset({(0, 12)}))
    with pytest.raises(UnsupportedModelError, match="repeated blocks") as e:
        get_solver(name)(graph, math.inf)
    assert "'dp'" in str(e.value) and "'ilp'" in str(e.value)


def test_auto_cut_short_names_no_least_it_does_not_know(monkeypatch):
    """On a module-granular graph, auto's solvers below the eager peak are dp and ilp: when
    they are cut short before they know, 'none' alone would name the eager peak as the least
    feasible budget, though a schedule below it exists (T5 in place: dp out of time at 29-59%
    of eager). The error says no solver finished, and what the others reached."""
    import planner.solvers.auto as auto

    rng = random.Random(0)
    graph = random_chain(rng, 12)
    spans = frozenset((i, j) for i in range(12) for j in range(i + 1, 13))
    graph = dataclasses.replace(graph, region_spans=spans)
    eager = simulate(graph, Schedule()).peak_bytes
    in_time = auto.solve_auto(graph, eager - 1, auto.AutoOptions())
    assert simulate(graph, in_time).peak_bytes < eager - 1  # a fit below the eager peak exists

    def cut_short(graph, budget_bytes, options):  # as dp and ilp raise when out of time
        raise InfeasibleBudgetError(budget_bytes, None, "(cut short)")

    real = auto.get_solver
    monkeypatch.setattr(
        auto, "get_solver", lambda name: real(name) if name == "none" else cut_short
    )
    with pytest.raises(InfeasibleBudgetError, match="dp, ilp cut short") as cut:
        auto.solve_auto(graph, eager - 1, auto.AutoOptions())
    assert cut.value.min_bytes is None
    assert "no solver finished in time" in str(cut.value)
    assert f"the others reach no lower than {eager} bytes" in str(cut.value)
