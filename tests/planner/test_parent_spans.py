"""In-place regions over a parent module's own forward (passes/parent_spans.py): a span of its
traced graph, its own ops and child calls together, run on the user's own module."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from torch import nn

import planner
from benchmarks.models import residual_cnn_example
from planner.passes.regions import SpanPlace
from planner.planning import price_form
from tests.models_zoo import small_unet_example

pytestmark = pytest.mark.filterwarnings("ignore::planner.LossFallbackWarning")


def _least(model: nn.Module, x: torch.Tensor) -> int:
    with pytest.raises(planner.InfeasibleBudgetError) as e:
        planner.plan(model, x, 1e-9, "dp", device="cpu")
    return e.value.min_bytes


def _step(model: nn.Module, x: torch.Tensor) -> tuple[dict, dict]:
    torch.manual_seed(1)
    model(x).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return grads, {k: b.clone() for k, b in model.named_buffers()}


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _planned_at_least(model: nn.Module, x: torch.Tensor) -> tuple[planner.Plan, int]:
    eager = planner.measure(copy.deepcopy(model), x).peak_bytes
    least = _least(model, x)
    return planner.plan(model, x, least / 1e9, "dp", device="cpu"), eager


@pytest.fixture(scope="module")
def unet():
    model, x = small_unet_example()
    p, eager = _planned_at_least(model, x)
    assert any(isinstance(r.place, SpanPlace) for r in p.regions)  # spans of the root's own forward
    return model, x, p, eager


def test_the_small_unet_in_place_plans_near_half_of_eager(unet):
    model, x, p, eager = unet
    # 81.6% of eager before spans of the root's forward (its cats and max-pools between
    # the child calls) were regions; the graph form's dp reaches 53.5%
    assert p.predicted_peak_bytes < 0.53 * eager
    applied = copy.deepcopy(model)
    state = copy.deepcopy(model.state_dict())
    p.apply(applied)
    assert planner.measure(applied, x).peak_bytes == p.predicted_peak_bytes <= p.budget_bytes
    assert _bitwise(applied.state_dict(), state)  # measure restores the step's state


def test_spans_train_bitwise_as_the_model_and_come_off(unet):
    model, x, p, _ = unet
    plain, applied = copy.deepcopy(model), copy.deepcopy(model)
    p.apply(applied)
    assert "forward" in applied.__dict__
    grads, buffers = _step(plain, x)
    grads_applied, buffers_applied = _step(applied, x)
    assert _bitwise(grads, grads_applied)
    assert _bitwise(buffers, buffers_applied)  # BatchNorm statistics updated once
    assert int(buffers["stem.1.num_batches_tracked"]) == 1
    planner.remove(applied)
    assert not any("forward" in m.__dict__ for m in applied.modules())


def test_a_saved_plan_reapplies_its_spans(unet, tmp_path):
    model, x, p, _ = unet
    path = tmp_path / "unet.json"
    p.save(path)
    fresh, plain = copy.deepcopy(model), copy.deepcopy(model)
    planner.apply_plan(fresh, path)
    assert planner.applied_plan(fresh).regions == p.regions
    # the root runs its traced forward, as priced (its spans are regions)
    assert planner.applied_plan(fresh).traced_forwards == p.traced_forwards == ("",)
    assert _bitwise(_step(fresh, x)[0], _step(plain, x)[0])

    # a span naming a node the traced forward lacks: refused, naming it
    span = next(r for r in p.regions if isinstance(r.place, SpanPlace))
    bad_place = replace(span.place, last="no_such_node")
    bad = replace(span, name=bad_place.name, place=bad_place)
    edited = replace(p, regions=tuple(bad if r is span else r for r in p.regions))
    edited.save(path)
    with pytest.raises(planner.PlanFileError, match="no node 'no_such_node'"):
        planner.apply_plan(copy.deepcopy(model), path)
    assert json.loads(path.read_text())["version"] == 1
    # a module to run traced that the model lacks: refused, naming it
    replace(p, target=replace(p.target, traced_forwards=("nope",))).save(path)
    with pytest.raises(planner.PlanFileError, match="traced forward of module 'nope'"):
        planner.apply_plan(copy.deepcopy(model), path)


def test_a_residual_cnn_plans_its_blocks_own_ops_in_place():
    model, x = residual_cnn_example(batch=2, size=16, channels=8, n_blocks=2)
    p, eager = _planned_at_least(model, x)
    # the blocks' own adds and relus kept: least 71.9% of eager before spans, 63.1% with them
    assert p.predicted_peak_bytes < 0.7 * eager
    applied = copy.deepcopy(model)
    p.apply(applied)
    assert planner.measure(copy.deepcopy(applied), x).peak_bytes == p.predicted_peak_bytes
    plain_step, applied_step = _step(copy.deepcopy(model), x), _step(applied, x)
    assert _bitwise(plain_step[0], applied_step[0]) and _bitwise(plain_step[1], applied_step[1])


class _Branchy(nn.Module):
    """Its forward branches on a shape: fx cannot trace it, so it offers no spans."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if h.shape[0] > 2:
            h = h * 2
        return self.b(h)


def test_a_parent_fx_cannot_trace_offers_no_spans_and_says_why():
    torch.manual_seed(0)
    model, x = _Branchy(), torch.randn(4, 8)
    eg = price_form(model, x, "inplace", device="cpu").eager
    assert not any(isinstance(place, SpanPlace) for place in eg.places.values())
    assert "no spans of its own forward" in eg.refused["(..)"]
