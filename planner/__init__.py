"""planner: automatic activation checkpointing for PyTorch training.

p = planner.plan(model, example_input, mem_budget_gb=1.5)
print(p.summary())
loss = training_loss(p.module(*inputs))  # train p.module in the model's place

The names below load on first use, so ``import planner.solvers`` (pure algorithms) never
imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from planner.solvers.errors import (
    CaptureError,
    InfeasibleBudgetError,
    InvalidBudgetError,
    PlanFileError,
    PlannerError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from planner.comparison import Comparison, compare
    from planner.inplace import InplacePlan, remove
    from planner.measurement import Measurement, measure
    from planner.passes.rewrite import Region
    from planner.plan_file import apply_plan
    from planner.planning import Plan, plan

# public name -> module that defines it
_LAZY = {
    "Comparison": "planner.comparison",
    "compare": "planner.comparison",
    "Measurement": "planner.measurement",
    "measure": "planner.measurement",
    "Region": "planner.passes.rewrite",
    "Plan": "planner.planning",
    "plan": "planner.planning",
    "apply_plan": "planner.plan_file",
    "remove": "planner.inplace",
    "InplacePlan": "planner.inplace",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CaptureError",
    "Comparison",
    "InfeasibleBudgetError",
    "InplacePlan",
    "InvalidBudgetError",
    "Measurement",
    "Plan",
    "PlanFileError",
    "PlannerError",
    "Region",
    "UnsupportedModelError",
    "apply_plan",
    "compare",
    "measure",
    "plan",
    "remove",
]
