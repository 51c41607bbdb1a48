"""planner: automatic activation checkpointing for PyTorch training.

p = planner.plan(model, example_input, mem_budget_gb=1.5)
print(p.summary())
loss = training_loss(p.module(*inputs))  # train p.module in the model's place
"""

from passes.rewrite import Region
from planner.comparison import Comparison, compare
from planner.measure import Measurement, measure
from planner.plan import Plan, plan
from planner.plan_file import apply_plan
from solvers.errors import (
    CaptureError,
    InfeasibleBudgetError,
    InvalidBudgetError,
    PlanFileError,
    PlannerError,
    UnsupportedModelError,
)

__all__ = [
    "CaptureError",
    "Comparison",
    "InfeasibleBudgetError",
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
]
