"""plan.summary(): per-region bytes freed and recompute cost that add up to the printed totals.

The decomposition is checked on every laminar family of small random graphs (nested, selective
and offload regions) against ``simulate``'s totals, and end to end on a planned tiny GPT.
"""

from __future__ import annotations

import functools
import random
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import planner
from benchmarks.models import gpt_ref_small_example
from planner.passes.regions import SpanPlace
from planner.planning import price
from planner.plots import node_bytes
from planner.report import (
    format_bytes,
    format_flops,
    format_ms,
    module_paths,
    region_costs,
    shown_name,
)
from planner.solvers.costgraph import Region, Schedule
from planner.solvers.cuts import forbidden_cuts
from planner.solvers.simulate import simulate
from tests.solvers.brute import families
from tests.solvers.synthetic import gpt_like_graph, random_dag


def fake_plan(graph, regions):
    """What region_costs reads from a Plan: graph, schedule, simulation, named regions."""
    schedule = Schedule(regions=tuple(regions), solver="hand")
    spans = sorted(regions, key=lambda r: (r.start, -r.stop))
    named = [SimpleNamespace(name=f"r{k}", kind=r.kind) for k, r in enumerate(spans)]
    return SimpleNamespace(
        graph=graph, schedule=schedule, simulation=simulate(graph, schedule), regions=named
    )


def assert_adds_up(plan):
    costs = region_costs(plan)
    sim = plan.simulation
    assert sum(c.recompute_flops for c in costs) == sim.recompute_flops
    assert sum(c.recompute_time_s for c in costs) == pytest.approx(sim.recompute_time_s)
    # bytes: every dropped storage is charged to exactly one region, as the node plot shows
    per_node = node_bytes(plan.graph, list(plan.schedule.regions))
    assert sum(c.freed_bytes for c in costs) == sum(r + o for _, r, o in per_node)
    assert sum(c.offload_bytes for c in costs) == sim.offload_bytes
    assert sum(c.transfer_time_s for c in costs) == pytest.approx(sim.offload_time_s)
    return costs


@functools.cache
def nonempty_families(n: int) -> tuple[tuple[Region, ...], ...]:
    """Every non-empty laminar family over n nodes, in ``families`` order (25,216 at n = 6:
    listed once per n, not once per example)."""
    return tuple(tuple(f) for f in families(0, n) if f)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(3, 6))
def test_per_region_costs_add_up_to_simulates_totals(seed, n):
    rng = random.Random(seed)
    graph = random_dag(rng, n)
    forbidden = forbidden_cuts(graph)
    allowed = [
        f
        for f in nonempty_families(n)
        if not any(r.start in forbidden or r.stop in forbidden for r in f)
    ]
    if not allowed:
        return
    regions = []
    for r in rng.choice(allowed):
        kind = rng.choice(["recompute", "recompute", "selective", "offload"])
        if r.depth > 0 or any(o.depth > 0 and r.covers(o) for o in regions):
            kind = "recompute"  # nested regions as solvers make them: recompute inside
        saved = frozenset(i for i in range(r.start, r.stop) if rng.random() < 0.4)
        regions.append(
            Region(r.start, r.stop, r.depth, kind, saved if kind == "selective" else frozenset())
        )
    assert_adds_up(fake_plan(graph, regions))


def test_nested_regions_charge_each_recomputed_node_to_the_innermost_region():
    graph = gpt_like_graph(n_layer=2, d_model=32, n_head=2, seq_len=16, batch=2, vocab=64)
    block, inner = Region(2, 20), Region(4, 12, depth=1)
    costs = assert_adds_up(fake_plan(graph, [block, inner]))
    alone = region_costs(fake_plan(graph, [block]))[0]
    # the block's recomputation still runs the inner nodes once; the inner region's own
    # recomputation runs them again: both runs are the inner region's
    inner_nodes = sum(graph.nodes[i].fwd_flops for i in range(4, 12))
    assert costs[0].recompute_flops + costs[1].recompute_flops == (
        alone.recompute_flops + inner_nodes
    )
    assert costs[1].recompute_flops == 2 * inner_nodes
    # and the block frees what it froze alone: the inner region drops nothing the block keeps
    assert costs[0].freed_bytes + costs[1].freed_bytes == alone.freed_bytes
    assert costs[1].freed_bytes == 0


@pytest.fixture(scope="module")
def nested_plan():
    model, example_input = gpt_ref_small_example()
    priced = price(model, example_input)  # what planner.plan runs, captured and priced once
    p = priced.plan(round(0.65 * priced.eager_peak_bytes), solver="dp")
    assert any(r.depth > 0 for r in p.regions)  # the case where per-region sums could drift
    return p


def test_summary_rows_add_up_to_the_totals_it_prints(nested_plan):
    p = nested_plan
    costs = assert_adds_up(p)
    text = p.summary()
    unit = 1e9 if p.predicted_recompute_flops >= 1e9 else 1e6
    total = text.split("total", 1)[1].splitlines()[0]
    assert format_bytes(sum(c.freed_bytes for c in costs)) in total
    assert format_flops(p.predicted_recompute_flops, unit) in total
    assert format_ms(p.predicted_recompute_time_s) in total
    for region, cost in zip(p.regions, costs):
        row = next(line for line in text.splitlines() if f" {region.name} " in line)
        assert format_flops(cost.recompute_flops, unit) in row
        assert format_ms(cost.recompute_time_s) in row
        assert format_bytes(cost.freed_bytes) in row
    assert f"recompute {format_flops(p.predicted_recompute_flops, unit)}" in text
    # the step-time line names every part of the predicted step, each region's bookkeeping too
    bookkeeping_s = sum(p.graph.region_overhead_time_s(r) for r in p.schedule.regions)
    assert bookkeeping_s > 0  # measured on this machine (passes/op_timing.py)
    step_line = next(line for line in text.splitlines() if line.startswith("predicted step"))
    assert step_line.startswith(f"predicted step time {format_ms(p.predicted_step_time_s)}: ")
    assert f" + checkpoint bookkeeping {format_ms(bookkeeping_s)}" in step_line
    parts = re.findall(r"([\d.,]+) ms", step_line.split(": ", 1)[1])
    parts_ms = [float(x.replace(",", "")) for x in parts]  # each rounded to 0.01 ms
    step_ms = p.predicted_step_time_s * 1e3
    assert len(parts_ms) == 3 and sum(parts_ms) == pytest.approx(step_ms, abs=0.02)


def test_solver_internals_only_in_the_verbose_summary(nested_plan):
    p = nested_plan
    assert p.schedule.note  # dp says how it searched
    assert p.schedule.note not in p.summary()
    assert "boundaries" not in p.summary() and "rounded" not in p.summary()
    verbose = p.summary(verbose=True)
    assert p.schedule.note in verbose
    for word in ("MiB", "MFLOPs", "ms", "solver 'dp'"):
        assert word in p.summary()


def test_summary_says_what_each_offload_region_sends_and_why():
    """dp with offload on a device whose host link is far faster than its compute (so offload
    is the cheaper way to fit): the summary's rows and totals show the bytes sent to host and
    the exposed transfer time, and a line per offload region compares its transfer with
    recomputing it."""
    model, x = gpt_ref_small_example()
    fast_link = planner.DeviceProfile("fast-link", 1e12, 1e11, host_bytes_per_s=1e14)
    eager = planner.plan(
        model, x, 1e3, solver="none", device=fast_link, form="graph"
    ).baseline_peak_bytes
    p = planner.plan(
        model, x, 0.6 * eager / 1e9, solver="dp", device=fast_link, offload=True, form="graph"
    )
    costs = assert_adds_up(p)
    offloaded = [c for c in costs if c.kind == "offload"]
    assert offloaded, [r.kind for r in p.regions]
    text = p.summary()
    total = text.split("total", 1)[1].splitlines()[0]
    assert format_bytes(p.simulation.offload_bytes) in total
    assert format_ms(p.simulation.offload_time_s) in total
    for cost in offloaded:
        assert cost.offload_bytes > 0
        row = next(line for line in text.splitlines() if f" {cost.name} " in line)
        assert format_bytes(cost.offload_bytes) in row and format_ms(cost.transfer_time_s) in row
        why = f"{cost.name} offloaded {format_bytes(cost.offload_bytes)} to host: transfer "
        assert why + f"{format_ms(cost.transfer_time_s)} < recompute" in text
        assert cost.transfer_time_s < cost.recompute_instead_s


class LongPaths(torch.nn.Module):
    """Module paths as long as a Hugging Face model's: what the summary used to cut."""

    def __init__(self, d: int = 32, n_layer: int = 4) -> None:
        super().__init__()

        def mlp() -> torch.nn.Module:
            return torch.nn.Sequential(
                torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
            )

        self.encoder_stack = torch.nn.Module()
        self.encoder_stack.transformer_layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {"attention_projection_block": mlp(), "feed_forward_network_block": mlp()}
            )
            for _ in range(n_layer)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder_stack.transformer_layers:
            x = x + layer["attention_projection_block"](x)
            x = x + layer["feed_forward_network_block"](x)
        return x


@pytest.mark.parametrize("form", ["inplace", "graph"])
def test_summary_keeps_module_paths_whole(form):
    torch.manual_seed(0)
    model, x = LongPaths(), torch.randn(64, 32)
    eager = planner.plan(model, x, 1.0, solver="none", device="h100", form=form)
    p = planner.plan(model, x, 0.6 * eager.baseline_peak_bytes / 1e9, device="h100", form=form)
    spans = sorted(p.schedule.regions, key=lambda r: (r.start, -r.stop))
    paths = [path for span in spans for path in module_paths(p.graph, span)]
    assert len(paths) >= 2 and all(path.startswith("encoder_stack.") for path in paths)
    for verbose in (False, True):
        text = p.summary(verbose=verbose)
        assert "…" not in text
        # the shared prefix is said once; what follows it stays on one line, whole
        assert "module paths below leave out the prefix they share, 'encoder_stack.'" in text
        table = text.split("checkpoint regions", 1)[1]
        if form == "inplace":  # a module region covers itself: no column says so (a span
            # of a module's own forward covers its children: the column is there)
            assert ("covers" in table) == any(isinstance(r.place, SpanPlace) for r in p.regions)
        elif not verbose:  # the first three of each region, then "+N more"
            # (verbose: up to 200 columns, past which a path folds onto the next line)
            for path in [path for span in spans for path in module_paths(p.graph, span)[:3]]:
                assert path.removeprefix("encoder_stack.") in table, path
                assert path not in table
        for r in p.regions:  # in place a region's name is its module's path: shortened alike
            name = shown_name(r.place, "encoder_stack.") if form == "inplace" else r.name
            assert f" {'  ' * r.depth}{name} " in table
