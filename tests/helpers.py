"""Shared test helpers: one seeded training step and gradient comparison, and fakes of what
timing reads (a clock, a calibration)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from planner.passes.device_calibration import Calibration
from planner.passes.overhead_fits import CheckpointOverhead
from planner.passes.step import call, training_loss


def step(
    module: torch.nn.Module,
    example_input: Any,
    params: list[torch.nn.Parameter],
    seed=0,
    loss_fn=None,
):
    """Loss and parameter gradients of one seeded step (grads cleared first)."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    loss = training_loss(call(module, example_input, loss_fn), loss_fn, example_input)
    loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return loss.detach(), grads


def assert_same_step(model, module, example_input, seed: int = 0) -> None:
    """``module`` gives bitwise the loss and every parameter gradient ``model`` gives."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss_a, grads_a = step(model, example_input, params, seed)
    loss_b, grads_b = step(module, example_input, params, seed)
    assert torch.equal(loss_a, loss_b), (loss_a.item(), loss_b.item())
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, ga, gb in zip(names, grads_a, grads_b):
        assert (ga is None) == (gb is None), name
        if ga is not None:
            assert torch.equal(ga, gb), f"gradient of {name} differs: {(ga - gb).abs().max()}"


def assert_same_step_copy(reference, model, example_input, seed: int = 0, loss_fn=None) -> None:
    """``model`` (its own parameters, equal in value to ``reference``'s: a copy, or the same
    weights built again) gives bitwise the loss and every gradient ``reference`` gives."""
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    assert names == [n for n, p in model.named_parameters() if p.requires_grad]
    loss_a, grads_a = step(reference, example_input, _trained(reference), seed, loss_fn)
    loss_b, grads_b = step(model, example_input, _trained(model), seed, loss_fn)
    assert torch.equal(loss_a, loss_b), (loss_a.item(), loss_b.item())
    for name, ga, gb in zip(names, grads_a, grads_b):
        assert (ga is None) == (gb is None), name
        if ga is not None:
            assert torch.equal(ga, gb), f"gradient of {name} differs: {(ga - gb).abs().max()}"


def _trained(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def each_with(time_call: Any) -> Any:
    """A fake ``op_timing.time_each`` (every call timed in one batch) made of a fake
    ``time_call``, for tests that time calls by hand."""
    return lambda calls, device, repeats=5: [time_call(c, device, repeats) for c in calls]


def readings_in_pairs(spans: Iterable[float]) -> Callable[[], float]:
    """A fake counter read in pairs around each run (a clock, a page-fault count): the second
    reading of each pair is the first plus the next of ``spans``."""
    left = iter(spans)
    state = {"value": 0.0, "running": False}

    def read() -> float:
        if state["running"]:
            state["value"] += next(left)
        state["running"] = not state["running"]
        return state["value"]

    return read


def fake_calibration(
    op_times_s: Mapping[str, float | None], device: str = "cpu:test", **fields: Any
) -> Calibration:
    """A calibration of ``device`` with these call times, and no overheads but ``fields``'."""
    fields = {"call_overhead_s": 0.0, "checkpoint": CheckpointOverhead(), **fields}
    return Calibration(device, "", "", op_times_s=op_times_s, **fields)
