"""dp under simulate's prices on random small graphs, with and without early stop (Rule 5).

Brute force (``tests/solvers/brute.py``) scores every laminar family of recompute regions with
``simulate``. On chains, DAGs with skips and held storages, and chains with in-place writes,
nested regions included, with Rule 5 off (hand-built graphs) and on (``with_saves``: graphs as
the estimator describes them, some outputs allocated after their producer's last save), dp
over the same space (every interval, any depth, no selective regions, 1-byte grid) has the
same least budget as brute force and, at every budget from it to the eager peak, returns a
schedule that fits under ``simulate`` with brute force's least recompute time.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solvers.costgraph import Region, Schedule
from planner.solvers.dp_search import DPOptions, solve_all, solve_dp
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.simulate import simulate
from tests.solvers.brute import score_all
from tests.solvers.synthetic import random_chain, random_dag, random_inplace_chain, with_saves

GENERATORS = (random_chain, random_dag, random_inplace_chain)


def _budgets(graph, scored, rng):
    eager = simulate(graph, Schedule()).peak_bytes
    least = scored.least_bytes
    return [least - 1, least, rng.randint(least, eager), eager]


def _assert_dp_equals_brute_force(graph, offload: bool = False) -> None:
    """Same least budget; at every budget up to the eager peak a schedule that fits and costs
    brute force's least: recompute time, or with ``offload`` the time added to the step."""
    scored = score_all(graph, offload=offload)
    eager = simulate(graph, Schedule()).peak_bytes
    options = DPOptions(max_span=None, grid=max(1, eager), selective=False, offload=offload)
    solved = solve_all(graph, eager, options)
    assert solved.unit_bytes == 1
    assert solved.least_bytes() == scored.least_bytes
    assert solved.schedule(scored.least_bytes - 1) is None
    for budget in range(scored.least_bytes, eager + 1):
        schedule = solved.schedule(budget)
        sim = simulate(graph, schedule)
        assert sim.peak_bytes <= budget, (budget, schedule.regions)
        got = sim.step_time_s - graph.step_time_s if offload else sim.recompute_time_s
        want = scored.best(budget)[0]
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (budget, schedule.regions)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 5),
    kind=st.integers(0, 2),
    early_stop=st.booleans(),
)
def test_dp_equals_brute_force_under_simulate(seed, n, kind, early_stop):
    rng = random.Random(seed)
    graph = GENERATORS[kind](rng, n)
    if early_stop:
        graph = with_saves(rng, graph)
    _assert_dp_equals_brute_force(graph)


def test_nests_that_pass_a_skip_two_levels_down_pay_for_it():
    # Node 0's 54 B output is read by nodes 1 and 3. Nested [0, 4) > [1, 4) > [1, 2) was this
    # graph's least at 132 B while simulate let it die when [1, 4)'s recomputation ended; but
    # that recomputation saves it again as [1, 2)'s argument (Rule 3), so the nest costs
    # 151 B and one region, [0, 2), is the least (149 B). dp and brute force agree on it.
    graph = random_dag(random.Random(0), 4)
    assert graph.tensors[0].size_bytes == 54 and graph.tensors[0].users == (1, 3)
    _assert_dp_equals_brute_force(graph)
    nest = (Region(0, 4, 0), Region(1, 4, 1), Region(1, 2, 2))
    assert simulate(graph, Schedule(nest)).peak_bytes == 151
    solved = solve_all(graph, 150, DPOptions(max_span=None, grid=150, selective=False))
    assert solved.least_bytes() == 149
    assert solved.schedule(149).regions == (Region(0, 2, 0),)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 5), kind=st.integers(0, 2))
def test_solve_dp_equals_brute_force_with_rule5(seed, n, kind):
    """The solver itself (its grid, its selective regions, its checks): never costlier than
    brute force's recompute-region optimum, refusing exactly the budgets brute force refuses."""
    rng = random.Random(seed)
    graph = with_saves(rng, GENERATORS[kind](rng, n))
    scored = score_all(graph)
    for budget in _budgets(graph, scored, rng):
        want = scored.best(budget)
        try:
            got = solve_dp(graph, budget, max_span=None)
        except InfeasibleBudgetError as e:
            assert want is None and e.min_bytes == scored.least_bytes
            continue
        assert want is not None, got.regions
        sim = simulate(graph, got)
        assert sim.peak_bytes <= budget
        assert sim.recompute_time_s <= want[0] + 1e-9


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 4),
    kind=st.integers(0, 2),
    early_stop=st.booleans(),
    link=st.sampled_from((1e8, 1e9, 1e10)),
    overlap=st.sampled_from((0.0, 0.5, 1.0)),
)
def test_dp_with_offload_equals_brute_force_under_simulate(
    seed, n, kind, early_stop, link, overlap
):
    """Offload in the space (top-level offload regions, Rule 7): dp's least budget is brute
    force's, and at every budget its schedule adds brute force's least time to the step
    (recompute plus exposed transfers)."""
    rng = random.Random(seed)
    graph = GENERATORS[kind](rng, n)
    if early_stop:
        graph = with_saves(rng, graph)
    graph = replace(graph, offload_bytes_per_s=link, offload_overlap=overlap)
    _assert_dp_equals_brute_force(graph, offload=True)
