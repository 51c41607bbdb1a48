"""The README's call on every model of the zoo: ``planner.plan(model, x, gb).apply(model)``, no
``form=``. The plan is in place by default and carries out what it promised: the same model
object, bitwise the loss and gradients of an untouched copy, and a measured peak equal to the
predicted one, within the budget (half the eager peak, or the least feasible budget where half
does not fit).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import planner
from tests import models_zoo as zoo
from tests.helpers import assert_same_step_copy


@dataclass(frozen=True)
class Applied:
    name: str
    model: torch.nn.Module  # the plan applied to it
    reference: torch.nn.Module  # an untouched copy taken before planning
    example_input: Any
    eager_bytes: int
    plan: planner.Plan
    returned: torch.nn.Module  # what p.apply(model) gave back


def plan_and_apply(name: str) -> Applied:
    model, example_input = zoo.MODELS[name]()
    reference = copy.deepcopy(model)
    eager_bytes = planner.measure(model, example_input).peak_bytes
    try:
        p = planner.plan(model, example_input, eager_bytes / 2 / 1e9)
    except planner.InfeasibleBudgetError as e:
        assert e.min_bytes > eager_bytes / 2
        # +0.5 B: GB * 1e9 truncates to whole bytes (test_models.py says why)
        p = planner.plan(model, example_input, (e.min_bytes + 0.5) / 1e9)
    return Applied(name, model, reference, example_input, eager_bytes, p, p.apply(model))


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=[pytest.mark.slow] if name in zoo.SLOW else [])
        for name in zoo.MODELS
    ],
)
def applied(request) -> Applied:
    return plan_and_apply(request.param)


def test_the_default_plan_is_in_place_and_applies_to_the_model_itself(applied):
    assert applied.plan.form == "inplace"
    assert applied.returned is applied.model  # the same object, its own class
    assert type(applied.model) is type(applied.reference)
    assert applied.plan.regions, "half the eager peak (or the least) needs checkpointing"
    # a region is one of the model's modules, a run of an nn.Sequential's children, or a span
    # of a module's own forward
    names = dict(applied.model.named_modules())
    assert all(r.place.path in names for r in applied.plan.regions)


def test_trains_bitwise_like_an_untouched_copy(applied):
    assert_same_step_copy(applied.reference, applied.model, applied.example_input)


def test_measured_peak_is_the_predicted_one_within_the_budget(applied):
    measured = planner.measure(applied.model, applied.example_input).peak_bytes
    p = applied.plan
    print(
        f"{applied.name}: solver {p.solver}, eager {applied.eager_bytes} B, budget "
        f"{p.budget_bytes} B, predicted {p.predicted_peak_bytes} B, measured {measured} B"
    )
    assert measured == p.predicted_peak_bytes <= p.budget_bytes
    assert measured < applied.eager_bytes
