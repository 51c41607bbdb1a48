"""One time limit shared by several solves (``registry.SharedTimeLimit``): the capped
objective's solves together stay within the solver's one limit."""

from __future__ import annotations

import time

import pytest

from planner.solvers import registry
from planner.solvers.costgraph import Schedule
from planner.solvers.registry import MIN_SHARE_S, SharedTimeLimit, solve
from planner.solvers.simulate import simulate
from tests.solvers.test_objective import _chain_with_unrelated_times


def test_shares_split_what_is_left_and_only_solves_work_spends_it(monkeypatch):
    cpu_s, wall_s = [100.0], [100.0]  # this process's CPU time, the wall clock
    monkeypatch.setattr(time, "process_time", lambda: cpu_s[0])
    monkeypatch.setattr(time, "perf_counter", lambda: wall_s[0])
    limit = SharedTimeLimit(10.0)
    assert limit.share_s(4) == pytest.approx(2.5)
    cpu_s[0] += 0.05  # outside a solve: not charged
    assert limit.left_s == 10.0
    with limit.solving():
        wall_s[0] += 1000.0  # waiting (another job has the core): not charged either
        cpu_s[0] += 0.05  # the solve's own work is
    assert limit.left_s == pytest.approx(9.95)
    assert limit.share_s(1) == pytest.approx(limit.left_s)
    limit.left_s = -1.0  # past the limit, a solve still gets a moment to answer
    assert limit.share_s(3) == MIN_SHARE_S


def test_the_capped_objective_gives_its_solves_shares_of_one_limit(monkeypatch):
    graph = _chain_with_unrelated_times(0, 6)
    budget = simulate(graph, Schedule()).peak_bytes - 1
    limits: list[float] = []
    dp = registry.get_solver("dp")

    def spy(g, b, options=None, **opts):
        limits.append(opts["time_limit_s"])
        return dp(g, b, options, **opts)

    spy.options = dp.options
    monkeypatch.setitem(registry.SOLVERS, "dp", spy)
    schedule = solve(graph, budget, "dp", max_recompute_flops_fraction=0.1, time_limit_s=5.0)
    assert "sharing one time limit" in schedule.note
    assert len(limits) >= 2
    assert limits[0] == pytest.approx(5.0 / (2 + registry.CAP_SEARCH_STEPS), rel=0.01)
    # each solve may take at most an equal share of what is left of the one limit
    solves = 2 + registry.CAP_SEARCH_STEPS
    assert all(t <= 5.0 / (solves - k) + 1e-9 for k, t in enumerate(limits))


def test_compare_gives_a_searchs_share_of_the_searches_left(monkeypatch):
    """compare() shares one limit among its solves: a searching solver's (dp's, ilp's) share
    counts only the searches left, so the quick solvers' rows do not thin it (dp's first solve,
    which the later budgets read, got a twenty-fourth of the limit and was cut short)."""
    import torch

    from planner.comparison import compare

    limits: dict[tuple[str, float], float] = {}
    for name in ("uniform", "greedy", "dp", "ilp"):
        solver = registry.get_solver(name)

        def spy(g, b, options=None, _solver=solver, _name=name, **opts):
            limits[(_name, b)] = opts["time_limit_s"]
            return _solver(g, b, options, **opts)

        spy.options = solver.options
        monkeypatch.setitem(registry.SOLVERS, name, spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6))
    )
    x = torch.randn(32, 64)
    c = compare(
        model,
        x,
        solvers=["uniform", "greedy", "dp", "ilp"],
        budget_fractions=[0.7, 0.5],
        time_limit_s=40.0,
        form="graph",
        device="cpu",
    )
    first = c.rows[0].budget_bytes
    assert limits[("uniform", first)] == pytest.approx(40.0 / 8)  # every solve left
    # dp's first solve: a fourth (dp and ilp at two budgets), less what uniform and greedy used
    assert 40.0 / 4 - 0.5 < limits[("dp", first)] <= 40.0 / 4
    assert registry.get_solver("dp").options.searches
    assert not registry.get_solver("greedy").options.searches
