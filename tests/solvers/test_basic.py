"""Registry, cut points and the fixed policies (none, uniform, sqrt) on hand-built graphs."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from planner.solvers.costgraph import Schedule
from planner.solvers.cuts import block_spans, crossing_bytes, cut_points, even_cuts, last_need
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import SOLVERS, get_solver
from planner.solvers.simulate import simulate
from tests.solvers.synthetic import GraphBuilder, gpt_like_graph, random_dag

GPT = gpt_like_graph(n_layer=4, d_model=64, seq_len=64, batch=2, vocab=128)


def test_unknown_solver_lists_the_known_ones():
    with pytest.raises(ValueError, match="uniform") as e:
        get_solver("nope")
    assert "'nope'" in str(e.value) and "sqrt" in str(e.value)
    assert {"none", "uniform", "sqrt"} <= set(SOLVERS)


def test_solvers_never_import_torch():
    code = (
        "import sys; from planner.solvers.registry import get_solver, SOLVERS; get_solver('none');"
        "import tests.solvers.synthetic; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_crossing_bytes_match_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        g = random_dag(rng, rng.randint(2, 15))
        fast = crossing_bytes(g)
        cuts = cut_points(g)
        for c in range(1, len(g.nodes)):
            want = sum(
                t.size_bytes
                for t_i, t in enumerate(g.tensors)
                if t.producer < c <= last_need(g, t_i)
            )
            assert fast[c] == want == cuts[c - 1].crossing_bytes


def test_block_spans_follow_repeated_modules_and_cheap_cuts():
    spans = block_spans(GPT)
    assert len(spans) == 4
    names = [GPT.nodes[a].name for a, _ in spans]
    assert names == [f"blocks.{j}.ln_1" for j in range(4)]
    assert spans[-1][1] == [n.name for n in GPT.nodes].index("ln_f")
    crossing = crossing_bytes(GPT)
    stream_bytes = 2 * 64 * 64 * 4
    assert all(crossing[a] == stream_bytes for a, _ in spans)


def test_block_spans_parse_bracketed_paths_and_need_repeats():
    g = GraphBuilder()
    g.add("a", out_bytes=4, module_path="layers[0].fc")
    g.add("b", reads=("a",), out_bytes=4, module_path="layers[1].fc")
    g.add("c", reads=("b",), out_bytes=4, module_path="head")
    assert block_spans(g.build()) == [(0, 1), (1, 2)]
    g2 = GraphBuilder()
    g2.add("a", out_bytes=4, module_path="layers.0")
    g2.add("b", reads=("a",), out_bytes=4, module_path="head")
    assert block_spans(g2.build()) == []


def test_even_cuts_snap_to_the_cheapest_cut():
    g = GraphBuilder()
    sizes = [8, 8, 8, 1, 8, 8, 8, 8]
    prev = None
    for i, s in enumerate(sizes):
        g.add(f"n{i}", reads=(prev,) if prev else (), saves=(prev,) if prev else (), out_bytes=s)
        prev = f"n{i}"
    graph = g.build()
    assert even_cuts(graph, 2) == [0, 4, 8]  # the 1-byte tensor of n3 is the seam


def test_none_is_the_eager_step_and_raises_below_it():
    eager = simulate(GPT, Schedule()).peak_bytes
    assert get_solver("none")(GPT, eager).regions == ()
    with pytest.raises(InfeasibleBudgetError) as e:
        get_solver("none")(GPT, eager - 1)
    assert e.value.min_bytes == eager


def test_uniform_checkpoints_every_block_or_every_k():
    eager = simulate(GPT, Schedule()).peak_bytes
    s = get_solver("uniform")(GPT, eager)
    assert [(r.start, r.stop) for r in s.regions] == block_spans(GPT)
    assert s.solver == "uniform"
    every_block = simulate(GPT, s)
    assert every_block.peak_bytes < eager / 2
    blocks_flops = sum(n.fwd_flops for n in GPT.nodes if n.module_path.startswith("blocks"))
    assert every_block.recompute_flops == blocks_flops
    assert len(get_solver("uniform")(GPT, eager, k=2).regions) == 2
    assert len(get_solver("uniform")(GPT, eager, n_segments=4).regions) == 4
    with pytest.raises(InfeasibleBudgetError) as e:
        get_solver("uniform")(GPT, every_block.peak_bytes - 1)
    assert e.value.min_bytes == every_block.peak_bytes


def test_sqrt_uses_about_sqrt_n_segments():
    g = gpt_like_graph(n_layer=9, seq_len=32, batch=1)
    s = get_solver("sqrt")(g, 1e18)
    assert len(s.regions) == 3 and all(r.depth == 0 for r in s.regions)
    rng = random.Random(1)
    chain = random_dag(rng, 16, skip_p=0.0)
    assert len(get_solver("sqrt")(chain, 1e18).regions) == 4
