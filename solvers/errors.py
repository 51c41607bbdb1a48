"""Errors planner raises. Each says what went wrong and how to fix it.

They live here, beside the solvers (no torch), so every layer can raise them; ``planner``
re-exports them for users.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base class of every error planner raises on purpose."""


class InfeasibleBudgetError(PlannerError):
    """No schedule fits the budget. ``min_bytes`` is the least peak any schedule reaches (None:
    the solver was cut short before it knew)."""

    def __init__(self, budget_bytes: float, min_bytes: int | None, detail: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.min_bytes = min_bytes
        least = (
            "no solver finished in time to say what the least feasible budget is. Give "
            "time_limit_s more, raise mem_budget_gb,"
            if min_bytes is None
            else f"the least feasible budget is {size_text(min_bytes)}. Raise mem_budget_gb to "
            f"at least {min_bytes / 1e9!r},"
        )
        super().__init__(
            f"no checkpoint schedule fits a budget of {size_text(budget_bytes)}; {least} or "
            f"shrink the batch or sequence length." + (f" {detail}" if detail else "")
        )


def size_text(n_bytes: float) -> str:
    """A size in the largest binary unit it fills (bytes, KiB, MiB, GiB) to four significant
    digits, so that a budget and a minimum a few bytes apart read apart, and in decimal GB, the
    unit of ``mem_budget_gb``: ``2.263 MiB (0.00237 GB)``, ``520 bytes (5.2e-07 GB)``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.4g} {unit} ({n_bytes / 1e9:.3g} GB)"
    return f"{n_bytes:.0f} bytes ({n_bytes / 1e9:.3g} GB)"


class RecomputeCapError(PlannerError):
    """No schedule within the budget recomputes as few FLOPs as ``max_recompute_flops_fraction``
    allows (the message says the least any does)."""


class InvalidBudgetError(PlannerError, ValueError):
    """A budget that is not a positive finite number of gigabytes."""


class CaptureError(PlannerError):
    """The model could not be captured as a torch.fx graph."""


class UnsupportedModelError(PlannerError):
    """The model holds a pattern planner cannot checkpoint safely (the message names it)."""


class PlanFileError(PlannerError):
    """A saved plan that is malformed, from another version, or for another model."""


class CheckpointingConflictError(PlannerError):
    """Another activation checkpointing (Hugging Face's ``gradient_checkpointing_enable``) was
    turned on for a model that a planner plan already checkpoints (the message says which way
    to go)."""


class LossFallbackWarning(UserWarning):
    """Planning found no loss (no ``loss_fn``, no ``.loss`` in the output) and differentiates the
    sum of the model's floating outputs instead."""


class PricingTimeLimitError(PlannerError):
    """Tracing the model's step to price it ran past the plan's time limit."""

    def __init__(self, module_path: str | None) -> None:
        self.module_path = module_path
        where = (
            "outside any module" if module_path is None else f"in {module_path or 'the model'!r}"
        )
        super().__init__(
            f"pricing the step ran past the time limit, {where}: the model's forward or backward "
            f"does not finish on fake tensors. Pass a larger time_limit_s if it is only slow, "
            f"else please report the model (the module named here is where it was)."
        )
