"""dp under simulate's prices on random small graphs, with and without early stop (Rule 5).

What holds, and is asserted:
- chains and chains with in-place writes that do not say where saves are (Rule 5 off), nested
  regions included: dp's recompute time equals brute force's at every budget, and it refuses
  exactly the budgets brute force refuses;
- every graph, DAGs with skips and held storages too, with or without Rule 5: every schedule
  dp returns for a budget fits that budget under simulate, costs no less than brute force's
  (which searches the same space), and dp's least budget is no lower than brute force's.

What does not hold yet, found here and not asserted:
- with Rule 5 on (graphs as the estimator builds them), dp prices a region as recomputed to
  its end, above simulate's price when the recomputation stops early: on 600 random cases
  (``with_saves`` over the three generators, 2-5 nodes) dp matched brute force in 510, cost
  more in 14 and refused a budget brute force meets in 76;
- DAGs even without Rule 5: ``random_dag(random.Random(0), 4)`` reaches 132 B with three
  nested regions by brute force, dp's least is 149 B (so on main before this change too).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solvers.costgraph import Schedule
from planner.solvers.dp import DPOptions, solve_all, solve_dp
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.simulate import simulate
from tests.solvers.brute import score_all
from tests.solvers.synthetic import random_chain, random_dag, random_inplace_chain, with_saves

GENERATORS = (random_chain, random_dag, random_inplace_chain)


def _budgets(graph, scored, rng):
    eager = simulate(graph, Schedule()).peak_bytes
    least = scored.least_bytes
    return [least - 1, least, rng.randint(least, eager), eager]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 5), kind=st.sampled_from((0, 2)))
def test_dp_equals_brute_force_on_chains_without_early_stop(seed, n, kind):
    rng = random.Random(seed)
    graph = GENERATORS[kind](rng, n)
    scored = score_all(graph)
    for budget in _budgets(graph, scored, rng):
        want = scored.best(budget)
        try:
            got = solve_dp(graph, budget, max_span=None)
        except InfeasibleBudgetError as e:
            assert want is None and e.min_bytes == scored.least_bytes
            continue
        assert want is not None, got.regions
        assert simulate(graph, got).recompute_time_s == pytest.approx(want[0], abs=1e-9)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 5),
    kind=st.integers(0, 2),
    early_stop=st.booleans(),
)
def test_dp_schedules_fit_under_simulate_and_never_beat_brute_force(seed, n, kind, early_stop):
    rng = random.Random(seed)
    graph = GENERATORS[kind](rng, n)
    if early_stop:
        graph = with_saves(rng, graph)
    scored = score_all(graph)
    eager = simulate(graph, Schedule()).peak_bytes
    solved = solve_all(graph, eager, DPOptions(max_span=None, grid=max(1, eager)))
    assert solved.unit_bytes == 1
    least = solved.least_bytes()
    assert least is not None and least >= scored.least_bytes
    for budget in range(least, eager + 1, max(1, (eager - least) // 7)):
        schedule = solved.schedule(budget)
        sim = simulate(graph, schedule)
        assert sim.peak_bytes <= budget  # dp's price of it, at most budget, bounds simulate's
        assert sim.recompute_time_s >= scored.best(budget)[0] - 1e-9
