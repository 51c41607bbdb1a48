"""The least feasible budget dp and auto state (issue 21) is one number: the same whatever the
budget asked, the objective and the time limit, and a solve at that budget (or above) plans.

Before: dp stated the peak of the least-memory schedule its own budget's search picked, sought
in what was left of its time limit; on these graphs the least moved with the objective (CHAIN:
29,955 B under "time", 30,019 B under "flops") and with the time limit (GPT: 2,441,344 B, then
2,773,568 B at that budget with time_limit_s=0.01, from revolve's fallback)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from planner.solvers import dp_search as dp
from planner.solvers.costgraph import Schedule, graph_for_objective
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import solve
from planner.solvers.simulate import simulate
from tests.solvers.synthetic import gpt_like_graph, random_chain

# A chain whose nodes' times are not their FLOPs (bytes_per_s low: some are memory-bound), so
# the two objectives rank the least-memory schedules differently.
CHAIN = replace(random_chain(random.Random(9), 40, max_bytes=10**4), bytes_per_s=200.0)
# A GPT-like graph with the CPU's RNG stash per checkpoint over a dropout (simulate's Rule 12,
# which dp prices approximately) and a grid coarser than a byte: dp's least-memory table ranks
# by its prices.
GPT = replace(
    gpt_like_graph(n_layer=2, d_model=64, seq_len=128, batch=2, vocab=128),
    region_state_bytes=5056,
)
GRAPHS = {"chain": CHAIN, "gpt": GPT}


def _least(solver: str, graph, budget: float, objective: str = "time", **opts) -> int | None:
    """The least budget ``solver`` states at ``budget`` (which it must refuse)."""
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(graph, budget, solver, objective, **opts)
    return info.value.min_bytes


def _fits(solver: str, graph, budget: float, objective: str = "time", **opts) -> int:
    """The peak by simulate of ``solver``'s plan at ``budget``, asserted within it."""
    peak_bytes = simulate(graph, solve(graph, budget, solver, objective, **opts)).peak_bytes
    assert peak_bytes <= budget
    return peak_bytes


@pytest.fixture(autouse=True)
def _no_cached_least():
    """Each test seeks the least-memory schedule itself (dp caches it per graph)."""
    dp._LEAST_CACHE.clear()
    yield
    dp._LEAST_CACHE.clear()


@pytest.mark.parametrize(("solver", "name"), [("dp", "chain"), ("dp", "gpt"), ("auto", "gpt")])
def test_the_least_is_the_same_at_any_budget_and_objective_and_is_planned(solver, name):
    graph = GRAPHS[name]
    least = _least(solver, graph, 1)
    eager = simulate(graph, Schedule()).peak_bytes
    assert least is not None and 0 < least < eager / 2
    assert _least(solver, graph, 1, "flops") == least
    assert _least(solver, graph, least // 2) == least
    assert _least(solver, graph, least // 2, "flops") == least
    for objective in ("time", "flops"):
        for budget in (least, least + 1):
            _fits(solver, graph, budget, objective)
    assert _least(solver, graph, 1) == least  # and again, once cached


@pytest.mark.parametrize("solver", ["dp", "auto"])
def test_a_time_limit_that_cuts_the_search_short_moves_no_least(solver):
    """With no time at all, dp's search stops at once and its fallbacks try one schedule
    each: the least it states and plans is still the least-memory schedule's, sought on its
    fixed space whatever the time limit."""
    quiet = _least(solver, GPT, 1)
    dp._LEAST_CACHE.clear()
    assert _least(solver, GPT, 1, time_limit_s=0.0) == quiet
    dp._LEAST_CACHE.clear()
    _fits(solver, GPT, quiet, time_limit_s=0.0)
    _fits(solver, GPT, quiet, "flops", time_limit_s=0.0)


def test_dp_answers_at_its_least_with_the_least_memory_schedule():
    """At the least it states, dp's own budget's grid may round its least-memory schedules
    over the budget; it then answers with the one whose peak it stated."""
    least = dp.least_memory(GPT)
    assert least.peak_bytes == simulate(GPT, least.schedule).peak_bytes
    s = solve(GPT, least.peak_bytes, "dp")
    assert simulate(GPT, s).peak_bytes <= least.peak_bytes
    # the same schedule whatever the objective's re-timing of the graph (memory unchanged)
    assert dp.least_memory(graph_for_objective(GPT, "flops")) == least


def test_the_least_memory_search_is_fixed_by_counted_work_not_by_time(monkeypatch):
    """Coarse to fine, the least-memory search refines while the next level's predicted work
    (counted, nominal) keeps it within LEAST_NOMINAL_S: on a graph with more boundaries than
    twice FIRST_STAGES, no budget for refining keeps it at the coarsest level, whose least is
    then stated and planned, and never below the finer level's."""
    graph = random_chain(random.Random(3), 110, max_bytes=10**4)
    fine = dp.least_memory(graph)
    monkeypatch.setattr(dp, "LEAST_NOMINAL_S", 0.0)
    dp._LEAST_CACHE.clear()
    coarse = dp.least_memory(graph)
    assert "stage cuts" in coarse.space and "stage cuts" not in fine.space
    assert coarse.peak_bytes >= fine.peak_bytes
    assert _least("dp", graph, 1) == coarse.peak_bytes
    _fits("dp", graph, coarse.peak_bytes)
