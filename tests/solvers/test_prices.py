"""The closed-form prices dp and ilp read (``solvers/prices.py``) against ``simulate`` on the
random graphs the solver tests use: a recompute region's recomputation and backward
(``region_peak``, Rules 1, 2, 4 and 5), a selective one's (Rule 6: priced as recomputed to its
end, so never below simulate), and an offload region's bytes sent and step time (Rule 7)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.cuts import allowed_cuts
from planner.solvers.prices import (
    offload_fetch_bytes,
    offload_time_s,
    prices,
    region_peak,
    rule5_saves,
)
from planner.solvers.simulate import simulate
from tests.solvers.synthetic import (
    random_chain,
    random_dag,
    random_inplace_chain,
    with_quiet_nodes,
    with_saves,
)

GENERATORS = (random_chain, random_dag, random_inplace_chain)
SEEDS = range(120)


def _graph(seed: int) -> CostGraph:
    """A random graph of the solver tests, with save flags (Rule 5) on every other one and
    nodes that save nothing on every fifth."""
    rng = random.Random(seed)
    graph = GENERATORS[seed % 3](rng, rng.randint(2, 8))
    if seed % 2:
        graph = with_saves(rng, graph)
    if seed % 5 == 0:
        graph = with_quiet_nodes(rng, graph)
    return graph


def _priced_peak(graph: CostGraph, keep: frozenset[int]) -> int:
    """``region_peak`` of one region over the whole graph, called as dp calls it (its
    ``selective_parts``): no arguments, so no frame; stopped after the last save (Rule 5)."""
    n = len(graph.nodes)
    saves = rule5_saves(graph)
    if saves is None:  # recomputed to its end
        return region_peak(prices(graph), 0, n, keep)
    last = max((i for i in range(n) if saves[i]), default=-1)
    return region_peak(prices(graph), 0, n, keep, last, 0, last, None)


def _simulated_peak(graph: CostGraph, region: Region) -> int:
    """The peak of the events after the first forward: the region's recomputation and the
    backward (nothing outside a region over the whole graph is alive then)."""
    timeline = simulate(graph, Schedule((region,))).timeline
    return max((b for event, b in timeline if not event.startswith("fwd:")), default=0)


def _consistent(graph: CostGraph) -> bool:
    """No storage both saved by its producer and allocated after the producer's last save (a
    combination with_saves draws at random and no estimator makes): simulate then never
    allocates what the producer saved, which the closed form counts."""
    return not any(t.after_last_save and t.producer in t.saved_by for t in graph.tensors)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_recompute_regions_price_is_simulates(seed: int) -> None:
    graph = _graph(seed)
    got = _simulated_peak(graph, Region(0, len(graph.nodes), 0))
    priced = _priced_peak(graph, frozenset())
    if _consistent(graph):
        assert priced == got
    else:
        assert priced >= got  # on the safe side


@pytest.mark.parametrize("seed", SEEDS)
def test_a_selective_regions_price_never_undercounts_simulate(seed: int) -> None:
    graph = _graph(seed)
    n = len(graph.nodes)
    rng = random.Random(-seed)
    keep = frozenset(i for i in range(n) if rng.random() < 0.4)
    region = Region(0, n, 0, "selective", keep)
    assert _priced_peak(graph, keep) >= _simulated_peak(graph, region)


@pytest.mark.parametrize("seed", SEEDS[:40])
def test_an_offload_regions_bytes_and_time_are_simulates(seed: int) -> None:
    rng = random.Random(seed)
    graph = dataclasses.replace(
        _graph(seed), offload_bytes_per_s=rng.choice((1.0, 50.0)), offload_overlap=0.5
    )
    n = len(graph.nodes)
    ok = allowed_cuts(graph)  # in-place writes forbid some boundaries (Rule 10)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            if not (ok[start] and ok[stop]):
                continue
            region = Region(start, stop, 0, "offload")
            sim = simulate(graph, Schedule((region,)))
            sent = sum(offload_fetch_bytes(graph, start, stop).values())
            assert dict(sim.offloaded).get(region, 0) == sent
            assert sim.offload_time_s == pytest.approx(offload_time_s(graph, start, stop, sent))
