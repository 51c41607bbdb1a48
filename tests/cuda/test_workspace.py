"""Kernel workspaces priced on CUDA (``cuda_timing.workspace_bytes``, ``costing.with_workspaces``).

cuDNN convolutions and some reductions allocate scratch through the caching allocator inside
their call, which the step's peak (``max_memory_allocated``) counts and a fake-tensor trace
never sees: on an H200 the residual CNN (benchmarks' conformance model, graph form) measured
62,972,928 B in eager against 58,736,640 predicted, and 33,622,528 against 27,325,952 with
four regions, each miss a transient inside one call. Timing the step's calls on the device
measures each call's workspace in the same runs, and the prices carry it: eager and planned
peaks within 1% of the prediction, planned ones within their budgets.

The bodies take the device, so they run on the CPU as well (every workspace 0 there)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import planner
from benchmarks.models import residual_cnn_example
from planner.passes.cuda_timing import workspace_bytes
from planner.passes.op_call import op_call
from planner.passes.op_timing import time_calls

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def residual_cnn(device: torch.device) -> tuple[torch.nn.Module, Any]:
    """benchmarks.gpu_check's conformance model: ResidualCNN at batch 16, 32 x 32 images."""
    model, x = residual_cnn_example(batch=16, size=32)
    return model.to(device), x.to(device)


def check_eager_predicted(device: torch.device) -> None:
    model, x = residual_cnn(device)
    measured = planner.measure(model, x).peak_bytes
    p = planner.plan(model, x, 2 * measured / 1e9, form="graph")
    assert not p.regions
    on_module = planner.measure(p.module, x).peak_bytes
    for what, peak in (("the model", measured), ("the GraphModule", on_module)):
        error = p.baseline_peak_bytes / peak - 1
        assert abs(error) <= 0.01, f"{what}: predicted {p.baseline_peak_bytes}, measured {peak}"
    if device.type == "cuda":
        assert "kernel workspaces" in p.graph.meta["timing"], p.graph.meta["timing"]


def check_planned_within_budget_and_predicted(device: torch.device, fraction: float) -> None:
    """Planned ``fraction`` of the way from the least feasible budget to the eager peak (as
    gpu_check's conformance sweep), carried out, measured."""
    model, x = residual_cnn(device)
    eager_bytes = planner.measure(model, x).peak_bytes
    with pytest.raises(planner.InfeasibleBudgetError) as refused:
        planner.plan(model, x, 1e-9, form="graph")
    least_bytes = refused.value.min_bytes + 1
    budget_bytes = round(least_bytes + fraction * (eager_bytes - least_bytes))
    p = planner.plan(model, x, budget_bytes / 1e9, form="graph")
    assert p.regions, "below the eager peak needs regions"
    measured = planner.measure(p.module, x).peak_bytes
    assert measured <= p.budget_bytes, (measured, p.budget_bytes)
    error = p.predicted_peak_bytes / measured - 1
    assert abs(error) <= 0.01, f"predicted {p.predicted_peak_bytes}, measured {measured}"


def test_a_pointwise_call_has_no_workspace_and_outputs_are_not_counted():
    """``add`` allocates its output and nothing else: 0, however large the output."""
    a = torch.randn(1024, 1024, device=CUDA)
    add = op_call(torch.ops.aten.add.Tensor, (a, a), {})
    assert time_calls([add], CUDA)
    assert workspace_bytes(add, CUDA) == 0


def test_residual_cnn_eager_peak_predicted_within_1_percent():
    check_eager_predicted(CUDA)


@pytest.mark.parametrize("fraction", [1 / 3, 2 / 3], ids=["third", "two-thirds"])
def test_residual_cnn_planned_peak_within_budget_and_1_percent(fraction):
    check_planned_within_budget_and_predicted(CUDA, fraction)
