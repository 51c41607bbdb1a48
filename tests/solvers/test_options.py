"""Solver options: one frozen dataclass per solver, unknown keywords refused, auto passes on."""

from __future__ import annotations

import dataclasses

import pytest

from planner.solvers.auto import AutoOptions
from planner.solvers.costgraph import Schedule
from planner.solvers.dp_search import DPOptions, solve_dp
from planner.solvers.registry import SOLVERS, SolverOptions, get_solver, make_options
from planner.solvers.simulate import simulate
from tests.solvers.synthetic import gpt_like_graph, random_chain

GPT = gpt_like_graph(n_layer=4, d_model=64, seq_len=64, batch=2, vocab=128)
EAGER = simulate(GPT, Schedule()).peak_bytes


def test_a_misspelt_option_is_an_error_naming_the_valid_ones():
    with pytest.raises(ValueError, match="max_spam") as e:
        solve_dp(GPT, EAGER / 2, max_spam=1)
    for name in ("max_span", "coarse_cuts", "max_depth", "grid", "selective", "coarse_span"):
        assert name in str(e.value)
    with pytest.raises(ValueError, match="'k'.*valid options: time_limit_s"):
        get_solver("greedy")(GPT, EAGER, k=2)


def test_every_solver_has_frozen_options_with_a_time_limit():
    get_solver("none")
    for name, solve in SOLVERS.items():
        assert issubclass(solve.options, SolverOptions), name
        opts = solve.options()
        assert opts.time_limit_s > 0
        with pytest.raises(dataclasses.FrozenInstanceError):
            opts.time_limit_s = 1.0  # type: ignore[misc]


def test_options_as_a_dataclass_or_keywords_give_the_same_schedule():
    a = solve_dp(GPT, EAGER / 2, DPOptions(max_span=4, max_depth=1))
    b = solve_dp(GPT, EAGER / 2, max_span=4, max_depth=1)
    c = solve_dp(GPT, EAGER / 2, DPOptions(max_span=4), max_depth=1)
    assert a == b == c
    assert max(r.depth for r in a.regions) == 0
    with pytest.raises(TypeError, match="DPOptions"):
        solve_dp(GPT, EAGER / 2, AutoOptions())


def test_auto_passes_each_solver_its_own_options():
    opts = make_options(AutoOptions, {"time_limit_s": 30, "dp": {"max_depth": 1}})
    assert opts.dp == DPOptions(max_depth=1) and opts.time_limit_s == 30
    with pytest.raises(ValueError, match="'depth'.*for solver 'dp'"):
        make_options(AutoOptions, {"dp": {"depth": 1}})
    # dp limited to non-nested regions inside auto answers as dp alone does with that option
    budget = EAGER * 0.5
    flat = simulate(GPT, solve_dp(GPT, budget, max_depth=1, selective=False))
    auto = get_solver("auto")(GPT, budget, dp={"max_depth": 1, "selective": False})
    if auto.solver == "dp":
        assert max(r.depth for r in auto.regions) == 0
        assert simulate(GPT, auto).recompute_time_s == pytest.approx(flat.recompute_time_s)


def test_dp_returns_within_its_time_limit_and_says_so():
    """A 3,000-node random chain takes dp many seconds; with a 0.3 s limit it answers with a
    feasible schedule, and its note says what was cut short. (How long it takes is the
    solver benchmarks' to time; the levels' timing against the limit is checked on a fake
    clock in test_dp.)"""
    import random

    graph = random_chain(random.Random(0), 3000)
    eager = simulate(graph, Schedule()).peak_bytes
    s = solve_dp(graph, eager * 0.6, time_limit_s=0.3)
    assert simulate(graph, s).peak_bytes <= eager * 0.6
    assert "time limit (0.3 s)" in s.note, s.note


def test_auto_says_what_its_time_limit_cut_short():
    import random

    graph = random_chain(random.Random(1), 3000)
    eager = simulate(graph, Schedule()).peak_bytes
    s = get_solver("auto")(graph, eager * 0.6, time_limit_s=0.5)
    assert simulate(graph, s).peak_bytes <= eager * 0.6
    assert "cut short by the time limit (0.5 s)" in s.note, s.note
