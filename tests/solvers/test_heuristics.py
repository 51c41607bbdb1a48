"""greedy, revolve, selective and auto on hand-built graphs: budgets met, structure as claimed."""

from __future__ import annotations

import pytest

from solvers.costgraph import Schedule
from solvers.errors import InfeasibleBudgetError
from solvers.registry import get_solver
from solvers.selective import out_bytes, worth_keeping
from solvers.simulate import simulate
from solvers.synthetic import gpt_like_graph

GPT = gpt_like_graph(n_layer=4, d_model=64, seq_len=128, batch=2, vocab=128)
EAGER = simulate(GPT, Schedule()).peak_bytes
SMALL = gpt_like_graph(n_layer=2, d_model=32, seq_len=64, batch=2, vocab=64)


@pytest.mark.parametrize("name", ["greedy", "revolve", "selective", "auto", "dp", "uniform"])
def test_every_solver_meets_the_budget_or_says_why(name):
    solve = get_solver(name)
    eager = simulate(SMALL, Schedule()).peak_bytes
    for frac in (1.0, 0.5, 0.15, 0.01):
        budget = frac * eager
        try:
            s = solve(SMALL, budget)
        except InfeasibleBudgetError as e:
            assert e.min_bytes > budget and e.budget_bytes == budget
            continue
        assert simulate(SMALL, s).peak_bytes <= budget


def test_greedy_spends_less_with_more_budget():
    loose = simulate(GPT, get_solver("greedy")(GPT, 0.6 * EAGER)).recompute_time_s
    tight = simulate(GPT, get_solver("greedy")(GPT, 0.4 * EAGER)).recompute_time_s
    assert loose < tight


def test_revolve_nests_to_reach_low_budgets():
    every_block = simulate(GPT, get_solver("uniform")(GPT, EAGER)).peak_bytes
    s = get_solver("revolve")(GPT, every_block)
    assert simulate(GPT, s).peak_bytes <= every_block
    deep = get_solver("revolve")(GPT, EAGER, k=2, depth=3)
    assert max(r.depth for r in deep.regions) == 2
    assert simulate(GPT, deep).peak_bytes < every_block


def test_selective_keeps_weight_matmuls_and_recomputes_attention_scores():
    produced = out_bytes(GPT)
    kept = {
        GPT.nodes[i].name.split(".")[-1]
        for i in range(len(GPT.nodes))
        if worth_keeping(GPT, i, produced)
    }
    assert kept == {"qkv", "av", "proj", "fc", "mlp_proj", "head"}
    s = get_solver("selective")(GPT, EAGER)
    assert all(r.kind == "selective" for r in s.regions) and len(s.regions) == 4
    sim = simulate(GPT, s)
    every_block = simulate(GPT, get_solver("uniform")(GPT, EAGER))
    assert sim.recompute_flops < every_block.recompute_flops / 4
    assert sim.peak_bytes < EAGER


def test_auto_is_no_worse_than_any_solver_it_tries():
    for frac in (0.6, 0.3):
        budget = frac * EAGER
        best = simulate(GPT, get_solver("auto")(GPT, budget)).recompute_time_s
        for name in ("selective", "uniform", "greedy", "dp"):
            try:
                other = simulate(GPT, get_solver(name)(GPT, budget)).recompute_time_s
            except InfeasibleBudgetError:
                continue
            assert best <= other + 1e-12
    assert get_solver("auto")(GPT, EAGER).regions == ()
