"""greedy, revolve, selective and auto on hand-built graphs: budgets met, structure as claimed."""

from __future__ import annotations

import pytest

from planner.solvers.costgraph import Schedule
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.op_classes import out_bytes, worth_keeping
from planner.solvers.registry import get_solver
from planner.solvers.revolve import beta, nested
from planner.solvers.simulate import simulate
from tests.solvers.synthetic import gpt_like_graph

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


def test_revolve_partitions_binomially():
    # beta(s, t) = C(s + t, s) = sum of beta(s - j, t - 1): six units, two snapshots, two sweeps
    assert [beta(s, t) for s, t in ((2, 2), (1, 3), (3, 1), (0, 5))] == [6, 4, 4, 1]
    for s in range(5):
        for t in range(1, 5):
            assert sum(beta(s - j, t - 1) for j in range(s + 1)) == beta(s, t)
    got = [(r.start, r.stop, r.depth) for r in nested(list(range(0, 70, 10)), 2, 2)]
    assert got == [
        (0, 30, 0),  # beta(2, 1) = 3 units, two snapshots left inside: one unit each
        (0, 10, 1),
        (10, 20, 1),
        (20, 30, 1),
        (30, 50, 0),  # beta(1, 1) = 2 units
        (30, 40, 1),
        (40, 50, 1),
        (50, 60, 0),  # beta(0, 1) = 1 unit
    ]


def test_revolve_trades_recomputation_for_memory_and_fits_budgets():
    every_block = simulate(GPT, get_solver("uniform")(GPT, EAGER))
    # Units are half blocks (attention, MLP). As many snapshots as units: one sweep, every
    # unit its own region.
    wide = get_solver("revolve")(GPT, EAGER, snapshots=8)
    assert len(wide.regions) == 8 and {r.depth for r in wide.regions} == {0}
    assert simulate(GPT, wide).recompute_flops == every_block.recompute_flops
    # One snapshot: beta(1, 7) = 8 units in seven sweeps, nested six deep.
    deep = get_solver("revolve")(GPT, EAGER, snapshots=1)
    assert max(r.depth for r in deep.regions) == 6
    deep_sim = simulate(GPT, deep)
    assert deep_sim.peak_bytes < every_block.peak_bytes
    assert deep_sim.recompute_flops > every_block.recompute_flops
    # Without a snapshot count it picks the cheapest that fits, down to the deepest's peak.
    for budget in (deep_sim.peak_bytes, every_block.peak_bytes, EAGER):
        s = get_solver("revolve")(GPT, budget)
        assert simulate(GPT, s).peak_bytes <= budget
    with pytest.raises(InfeasibleBudgetError):
        get_solver("revolve")(GPT, deep_sim.peak_bytes - 1)


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
