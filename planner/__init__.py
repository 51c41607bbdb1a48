"""planner: automatic activation checkpointing for PyTorch training.

p = planner.plan(model, example_input, mem_budget_gb=1.5)  # in place by default
print(p.summary())
p.apply(model)  # checkpoint the model's own modules; train ``model`` as before
# form="graph": p.module is a GraphModule with checkpoint regions, trained in the model's place

The names below load on first use, so ``import planner.solvers`` (pure algorithms) never
imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from planner.solvers.errors import (
    CaptureError,
    CheckpointingConflictError,
    InfeasibleBudgetError,
    InvalidBudgetError,
    LossFallbackWarning,
    PlanFileError,
    PlannerError,
    RecomputeCapError,
    UnsupportedModelError,
)

if TYPE_CHECKING:
    from planner.batch_search import BatchFit, fit_batch
    from planner.caches import clear_caches
    from planner.comparison import Comparison, compare
    from planner.device_budget import DeviceFit, device_fit, step_budget_gb
    from planner.devices import DeviceProfile
    from planner.fsdp import FSDPConfig
    from planner.guard import (
        OverShapeWarning,
        PlannedShape,
        PredictionExceededWarning,
        Verification,
        verify,
    )
    from planner.hf_checkpointing import applied_plan
    from planner.inplace import remove
    from planner.measurement import Measurement, measure
    from planner.passes.device_calibration import Calibration, CalibrationError
    from planner.planning import apply_plan, plan
    from planner.plans import InplacePlan, Plan, Region

# module -> the public names it defines, loaded on first use
_PUBLIC = {
    "planner.batch_search": ("BatchFit", "fit_batch"),
    "planner.caches": ("clear_caches",),
    "planner.passes.device_calibration": ("Calibration", "CalibrationError"),
    "planner.comparison": ("Comparison", "compare"),
    "planner.device_budget": ("DeviceFit", "device_fit", "step_budget_gb"),
    "planner.devices": ("DeviceProfile",),
    "planner.hf_checkpointing": ("applied_plan",),
    "planner.fsdp": ("FSDPConfig",),
    "planner.guard": (
        "OverShapeWarning",
        "PlannedShape",
        "PredictionExceededWarning",
        "Verification",
        "verify",
    ),
    "planner.inplace": ("remove",),
    "planner.measurement": ("Measurement", "measure"),
    "planner.planning": ("apply_plan", "plan"),
    "planner.plans": ("InplacePlan", "Plan", "Region"),
}
# public name -> (module that defines it, its name there)
_LAZY = {name: (module, name) for module, names in _PUBLIC.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


__all__ = [
    "BatchFit",
    "Calibration",
    "CalibrationError",
    "CaptureError",
    "CheckpointingConflictError",
    "Comparison",
    "DeviceFit",
    "DeviceProfile",
    "FSDPConfig",
    "InfeasibleBudgetError",
    "InplacePlan",
    "InvalidBudgetError",
    "LossFallbackWarning",
    "Measurement",
    "OverShapeWarning",
    "Plan",
    "PlanFileError",
    "PlannedShape",
    "PlannerError",
    "PredictionExceededWarning",
    "RecomputeCapError",
    "Region",
    "UnsupportedModelError",
    "applied_plan",
    "Verification",
    "apply_plan",
    "clear_caches",
    "compare",
    "device_fit",
    "fit_batch",
    "measure",
    "plan",
    "remove",
    "step_budget_gb",
    "verify",
]
