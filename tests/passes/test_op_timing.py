"""Timing the graph's own ops on the device (passes/op_timing.py) and its use by estimate."""

from __future__ import annotations

import torch

from benchmarks.models import gpt_ref_small_example
from planner.passes.capture import capture
from planner.passes.estimate import estimate
from planner.passes.op_timing import call_overhead_s, checkpoint_overhead_s, op_call, time_calls


def test_identical_blocks_get_identical_measured_times():
    model, example = gpt_ref_small_example()
    c = capture(model, example)
    graph = estimate(c.module, c.args, c.kwargs, time_ops=True)
    assert graph.meta["timing"] == "measured ops"
    assert all(n.fwd_time_s is not None and n.bwd_time_s is not None for n in graph.nodes)
    assert all(n.fwd_time_s >= 0 and n.bwd_time_s >= 0 for n in graph.nodes)
    assert graph.step_time_s == sum(n.fwd_time_s + n.bwd_time_s for n in graph.nodes)

    def block(k: int) -> list[tuple]:
        inside = [n for n in graph.nodes if n.module_path.startswith(f"blocks.{k}")]
        return [(n.op, n.fwd_time_s, n.bwd_time_s) for n in inside]

    # Same ops on the same shapes: timed once, one price for both blocks.
    assert block(0) and block(0) == block(1)
    roofline = estimate(c.module, c.args, c.kwargs)
    assert roofline.meta["timing"] == "roofline"
    assert all(n.fwd_time_s is None for n in roofline.nodes)


def test_calls_are_timed_on_real_tensors_and_failures_left_to_the_roofline():
    a = torch.randn(64, 64)
    mm = op_call(torch.ops.aten.mm.default, (a, a), {})
    bad = op_call(torch.ops.aten.mm.default, (a, torch.randn(32, 32)), {})
    times = time_calls([mm, bad, mm], torch.device("cpu"))
    assert set(times) == {mm.key}  # the shape mismatch cannot run: not timed
    assert 0 < times[mm.key] < 1.0
    assert call_overhead_s(torch.device("cpu")) >= 0


def test_on_the_device_each_region_adds_its_measured_overhead_to_the_step():
    from planner.planning import price

    model, example = gpt_ref_small_example()
    priced = price(model, example)  # model on the CPU: its ops timed here
    graph = priced.graph
    assert graph.meta["timing"] == "measured ops"
    assert graph.region_overhead_s == checkpoint_overhead_s(torch.device("cpu")) > 0
    p = priced.plan(10**9, "uniform")
    assert p.regions
    assert p.predicted_step_time_s == (
        graph.step_time_s
        + p.predicted_recompute_time_s
        + len(p.schedule.regions) * graph.region_overhead_s
    )
