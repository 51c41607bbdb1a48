"""simulate's Rule 2: a top-level region's checkpoint frame -- its arguments, its RNG stash --
lives to the backward of the region's first node that saves for backward, and only through its
forward when nothing in it saves (torch.utils.checkpoint's frame is referenced only by the
unpack hooks of what the region saved; measured in tests/planner/test_budget_promise.py).
dp and ilp price it as simulate does: against brute force on a graph where it decides the least
feasible budget, and on random graphs with nodes that save nothing."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solvers.costgraph import Region, Schedule
from planner.solvers.dp_search import DPOptions, solve_all, solve_dp
from planner.solvers.ilp import solve_ilp
from planner.solvers.simulate import simulate
from tests.solvers.brute import assert_matches, score_all
from tests.solvers.synthetic import (
    GraphBuilder,
    random_chain,
    random_dag,
    with_quiet_nodes,
)


def _graph():
    """n2 (a cat: 41 B out of n1's 8 B) saves nothing and its backward needs 89 B; n3 saves n2's
    output. In the region [2, 4) n1 is an argument, which its frame lets go at n3's backward,
    before n2's: the least feasible budget, 138 B with [0, 2) and [2, 4), counts n1 only
    while it is needed."""
    g = GraphBuilder()
    g.add("n0", saves=("n0",), out_bytes=14, fwd_flops=7, fwd_temp_bytes=5, param_grad_bytes=7)
    g.add("n1", reads=("n0",), saves=("n0",), out_bytes=8, fwd_flops=10)
    g.add("n2", reads=("n1",), out_bytes=41, fwd_flops=69, bwd_temp_bytes=89)
    g.add("n3", reads=("n2",), saves=("n2",), out_bytes=40, fwd_flops=30, bwd_temp_bytes=5)
    g.add("n4", reads=("n3",), saves=("n3", "n4"), out_bytes=26, fwd_flops=77)
    graph = g.build(outputs=("n4",), flops_per_s=1.0, bytes_per_s=1e9)
    saving = (True, True, False, True, True)
    return replace(
        graph,
        nodes=tuple(replace(nd, saves_for_backward=s) for nd, s in zip(graph.nodes, saving)),
    )


def test_a_frame_lets_its_arguments_go_at_its_first_saving_nodes_backward():
    graph = _graph()
    sim = simulate(graph, Schedule((Region(0, 2), Region(2, 4))))
    assert sim.peak_bytes == 138
    at = dict(sim.timeline)
    # n2's backward is the peak: the gradients of its output (41 B) and of n1 (8 B), and its
    # 89 B working set; [0, 2) keeps nothing (its own storages are recomputed), and n1 itself
    # (8 B more, as priced before) went with [2, 4)'s frame at n3's backward
    assert at["bwd:n2"] == 41 + 8 + 89 == sim.peak_bytes
    # a region whose nodes save nothing keeps no frame: [2, 3) is as if it were not there
    alone = simulate(graph, Schedule((Region(2, 3),)))
    assert alone.peak_bytes == simulate(graph, Schedule()).peak_bytes
    assert alone.recompute_flops == 0


def test_dp_and_ilp_reach_the_least_budget_the_frame_allows():
    graph = _graph()
    scored = score_all(graph, max_depth=1)
    assert scored.least_bytes == 138
    eager = simulate(graph, Schedule()).peak_bytes
    budgets = range(scored.least_bytes - 1, eager + 1)
    rng = random.Random(0)
    flat_dp = functools.partial(solve_dp, max_span=None, max_depth=1, grid=eager, selective=False)
    assert_matches(flat_dp, graph, scored, rng, budgets=budgets)
    assert_matches(
        functools.partial(solve_ilp, warm=False, rel_gap=0.0), graph, scored, rng, budgets=budgets
    )


@settings(max_examples=150, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 5), dag=st.booleans())
def test_dp_equals_brute_force_with_nodes_that_save_nothing(seed, n, dag):
    """Nested regions too: every laminar family, at every budget from the least to eager."""
    rng = random.Random(seed)
    graph = with_quiet_nodes(rng, (random_dag if dag else random_chain)(rng, n))
    scored = score_all(graph)
    eager = simulate(graph, Schedule()).peak_bytes
    solved = solve_all(graph, eager, DPOptions(max_span=None, grid=max(1, eager), selective=False))
    assert solved.least_bytes() == scored.least_bytes
    for budget in range(scored.least_bytes, eager + 1):
        schedule = solved.schedule(budget)
        sim = simulate(graph, schedule)
        assert sim.peak_bytes <= budget
        assert abs(sim.recompute_time_s - scored.best(budget)[0]) < 1e-9, (budget, schedule)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 6), dag=st.booleans())
def test_ilp_equals_brute_force_with_nodes_that_save_nothing(seed, n, dag):
    rng = random.Random(seed)
    graph = with_quiet_nodes(rng, (random_dag if dag else random_chain)(rng, n))
    solve = functools.partial(solve_ilp, warm=False, rel_gap=0.0)
    assert_matches(solve, graph, score_all(graph, max_depth=1), rng)
