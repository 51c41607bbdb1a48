"""simulate's Rule 4: a region recomputes when backward first unpacks what it saved, at its last
saving node; the backward of the nodes after that one (a slice, a scale, a view: nothing saved)
runs first, with the gradients it allocates alive through the recomputation.

Measured on CPU (``tests/planner/test_budget_promise.py``): a block ``tanh(linear(x))[:, :64] * 2
+ 0`` checkpointed whole measured 3,303,560 B against 3,298,504 B predicted when simulate ran
the recomputation first. dp's and ilp's closed forms price the same order: dp equals brute force
under simulate on graphs with saves (``test_dp_exactness.py``, which failed on the old dp once
simulate knew Rule 4); ilp reaches brute force's least budget on the toy below (the old ilp,
pricing the recomputation at the gradients of the region's end, said it infeasible).
"""

from __future__ import annotations

import random
from dataclasses import replace

from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.ilp import solve_ilp
from planner.solvers.simulate import simulate
from tests.solvers.brute import assert_matches, score_all
from tests.solvers.synthetic import GraphBuilder


def _saving(graph: CostGraph, saving: set[str]) -> CostGraph:
    nodes = tuple(replace(nd, saves_for_backward=nd.name in saving) for nd in graph.nodes)
    return replace(graph, nodes=nodes)


def test_trailing_nodes_run_their_backward_before_the_recomputation():
    g = GraphBuilder()
    g.add("lin", out_bytes=100)  # saves a weight
    g.add("tanh", reads=("lin",), saves=("tanh",), out_bytes=100, fwd_temp_bytes=50)
    g.add("scale", reads=("tanh",), out_bytes=10)  # saves nothing; its grad: tanh's, 100 B
    g.add("head", reads=("scale",), saves=("scale",), out_bytes=10)
    graph = _saving(g.build(outputs=("head",)), {"lin", "tanh", "head"})
    sim = simulate(graph, Schedule((Region(0, 3),)))
    order = [e for e, _ in sim.timeline if not e.startswith("fwd:")]
    assert order == [
        "bwd:head",
        "bwd:scale",  # before the recomputation: nothing in it unpacks a saved tensor
        "recompute:lin",
        "recompute:tanh",
        "bwd:tanh",
        "bwd:lin",
    ]
    # recomputing tanh: lin's output 100 + tanh's 100 + its working set 50 + tanh's gradient
    # 100, which scale's backward made (head's output and scale's gradient are gone by then)
    assert sim.peak_bytes == 350 and sim.peak_event == "recompute:tanh"
    # every solver that reaches this schedule prices it so: brute force's least is ilp's
    assert_matches(solve_ilp, graph, score_all(graph, max_depth=1), random.Random(0))
