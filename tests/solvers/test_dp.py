"""dp against brute force: the least recompute time within budget, on random chains and DAGs."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solvers import dp_search
from planner.solvers.costgraph import CostGraph, Node, Schedule, Tensor
from planner.solvers.dp_search import DPOptions, least_peak, solve_all, solve_dp
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import get_solver
from planner.solvers.simulate import simulate
from tests.solvers.brute import score_all
from tests.solvers.synthetic import GraphBuilder, gpt_like_graph, random_chain, random_dag


def _check_optimal(graph, budgets, max_depth=None):
    """dp's recompute time equals brute force's at each budget, and it is infeasible exactly
    when brute force is, naming the same least budget."""
    scored = score_all(graph, max_depth)
    for budget in budgets:
        want = scored.best(budget)
        try:
            got = solve_dp(graph, budget, max_span=None, max_depth=max_depth)
        except InfeasibleBudgetError as e:
            assert want is None, f"dp found nothing, brute force found {want[1].regions}"
            assert e.min_bytes == scored.least_bytes
            continue
        assert want is not None, got.regions
        sim = simulate(graph, got)
        assert sim.peak_bytes <= budget
        assert sim.recompute_time_s == pytest.approx(want[0], abs=1e-9), (got.regions, want[1])
        assert got.gap == 0.0


def _budgets(graph, rng):
    """Just below and at the least feasible budget, one between it and eager, and eager."""
    eager = simulate(graph, Schedule()).peak_bytes
    return [rng.randint(0, eager), eager]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4))
def test_dp_is_optimal_on_random_chains(seed, n):
    rng = random.Random(seed)
    graph = random_chain(rng, n)
    least = score_all(graph).least_bytes
    _check_optimal(graph, [least - 1, least, *_budgets(graph, rng)])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4))
def test_dp_is_optimal_on_random_dags(seed, n):
    rng = random.Random(seed)
    graph = random_dag(rng, n)
    least = score_all(graph).least_bytes
    _check_optimal(graph, [least - 1, least, *_budgets(graph, rng)])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(5, 7))
def test_dp_is_optimal_on_longer_chains_without_nesting(seed, n):
    rng = random.Random(seed)
    graph = random_chain(rng, n)
    _check_optimal(graph, _budgets(graph, rng) + [rng.randint(0, 200)], max_depth=1)


def test_dp_nests_when_nesting_is_what_fits():
    """A chain of equal layers where only nested regions reach the least budget."""
    g = GraphBuilder()
    prev = None
    for i in range(6):
        reads = (prev,) if prev else ()
        g.add(f"n{i}", reads=reads, saves=reads, out_bytes=10, fwd_flops=1)
        prev = f"n{i}"
    graph = g.build(outputs=(prev,), flops_per_s=1.0)
    eager = simulate(graph, Schedule()).peak_bytes
    flat = solve_all(graph, eager, DPOptions(max_span=None, max_depth=1))
    nested = solve_all(graph, eager, DPOptions(max_span=None))
    assert nested.least_bytes() < flat.least_bytes()
    s = nested.schedule(nested.least_bytes())
    assert max(r.depth for r in s.regions) >= 1
    assert simulate(graph, s).peak_bytes == nested.least_bytes()


def test_dp_reports_the_least_feasible_budget():
    graph = gpt_like_graph(n_layer=2, d_model=64, seq_len=64, batch=2, vocab=128)
    least = least_peak(graph, DPOptions(coarse_cuts=4))
    with pytest.raises(InfeasibleBudgetError) as e:
        solve_dp(graph, least * 0.9, coarse_cuts=4)
    assert e.value.min_bytes == least
    assert simulate(graph, solve_dp(graph, least, coarse_cuts=4)).peak_bytes <= least


def test_dp_beats_every_block_on_a_gpt_like_graph():
    graph = gpt_like_graph(n_layer=4, d_model=64, seq_len=128, batch=2, vocab=128)
    eager = simulate(graph, Schedule()).peak_bytes
    from planner.solvers.registry import get_solver

    block = simulate(graph, get_solver("uniform")(graph, eager))
    dp = simulate(graph, solve_dp(graph, block.peak_bytes))
    assert dp.peak_bytes <= block.peak_bytes
    assert dp.recompute_time_s < block.recompute_time_s
    half = simulate(graph, solve_dp(graph, eager / 2))
    assert half.peak_bytes <= eager / 2 and half.recompute_flops < block.recompute_flops


def test_dp_is_fast_on_a_long_uniform_chain(monkeypatch):
    searches = []

    class CountedWork(dp_search.Work):  # the work each search counts (states, frontier points)
        def __init__(self) -> None:
            super().__init__()
            searches.append(self)

    monkeypatch.setattr(dp_search, "Work", CountedWork)
    g = GraphBuilder()
    prev = None
    for i in range(1000):
        reads = (prev,) if prev else ()
        g.add(
            f"n{i}",
            reads=reads,
            saves=reads,
            out_bytes=1 << 20,
            fwd_flops=10**9,
            param_grad_bytes=1 << 16,
        )
        prev = f"n{i}"
    graph = g.build(outputs=(prev,))
    eager = simulate(graph, Schedule()).peak_bytes
    s = solve_dp(graph, eager / 4)
    assert simulate(graph, s).peak_bytes <= eager / 4
    assert s.solver == "dp" and "cut short" not in s.note, s.note
    # Counted, not timed: 718 states and 69,208 frontier points (0.4 s of CPU). The repeated
    # nodes share their states; a programme whose states grew with the intervals of the chain
    # (500,000 of them) would be far above.
    (work,) = searches
    assert work.states < 2_000 and work.cells < 200_000


def test_dp_plans_every_budget_above_the_least_it_states():
    """Feasibility is monotone: rounding to a budget's grid never refuses a budget above the
    least feasible one the error stated, nor one a hair above it."""
    graph = gpt_like_graph(n_layer=4, d_model=64, seq_len=128, batch=2, vocab=128)
    with pytest.raises(InfeasibleBudgetError) as e:
        solve_dp(graph, 1)
    least = e.value.min_bytes
    eager = simulate(graph, Schedule()).peak_bytes
    assert least < eager / 2
    budgets = [least, least + 1, least + 7] + [least + (eager - least) * k // 9 for k in range(10)]
    for budget in budgets:
        assert simulate(graph, solve_dp(graph, budget)).peak_bytes <= budget
    with pytest.raises(InfeasibleBudgetError):
        solve_dp(graph, least - 1)


def _matmul_chain(offload_bytes_per_s: float, overlap: float):
    """Six 1 MiB activations, each node a second of compute (1 FLOP/s)."""
    g = GraphBuilder()
    prev = None
    for i in range(6):
        reads = (prev,) if prev else ()
        g.add(f"n{i}", reads=reads, saves=reads, out_bytes=1 << 20, fwd_flops=1)
        prev = f"n{i}"
    return g.build(
        outputs=(prev,),
        flops_per_s=1.0,
        bytes_per_s=1e18,
        offload_bytes_per_s=offload_bytes_per_s,
        offload_overlap=overlap,
    )


@pytest.mark.parametrize(
    ("solver", "opts"),
    [
        ("dp", {}),
        # the MILP alone (dp's schedule is its warm start otherwise), on both backends
        ("ilp", {"warm": False, "backend": "highs"}),
        ("ilp", {"warm": False, "backend": "cbc"}),
    ],
)
@pytest.mark.parametrize(
    ("link_bytes_per_s", "overlap", "offloads"),
    [(1e9, 0.5, True), (1e9, 0.0, True), (1e4, 0.5, False), (1e4, 0.0, False)],
)
def test_dp_and_ilp_offload_when_the_transfer_is_cheaper_than_recomputing(
    solver, opts, link_bytes_per_s, overlap, offloads
):
    """A fast host link (1 GB/s: 1 ms per MiB, against a second to recompute a node) makes
    offload the cheaper way to fit the budget; a slow one (1e4 B/s: 105 s per MiB) does not,
    and the solver recomputes instead (at a budget that non-nested regions, ilp's, reach). By
    default it offloads only where the graph's device has a host link (never on a CPU's graph,
    even where offloading would be cheaper)."""
    solve = functools.partial(get_solver(solver), **opts)
    graph = _matmul_chain(link_bytes_per_s, overlap)
    eager = simulate(graph, Schedule()).peak_bytes
    budget = 0.7 * eager
    got = solve(graph, budget, offload=True)
    kinds = {r.kind for r in got.regions}
    sim = simulate(graph, got)
    assert sim.peak_bytes <= budget
    assert ("offload" in kinds) is offloads, got.regions
    assert (sim.recompute_time_s == 0) is offloads
    assert not graph.host_link
    plain = simulate(graph, solve(graph, budget))
    assert plain.offload_bytes == 0
    assert sim.step_time_s <= plain.step_time_s
    assert solve(replace(graph, host_link=True), budget).regions == got.regions


def test_a_peak_no_schedule_lowers_is_refused_with_the_eager_peak_as_least():
    # n0's parameter gradients (1 MB) peak at its backward whatever is recomputed, and on the
    # budget's grid (1 unit = 489 B) rounding up puts even the eager step above that peak:
    # dp's least-memory search found nothing there and raised a TypeError.
    nodes = tuple(
        Node(name=f"n{i}", inputs=(i - 1,) if i else (), param_grad_bytes=0 if i else 10**6)
        for i in range(3)
    )
    tensors = tuple(
        Tensor(f"t{i}", 1001, producer=i, users=(i + 1,), saved_by=(i + 1,), grad_bytes=1001)
        for i in range(2)
    ) + (Tensor("t2", 1001, producer=2, grad_bytes=1001, is_output=True),)
    graph = CostGraph(nodes=nodes, tensors=tensors)
    eager = simulate(graph, Schedule()).peak_bytes
    assert simulate(graph, Schedule()).peak_event == "bwd:n0"
    with pytest.raises(InfeasibleBudgetError) as info:
        solve_dp(graph, eager - 1)
    assert info.value.min_bytes == eager


def test_dp_solves_long_graphs_coarse_to_fine_and_keeps_the_best_level():
    """On a graph with more boundaries than FIRST_STAGES, dp solves 48 stages, then 192, ...
    (each a whole programme), and answers with the best level: never worse than the coarsest
    level alone, within budget, and its note names the stage space that answered."""
    from planner.solvers.dp_levels import FIRST_STAGES, stage_levels

    graph = random_chain(random.Random(3), 600)
    eager = simulate(graph, Schedule()).peak_bytes
    budget = 0.6 * eager
    assert stage_levels(graph, DPOptions()) == [FIRST_STAGES, 4 * FIRST_STAGES, 384]
    assert stage_levels(graph, DPOptions(max_bounds=FIRST_STAGES)) == [FIRST_STAGES]
    coarse = solve_dp(graph, budget, max_bounds=FIRST_STAGES, time_limit_s=600)
    refined = solve_dp(graph, budget, max_bounds=96, time_limit_s=600)  # 48, then 96
    assert coarse.solver == refined.solver == "dp"
    assert "stage cuts" in coarse.note and "stage cuts" in refined.note, refined.note
    sim_coarse, sim_refined = simulate(graph, coarse), simulate(graph, refined)
    assert sim_refined.peak_bytes <= budget
    assert sim_refined.step_time_s <= sim_coarse.step_time_s
    # the answer is a finer level's when refining paid (the chain's do)
    assert sim_refined.step_time_s < sim_coarse.step_time_s, (coarse.note, refined.note)


def test_auto_holding_a_schedule_skips_dp_coarsest_level_on_a_staged_graph(monkeypatch):
    """On a graph staged even at dp's finest level, auto (which already holds greedy's
    schedule, the early answer the coarsest level is for) starts dp at 192 stages; dp alone
    starts at 48. Both plans fit the budget, and auto's is no slower than dp alone's."""
    import planner.solvers.dp_levels as levels
    import planner.solvers.dp_search as dp

    graph = random_chain(random.Random(3), 600)
    budget = 0.6 * simulate(graph, Schedule()).peak_bytes
    solved: list[int | None] = []
    solve_level = dp._solve_within

    def recorded(graph, budget_bytes, options, *args, **kwargs):
        solved.append(options.max_bounds)
        return solve_level(graph, budget_bytes, options, *args, **kwargs)

    monkeypatch.setattr(dp, "_solve_within", recorded)
    alone = solve_dp(graph, budget, time_limit_s=600)
    assert solved[0] == dp.FIRST_STAGES, solved
    solved.clear()
    auto = get_solver("auto")(graph, budget, time_limit_s=600)
    assert auto.solver == "dp" and solved[0] == levels.LEVEL_GROWTH * levels.FIRST_STAGES, solved
    # a staged level's regions span stages: at most staged_span of them
    assert f"spans <= {levels.DEFAULT_STAGED_SPAN} boundaries" in auto.note, auto.note
    assert simulate(graph, auto).peak_bytes <= budget
    assert simulate(graph, auto).step_time_s <= simulate(graph, alone).step_time_s


def test_dp_does_not_start_a_level_predicted_to_overrun_the_time_limit(monkeypatch):
    """dp predicts a level's time from the last level's seconds per stage and does not start
    one that cannot finish in the time left (on a graph staged even at its finest level: in
    STAGED_REFINE_SHARE of the limit): it answers with the level it has, and says so. The
    seconds are the work counted (the search's ``Work``, nominal seconds), here faked at 10 ms per
    stage; the wall clock too, so the time limit itself is never reached."""
    import types

    import planner.solvers.dp as programme
    import planner.solvers.dp_levels as levels
    import planner.solvers.dp_search as dp
    import planner.solvers.registry as registry

    graph = random_chain(random.Random(3), 600)
    budget = 0.6 * simulate(graph, Schedule()).peak_bytes
    clock = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0], process_time=lambda: clock[0])
    monkeypatch.setattr(dp, "time", fake)
    monkeypatch.setattr(programme, "time", fake)
    monkeypatch.setattr(registry, "time", fake)  # SolverOptions.deadline: the one clock

    class FakeWork:
        states = cells = 0

        def nominal_s(self) -> float:
            return clock[0]

    monkeypatch.setattr(dp, "Work", FakeWork)
    solve_level = dp._solve_within

    def timed(graph, budget_bytes, options, *args, **kwargs):
        bounds = tuple(levels.region_bounds(graph))
        clock[0] += 0.01 * len(levels.stage_bounds(graph, bounds, options.max_bounds))
        return solve_level(graph, budget_bytes, options, *args, **kwargs)

    monkeypatch.setattr(dp, "_solve_within", timed)
    first = solve_dp(graph, budget, max_bounds=levels.FIRST_STAGES, time_limit_s=600)
    # 48 stages take about 0.5 s, so 192 would take about 2 s: 1.6 s - 0.5 s is too little
    short = solve_dp(graph, budget, time_limit_s=2.0)
    assert short.solver == "dp" and "refining to 192 stages not started" in short.note, short.note
    assert short.regions == first.regions
    assert simulate(graph, short).peak_bytes <= budget
    roomy = solve_dp(graph, budget, time_limit_s=10.0)  # 8 s of search: 192 runs
    assert "192 stages not started" not in roomy.note, roomy.note
    assert simulate(graph, roomy).step_time_s <= simulate(graph, first).step_time_s
    # 600 boundaries are staged even at 384: refining must end within a third of the limit
    # (1.7 s of 5 s), though the search's share (4 s) would have room for 192's 2 s
    staged = solve_dp(graph, budget, time_limit_s=5.0)
    assert "192 stages not started" in staged.note and "share" in staged.note, staged.note
    assert staged.regions == first.regions
    # unstaged (the finest level has every boundary), the whole search share is used
    whole = solve_dp(graph, budget, time_limit_s=5.0, max_bounds=None)
    assert "192 stages not started" not in whole.note, whole.note
    assert "refining to all 601 boundaries not started" in whole.note, whole.note


@pytest.mark.parametrize("spans", [False, True])
@pytest.mark.parametrize("fraction", [0.7, 0.9])
def test_a_pass_without_selective_regions_sharing_the_region_contexts_is_a_fresh_one(
    spans, fraction
):
    """dp's second pass (``without_selective``: selective regions off, the first pass's region
    contexts shared, the root's states solved again) holds the same values and picks the same
    schedule at every budget as a programme solved afresh with ``selective=False``: on an
    op-level graph and on one whose spans nest (module-granular, selective offered on every
    span), at caps where selective regions change the first pass's values."""
    from planner.solvers.cuts import block_spans
    from planner.solvers.dp_search import without_selective

    graph = gpt_like_graph(n_layer=2, d_model=32, seq_len=64, batch=2, vocab=64)
    if spans:  # each block, its halves, and the two blocks together
        blocks = block_spans(graph)
        halves = {(a, (a + b) // 2) for a, b in blocks} | {((a + b) // 2, b) for a, b in blocks}
        whole = (blocks[0][0], blocks[-1][1])
        graph = replace(graph, region_spans=frozenset({*blocks, *halves, whole}))
    cap = fraction * simulate(graph, Schedule()).peak_bytes
    options = DPOptions(grid=512)
    first = solve_all(graph, cap, options)
    shared = without_selective(first)
    fresh = solve_all(graph, cap, replace(options, selective=False))
    assert (first.root_value != fresh.root_value).any()  # selective regions matter here
    assert shared.root_value.tolist() == fresh.root_value.tolist()
    for m in range(len(fresh.root_value)):
        budget = m * fresh.unit_bytes
        assert shared.schedule(budget) == fresh.schedule(budget), budget


def test_a_second_budget_reads_the_first_budgets_programme_and_answers_as_a_fresh_solve(
    monkeypatch,
):
    """A programme is run up to the eager peak once per graph and space (``solved_once``): a
    solve at another budget runs no new state, and answers, note and all, exactly as a solve
    with nothing cached does; the levels it refines to are decided on the same counted work."""
    from planner.solvers import dp_search as dp

    graph = gpt_like_graph(n_layer=4, d_model=32, seq_len=64, batch=2, vocab=64)
    eager = simulate(graph, Schedule()).peak_bytes
    budgets = [round(f * eager) for f in (0.8, 0.5, 0.65)]
    fresh = []
    for budget in budgets:
        dp._SOLVED_CACHE.clear()
        fresh.append(solve_dp(graph, budget))
    dp._SOLVED_CACHE.clear()
    runs = []
    real_solve_all = dp.solve_all
    monkeypatch.setattr(
        dp, "solve_all", lambda *a, **k: runs.append(a[1]) or real_solve_all(*a, **k)
    )
    works: list = []  # each search's work counter
    real_work = dp.Work
    monkeypatch.setattr(dp, "Work", lambda: works.append(real_work()) or works[-1])

    def states() -> int:
        return sum(w.states for w in works)

    before = states()
    solve_dp(graph, budgets[0])
    first_states = states() - before
    ran = len(runs)
    assert ran and set(runs) == {eager}  # every level up to the eager peak, whatever the budget
    for budget, want in zip(budgets, fresh):  # each read off the run kept
        before = states()
        got = solve_dp(graph, budget)
        assert (got.regions, got.note, got.gap) == (want.regions, want.note, want.gap)
        assert simulate(graph, got).peak_bytes <= budget
        assert states() - before == first_states  # the cached work, counted again
    assert len(runs) == ran  # nothing ran again
    assert len({s.regions for s in fresh}) == 3  # three budgets, three different plans
