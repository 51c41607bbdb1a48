"""Hand-computed replays of a three-node chain (bytes 10, 20, 30).

n0 -> t0 (10 B) -> n1 -> t1 (20 B) -> n2 -> t2 (30 B, the output). Each node saves its input
for backward (t0 by n1, t1 by n2), every activation has a gradient of its own size.
"""

from dataclasses import replace

import pytest

from planner.solvers.costgraph import CostGraph, GradBuffer, Node, Region, Schedule, Tensor
from planner.solvers.simulate import gradient_bytes, simulate
from planner.solvers.validate import InvalidScheduleError

FLOPS = (1, 2, 4)


def chain(**extra) -> CostGraph:
    nodes = tuple(
        Node(name=f"n{i}", inputs=(i - 1,) if i else (), fwd_flops=FLOPS[i]) for i in range(3)
    )
    tensors = (
        Tensor("t0", 10, producer=0, users=(1,), saved_by=(1,), grad_bytes=10),
        Tensor("t1", 20, producer=1, users=(2,), saved_by=(2,), grad_bytes=20),
        Tensor("t2", 30, producer=2, grad_bytes=30, is_output=True),
    )
    return CostGraph(nodes=nodes, tensors=tensors, **extra)


def run(schedule_regions, graph=None):
    return simulate(graph or chain(), Schedule(tuple(schedule_regions)))


def test_no_checkpoint():
    sim = run([])
    # forward keeps t0, t1 (saved) and the output; the output dies when backward starts;
    # each backward adds its input's gradient and frees its own output's gradient and saves.
    assert sim.timeline == (
        ("fwd:n0", 10),
        ("fwd:n1", 30),
        ("fwd:n2", 60),
        ("bwd:n2", 50),
        ("bwd:n1", 40),
        ("bwd:n0", 10),
    )
    assert (sim.peak_bytes, sim.peak_event, sim.recompute_flops) == (60, "fwd:n2", 0)


def test_recompute_region():
    sim = run([Region(0, 2)])
    # t0 is saved only inside the region, so it dies after n1 in forward; the region's
    # recomputation rebuilds t0 and t1 (t1 is discarded at once) before n1's backward.
    assert sim.timeline == (
        ("fwd:n0", 10),
        ("fwd:n1", 30),
        ("fwd:n2", 50),
        ("bwd:n2", 40),
        ("recompute:n0", 30),
        ("recompute:n1", 50),
        ("bwd:n1", 40),
        ("bwd:n0", 10),
    )
    assert (sim.peak_bytes, sim.recompute_flops) == (50, FLOPS[0] + FLOPS[1])


def flagged_chain(state_bytes: tuple[int, ...] = (0, 0, 0)) -> CostGraph:
    """chain() as the estimator describes it: n1 and n2 save their inputs (so they save before
    they compute: their outputs come after their last save), n0 saves nothing."""
    g = chain()
    nodes = tuple(
        replace(nd, saves_for_backward=i > 0, state_bytes=state_bytes[i])
        for i, nd in enumerate(g.nodes)
    )
    tensors = tuple(replace(t, after_last_save=t.producer > 0) for t in g.tensors)
    return replace(g, nodes=nodes, tensors=tensors)


def test_recomputation_stops_at_the_last_save():
    sim = run([Region(0, 2)], flagged_chain())
    # Non-reentrant checkpoint stops once n1 has saved t0 again: t1 is never recomputed.
    assert sim.timeline == (
        ("fwd:n0", 10),
        ("fwd:n1", 30),
        ("fwd:n2", 50),
        ("bwd:n2", 40),
        ("recompute:n0", 30),
        ("recompute:n1", 30),
        ("bwd:n1", 40),
        ("bwd:n0", 10),
    )


def test_nodes_after_the_last_save_are_not_recomputed():
    g = flagged_chain()
    g = replace(g, nodes=(*g.nodes[:2], replace(g.nodes[2], saves_for_backward=False)))
    sim = run([Region(0, 3)], g)
    assert [e for e, _ in sim.timeline if e.startswith("recompute")] == [
        "recompute:n0",
        "recompute:n1",
    ]
    assert sim.recompute_flops == FLOPS[0] + FLOPS[1]


def test_without_save_flags_the_recomputation_runs_to_the_end():
    sim = run([Region(0, 3)])
    assert sim.recompute_flops == sum(FLOPS)


def test_a_region_copies_the_buffers_it_writes_for_its_recomputation():
    sim = run([Region(0, 2)], flagged_chain(state_bytes=(0, 4, 0)))
    # n1 writes 4 B of buffers (BatchNorm statistics): the region keeps a pre-step copy from
    # its forward for as long as its frame lives (Rules 9 and 2: to the backward of n1, its
    # first saving node; n0 saves nothing), and makes a fresh one while recomputing.
    assert sim.timeline == (
        ("fwd:n0", 14),
        ("fwd:n1", 34),
        ("fwd:n2", 54),
        ("bwd:n2", 44),
        ("recompute:n0", 38),
        ("recompute:n1", 38),
        ("bwd:n1", 44),
        ("bwd:n0", 10),
    )


def test_a_recomputation_copy_its_node_saves_lives_to_that_backward():
    g = flagged_chain(state_bytes=(0, 4, 0))
    g = replace(g, nodes=(g.nodes[0], replace(g.nodes[1], state_saved_bytes=4), g.nodes[2]))
    sim = run([Region(0, 2)], g)
    # Rule 9: n1 saves the copy it ran on (BatchNorm saves its running statistics), so the
    # recomputation's copy is still there through n1's backward, gone after it.
    assert sim.timeline == (
        ("fwd:n0", 14),
        ("fwd:n1", 34),
        ("fwd:n2", 54),
        ("bwd:n2", 44),
        ("recompute:n0", 38),
        ("recompute:n1", 38),
        ("bwd:n1", 48),
        ("bwd:n0", 10),  # the first forward's copy went with the frame, at n1's backward
    )


def drawing(graph: CostGraph, *random: int, stash: int = 4) -> CostGraph:
    """``graph`` with nodes ``random`` drawing random numbers and ``stash`` bytes of RNG
    state per checkpoint call that preserves it (Rule 12)."""
    nodes = tuple(replace(nd, draws_random=i in random) for i, nd in enumerate(graph.nodes))
    return replace(graph, nodes=nodes, region_state_bytes=stash)


def test_a_checkpoint_stashes_its_rng_state_until_its_backward_ends():
    # Rule 12: 4 B stashed as the region's forward starts and held by its frame (to n1's
    # backward, Rule 2), and one more copy (fork_rng's) while it recomputes: the same
    # lifetimes as the buffer copies.
    for random in (0, 1):  # a node of the region draws random numbers
        sim = run([Region(0, 2)], drawing(flagged_chain(), random))
        assert sim.timeline == run([Region(0, 2)], flagged_chain(state_bytes=(0, 4, 0))).timeline
    assert run([Region(0, 2, kind="offload")], drawing(chain(), 0)).peak_bytes == (
        run([Region(0, 2, kind="offload")]).peak_bytes
    )  # no checkpoint call, no stash


def test_a_checkpoint_over_no_random_node_stashes_nothing():
    # Rule 12: without preserve_rng_state nothing is stashed, nor copied while it recomputes;
    # a random node outside the region (n2) changes nothing.
    for graph in (flagged_chain(), chain()):
        plain = run([Region(0, 2)], graph).timeline
        assert run([Region(0, 2)], replace(graph, region_state_bytes=4)).timeline == plain
        assert run([Region(0, 2)], drawing(graph, 2)).timeline == plain
        assert run([Region(0, 2)], drawing(graph, 1)).timeline != plain


def test_a_parent_of_a_random_region_stashes_and_a_child_without_one_does_not():
    nested = [Region(0, 3, depth=0), Region(0, 2, depth=1)]
    # n1 draws inside the child, so inside the parent too: both stash, as when every node draws
    everywhere = run(nested, drawing(chain(), 0, 1, 2)).timeline
    assert run(nested, drawing(chain(), 1)).timeline == everywhere
    # n2 draws inside the parent only: the parent stashes (4 B from its forward to its
    # backward's end, its fork_rng copy while it recomputes); the child's calls nothing
    assert run(nested, drawing(chain(), 2)).timeline == (
        ("fwd:n0", 14),
        ("fwd:n1", 34),
        ("fwd:n2", 54),
        ("recompute:n0", 18),
        ("recompute:n1", 38),
        ("recompute:n2", 58),
        ("bwd:n2", 44),
        ("recompute:n0", 34),
        ("recompute:n1", 54),
        ("bwd:n1", 44),
        ("bwd:n0", 14),
    )


def test_nested_checkpoints_stash_again_when_their_parent_recomputes():
    sim = run([Region(0, 3, depth=0), Region(0, 2, depth=1)], drawing(chain(), 0))
    # The first forward stashes both (8 B, each to its own backward's end); the outer region's
    # recomputation adds its fork_rng copy and the inner call's new stash, both gone when it
    # ends; the inner region's recomputation adds its own fork_rng copy.
    assert sim.timeline == (
        ("fwd:n0", 18),
        ("fwd:n1", 38),
        ("fwd:n2", 58),
        ("recompute:n0", 26),
        ("recompute:n1", 46),
        ("recompute:n2", 66),
        ("bwd:n2", 48),
        ("recompute:n0", 42),
        ("recompute:n1", 62),
        ("bwd:n1", 48),
        ("bwd:n0", 18),
    )


def test_nested_regions():
    sim = run([Region(0, 3, depth=0), Region(0, 2, depth=1)])
    # Nothing survives the forward; backward recomputes the outer region (keeping the inner
    # one checkpointed), then the inner one again for n1's and n0's backward.
    assert sim.timeline == (
        ("fwd:n0", 10),
        ("fwd:n1", 30),
        ("fwd:n2", 50),
        ("recompute:n0", 10),
        ("recompute:n1", 30),
        ("recompute:n2", 50),
        ("bwd:n2", 40),
        ("recompute:n0", 30),
        ("recompute:n1", 50),
        ("bwd:n1", 40),
        ("bwd:n0", 10),
    )
    assert sim.peak_bytes == 50
    assert sim.recompute_flops == sum(FLOPS) + FLOPS[0] + FLOPS[1]


def test_argument_read_two_levels_down_lives_until_the_innermost_recomputation_ends():
    # n0 -> a (8 B), read by n1 and by n3 (a skip); n1 -> b (4 B, saved by n2); n2 -> c (2 B,
    # saved by n3); n3 -> d (1 B, the output). Regions [0, 4) > [1, 4) > [3, 4), Rule 5 on.
    # The outer recomputation runs n0 and stops saving [1, 4)'s argument a; that one's
    # recomputation runs n1, n2 and stops saving [3, 4)'s arguments, a among them again
    # (checkpoint.py's Rule 2, one level down): a lives through [3, 4)'s recomputation, the
    # peak (GPT-ref's qkv storage under a nest in the attention).
    nodes = tuple(
        Node(name=f"n{i}", inputs=ins, saves_for_backward=i >= 2)
        for i, ins in enumerate(((), (0,), (1,), (0, 2)))
    )
    tensors = (
        Tensor("a", 8, producer=0, users=(1, 3)),
        Tensor("b", 4, producer=1, users=(2,), saved_by=(2,)),
        Tensor("c", 2, producer=2, users=(3,), saved_by=(3,)),
        Tensor("d", 1, producer=3, is_output=True),
    )
    graph = CostGraph(nodes=nodes, tensors=tensors)
    sim = run([Region(0, 4, 0), Region(1, 4, 1), Region(3, 4, 2)], graph)
    assert sim.timeline == (
        ("fwd:n0", 8),
        ("fwd:n1", 12),
        ("fwd:n2", 14),
        ("fwd:n3", 11),
        ("recompute:n0", 8),
        ("recompute:n1", 12),
        ("recompute:n2", 14),
        ("recompute:n3", 15),  # a (8), b and c (saved), d
        ("bwd:n3", 6),
        ("bwd:n2", 4),
        ("bwd:n1", 0),
        ("bwd:n0", 0),
    )
    assert (sim.peak_bytes, sim.peak_event) == (15, "recompute:n3")


def test_selective_region_keeps_saved_nodes():
    sim = run([Region(0, 2, kind="selective", saved_nodes=frozenset({0}))])
    # t0 is cached (n0 is a saved node); only n1 reruns, taking t0 back from the cache (torch
    # pops the entry), and t0 then lives as n1's saved input: it dies after n1's backward,
    # not at the region's end.
    assert sim.timeline == (
        ("fwd:n0", 10),
        ("fwd:n1", 30),
        ("fwd:n2", 60),
        ("bwd:n2", 50),
        ("recompute:n1", 50),
        ("bwd:n1", 40),
        ("bwd:n0", 10),
    )
    assert (sim.peak_bytes, sim.recompute_flops) == (60, FLOPS[1])


def saving_chain() -> CostGraph:
    """``chain()`` whose nodes say they save (n1 saves t0, n2 saves t1): Rule 5 applies."""
    graph = chain()
    nodes = tuple(replace(nd, saves_for_backward=i > 0) for i, nd in enumerate(graph.nodes))
    return replace(graph, nodes=nodes)


def test_selective_saved_node_releases_what_it_reads():
    sim = run([Region(0, 2, kind="selective", saved_nodes=frozenset({1}))], saving_chain())
    # n1's output t1 stays cached until the region's backward ends (recomputation stops at
    # n1's save of t0, before n1's kernel, and never pops it), though n2's backward was its
    # last need. n1 does not rerun, so its read of t0 ends at once; t0 is rebuilt for n1's
    # backward and dies after it.
    assert sim.timeline == (
        ("fwd:n0", 10),
        ("fwd:n1", 30),
        ("fwd:n2", 50),
        ("bwd:n2", 40),
        ("recompute:n0", 50),
        ("bwd:n1", 60),
        ("bwd:n0", 30),
    )
    assert sim.recompute_flops == FLOPS[0]


def test_selective_cache_is_handed_back_when_the_recomputation_reaches_it():
    """Rule 5 and Rule 6 together. Without saves on the graph the recomputation runs to the
    region's end, so it reaches n1 and takes t1 back from the cache: t1 is gone by n1's
    backward (40 B there, where a cache kept to the region's end would make it 60 B)."""
    sim = run([Region(0, 2, kind="selective", saved_nodes=frozenset({1}))])
    assert dict(sim.timeline)["bwd:n1"] == 40


def test_offload_region_moves_saves_to_host():
    graph = chain(offload_bytes_per_s=5.0)
    sim = run([Region(0, 2, kind="offload")], graph)
    # t0 leaves the device after n1's forward and comes back for n1's backward.
    assert sim.timeline == (
        ("fwd:n0", 10),
        ("fwd:n1", 30),
        ("fwd:n2", 50),
        ("bwd:n2", 40),
        ("bwd:n1", 40),
        ("bwd:n0", 10),
    )
    assert (sim.peak_bytes, sim.recompute_flops, sim.offload_bytes) == (50, 0, 10)
    assert sim.offload_time_s == pytest.approx(2 * 10 / 5.0)


def test_offload_transfers_hide_behind_the_regions_compute_up_to_the_overlap():
    """Rule 7: up to ``offload_overlap`` of the region's forward compute hides the copy out; the
    copy back, made as each storage's backward needs it, is all added to the step (however long
    the backward)."""
    graph = chain(offload_bytes_per_s=5.0, flops_per_s=1.0)  # node i's forward: FLOPS[i] s
    fwd_s = FLOPS[0] + FLOPS[1]  # the region's forward; its backward is free (bwd_flops 0)
    each_way_s = 10 / 5.0
    for overlap in (0.0, 0.01, 0.5, 1.0):
        sim = run([Region(0, 2, kind="offload")], replace(graph, offload_overlap=overlap))
        exposed_s = max(0.0, each_way_s - overlap * fwd_s) + each_way_s
        assert sim.offload_time_s == pytest.approx(exposed_s)
        assert sim.step_time_s == pytest.approx(graph.step_time_s + exposed_s)
        assert sim.peak_bytes == 50  # overlap changes time, never memory


def test_observed_gradient_buffers_replace_per_storage_gradients():
    nodes = chain().nodes
    nodes = (nodes[0], Node(name="n1", inputs=(0,), fwd_flops=2, param_grad_bytes=5), nodes[2])
    graph = CostGraph(nodes=nodes, tensors=chain().tensors, grad_buffers=(GradBuffer(25, 2, 0),))
    assert gradient_bytes(graph) == ((0, 5, 25), (25, 0, 0))
    sim = run([], graph)
    assert sim.timeline[3:] == (("bwd:n2", 55), ("bwd:n1", 40), ("bwd:n0", 30))


def test_per_storage_gradient_positions():
    # t0's gradient appears at n1 (its last user) and dies at n0 (its producer).
    assert gradient_bytes(chain()) == ((0, 10, 20), (10, 20, 0))


def test_temporaries_add_to_their_event_only():
    g = chain()
    nodes = (
        g.nodes[0],
        Node(name="n1", inputs=(0,), fwd_temp_bytes=7, bwd_temp_bytes=100),
        g.nodes[2],
    )
    sim = run([], CostGraph(nodes=nodes, tensors=g.tensors))
    assert dict(sim.timeline)["fwd:n1"] == 37
    assert (sim.peak_bytes, sim.peak_event) == (140, "bwd:n1")
    assert sim.timeline[-1] == ("bwd:n0", 10)


@pytest.mark.parametrize(
    "regions",
    [
        [Region(0, 2), Region(1, 3)],  # overlap without nesting
        [Region(0, 4)],  # outside the graph
        [Region(1, 2), Region(1, 2)],  # twice
    ],
)
def test_invalid_schedules_rejected(regions):
    with pytest.raises(InvalidScheduleError):
        run(regions)


def test_recomputation_runs_to_a_node_that_saves_only_a_weight():
    """Issue 13's four-node graph. Selective region [a, b, c, d) keeps mm ``b``'s 1000 B output;
    ``d`` saves only its weight. torch.utils.checkpoint counts every pack, weights included
    (``recomp_counter == len(weak_holders)``, its Rule 5), so the recomputation runs to ``d``,
    reaches ``b`` and takes its output back from the cache: it lives while ``c`` reads it and
    is gone by the backward of ``c``. An earlier stop rule (at the last node whose *output* the
    backward reads) kept it to the region's end: 2040 B instead of 1040 B."""
    from tests.solvers.synthetic import GraphBuilder

    g = GraphBuilder()
    g.add("a", out_bytes=20, fwd_flops=1)
    g.add("b", reads=("a",), saves=("a",), out_bytes=1000, op="aten.mm.default", fwd_flops=1)
    g.add("c", reads=("b",), out_bytes=20, fwd_flops=1)
    g.add("d", reads=("c",), out_bytes=20, fwd_flops=1)  # saves only its weight
    graph = g.build(outputs=("d",))
    nodes = tuple(replace(nd, saves_for_backward=nd.name in "bd") for nd in graph.nodes)
    graph = replace(graph, nodes=nodes)
    sim = run([Region(0, 4, kind="selective", saved_nodes=frozenset({1}))], graph)
    events = dict(sim.timeline)
    assert events["recompute:c"] == 1040  # b's output handed back, read by c
    # gone by then: bwd:c holds b and c gradients (1000 + 20 B) and the recomputed a (20 B)
    assert events["bwd:c"] == 1040 and events["bwd:b"] == 1040
    assert sim.peak_bytes == 1040


def stopping_nest(region_state_bytes: int) -> CostGraph:
    """n0 -> t0 -> n1 -> t1 -> n2 -> t2 -> n3 -> t3 -> n4, and n4 reads t0 too (a residual).
    n2 and n3 save their inputs; n1 and n4 save nothing."""
    nodes = (
        Node("n0", ()),
        Node("n1", (0,)),
        Node("n2", (1,), saves_for_backward=True),
        Node("n3", (2,), saves_for_backward=True),
        Node("n4", (3, 0)),
    )
    tensors = (
        Tensor("t0", 10, producer=0, users=(1, 4), grad_bytes=10),
        Tensor("t1", 20, producer=1, users=(2,), saved_by=(2,), grad_bytes=20),
        Tensor("t2", 30, producer=2, users=(3,), saved_by=(3,), grad_bytes=30),
        Tensor("t3", 40, producer=3, users=(4,), grad_bytes=40),
        Tensor("t4", 50, producer=4, grad_bytes=50, is_output=True),
    )
    # n3 draws random numbers: both the outer region and the one nested over n3 stash (Rule 12)
    return drawing(CostGraph(nodes=nodes, tensors=tensors), 3, stash=region_state_bytes)


def test_a_recomputation_stopping_at_a_nested_region_holds_what_comes_after_and_its_stash():
    # Outer region [0, 5), n3 nested in it. n4 saves nothing, so its backward runs before
    # anything recomputes (Rule 4), leaving the gradients of t3 and t0 (50). n3's backward
    # then recomputes the nested region, whose argument t2 the outer recomputation gives: its
    # last save, so it stops there (Rule 5), before n3 and n4. t0 has a reader past the stop
    # (n4): it is still a variable of the interrupted forward and lives to the recomputation's
    # end (recompute:n2 holds 50 + t0 + t1 + t2 = 110, not 100). The nested call has stashed
    # its RNG state when it saves t2 (Rule 12): 4 B more at the stop ("recompute-stash:n3").
    schedule = [Region(0, 5), Region(3, 4, 1)]
    assert ("recompute:n2", 110) in run(schedule, stopping_nest(0)).timeline
    sim = run(schedule, stopping_nest(4))
    assert sim.timeline[5:10] == (
        ("bwd:n4", 50 + 8),  # the two first-forward stashes, the outer's and the nested one's
        ("recompute:n0", 50 + 22),  # t0, and three stashes: those two and fork_rng's
        ("recompute:n1", 50 + 42),  # + t1
        ("recompute:n2", 50 + 72),  # + t2
        ("recompute-stash:n3", 50 + 76),  # + the nested call's new stash, as it stops
    )
    # At the outer recomputation's end t0, fork_rng's copy and the new stash go; t1 (n2 saves
    # it), t2 (the nested region's argument, Rule 3) and the two first-forward stashes stay;
    # the nested recomputation adds t3 and its own fork_rng copy.
    assert sim.timeline[10] == ("recompute:n3", 50 + 20 + 30 + 8 + 40 + 4)


def test_a_nested_region_that_saves_nothing_keeps_no_arguments_past_its_parents_recomputation():
    # n3 saves nothing: its backward runs before the outer region recomputes (Rule 4), and the
    # region nested over it never recomputes. The outer recomputation stops as that nested
    # call saves its argument t2 (Rule 5); t2 then dies with the recomputation (Rule 3: nothing
    # keeps it for a recomputation that never comes). It was held to the end of the step.
    nodes = (
        Node("n0"),
        Node("n1", (0,), saves_for_backward=True),
        Node("n2", (1,), saves_for_backward=True),
        Node("n3", (2,)),
    )
    tensors = (
        Tensor("t0", 10, producer=0, users=(1,), saved_by=(1,), grad_bytes=10),
        Tensor("t1", 20, 1, users=(2,), saved_by=(2,), grad_bytes=20, after_last_save=True),
        Tensor("t2", 30, 2, users=(3,), grad_bytes=30, after_last_save=True),
        Tensor("t3", 40, 3, grad_bytes=40, is_output=True, after_last_save=True),
    )
    graph = CostGraph(nodes=nodes, tensors=tensors)
    nested = run([Region(0, 4), Region(3, 4, 1)], graph).timeline
    assert ("recompute:n2", 30 + 10 + 20 + 30) in nested  # t2 made: the stop is past n2
    flat = run([Region(0, 4)], graph).timeline
    assert [e for e in nested if e[0].startswith("bwd:")] == [
        e for e in flat if e[0].startswith("bwd:")
    ]
