"""Checkpoint overhead in the objective: dp and ilp minimise recomputation plus what each region
costs to run (CostGraph.checkpoint_overhead_s), as simulate prices a step."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.solvers.costgraph import CostGraph, Node, Region, Schedule, Tensor
from planner.solvers.cuts import forbidden_cuts
from planner.solvers.dp_search import solve_dp
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.ilp import solve_ilp
from planner.solvers.simulate import simulate
from tests.solvers.brute import families
from tests.solvers.synthetic import random_chain


def _with_overhead(graph: CostGraph, rng: random.Random) -> CostGraph:
    # Per region only: marking nodes as saving would also switch on simulate's early stop
    # (Rule 5), where dp is not exact yet (tests/solvers/test_dp_exactness.py).
    mean_s = graph.step_time_s / len(graph.nodes)
    return dataclasses.replace(graph, region_overhead_s=rng.uniform(0, 2) * mean_s)


def _extra_s(graph: CostGraph, schedule: Schedule) -> float:
    """What the schedule adds to the step: recomputation and its regions' overhead."""
    return simulate(graph, schedule).step_time_s - graph.step_time_s


def test_overhead_adds_per_region_per_saving_node_and_per_selective_call():
    graph = random_chain(random.Random(1), 4)
    nodes = tuple(
        dataclasses.replace(n, saves_for_backward=i != 1, fwd_calls=(1, 1, 3, 0)[i])
        for i, n in enumerate(graph.nodes)
    )
    graph = dataclasses.replace(
        graph,
        nodes=nodes,
        region_overhead_s=1.0,
        saving_node_overhead_s=0.25,
        selective_call_overhead_s=0.125,
    )
    assert graph.checkpoint_overhead_s(0, 3) == 1.0 + 2 * 0.25  # node 1 saves nothing
    # a selective policy sees each aten call: node 2 dispatches three, node 3 none
    assert graph.checkpoint_overhead_s(0, 3, "selective") == 1.0 + 2 * 0.25 + 5 * 0.125
    assert graph.checkpoint_overhead_s(3, 4, "selective") == 1.0 + 0.25
    # an offload region pays its own, per region and per storage it sends, none of checkpoint's
    assert graph.checkpoint_overhead_s(0, 3, "offload") == 0.0
    offloading = dataclasses.replace(
        graph, offload_region_overhead_s=2.0, offloaded_storage_overhead_s=0.5
    )
    sent = offloading.offloaded_storages(0, 3)
    assert sent > 0
    assert offloading.checkpoint_overhead_s(0, 3, "offload") == 2.0 + sent * 0.5
    assert offloading.checkpoint_overhead_s(0, 3) == 1.0 + 2 * 0.25
    regions = (Region(0, 2), Region(2, 4))
    sim = simulate(graph, Schedule(regions))
    assert sim.step_time_s == pytest.approx(
        graph.step_time_s + sim.recompute_time_s + (1.0 + 0.25) + (1.0 + 2 * 0.25)
    )


def test_an_offload_region_sends_each_storage_it_makes_and_saves_once():
    """Rule 7's storages, counted as the executor sends them (passes/offload.py): one node can
    save several (node 1 here saves two), several nodes can save one (counted once), and what a
    region's node saves from before the region, or what only a node after it saves, stays."""
    graph = CostGraph(
        nodes=tuple(Node(f"n{i}", saves_for_backward=True) for i in range(4)),
        tensors=(
            Tensor("a", 8, producer=0, saved_by=(1, 2)),
            Tensor("b", 8, producer=1, saved_by=(1,)),
            Tensor("c", 8, producer=1, saved_by=(2,)),
            Tensor("d", 8, producer=2, saved_by=(3,)),
            Tensor("e", 8, producer=3),
        ),
    )
    assert graph.offloaded_storages(0, 4) == 4  # a, b, c, d
    assert graph.offloaded_storages(1, 3) == 2  # b, c: a is made before, d saved after
    assert graph.offloaded_storages(1, 2) == 1  # b
    assert graph.offloaded_storages(3, 4) == 0


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 8))
def test_offloaded_storages_are_the_storages_rule_7_fetches(seed, n):
    graph = random_chain(random.Random(seed), n)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            fetched = {
                t.name
                for t in graph.tensors
                if start <= t.producer < stop and any(start <= s < stop for s in t.saved_by)
            }
            assert graph.offloaded_storages(start, stop) == len(fetched)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 5))
def test_dp_and_ilp_minimise_recomputation_plus_overhead(seed, n):
    rng = random.Random(seed)
    graph = _with_overhead(random_chain(rng, n), rng)
    forbidden = forbidden_cuts(graph)
    scored = []
    for family in families(0, n):
        if any(r.start in forbidden or r.stop in forbidden for r in family):
            continue
        schedule = Schedule(tuple(family))
        scored.append((_extra_s(graph, schedule), simulate(graph, schedule).peak_bytes))
    eager = simulate(graph, Schedule()).peak_bytes
    least = min(peak for _, peak in scored)
    for budget in (least, rng.randint(least, eager), eager):
        want = min(t for t, peak in scored if peak <= budget)
        got = solve_dp(graph, budget, max_span=None)
        assert simulate(graph, got).peak_bytes <= budget
        assert _extra_s(graph, got) == pytest.approx(want, abs=1e-9), got.regions
        try:
            by_ilp = solve_ilp(graph, budget)
        except InfeasibleBudgetError:
            continue  # ilp's candidate regions need not reach every budget brute force does
        assert _extra_s(graph, by_ilp) >= want - 1e-9
