"""Errors planner raises. Each says what went wrong and how to fix it.

They live here, beside the solvers (no torch), so every layer can raise them; ``planner``
re-exports them for users.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base class of every error planner raises on purpose."""


class InfeasibleBudgetError(PlannerError):
    """No schedule fits the budget. ``min_bytes`` is the least peak any schedule reaches."""

    def __init__(self, budget_bytes: float, min_bytes: int, detail: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.min_bytes = min_bytes
        super().__init__(
            f"no checkpoint schedule fits a budget of {budget_bytes / 2**20:.1f} MiB "
            f"({budget_bytes / 1e9:.3f} GB); the least feasible budget is "
            f"{min_bytes / 2**20:.1f} MiB ({min_bytes / 1e9:.3f} GB). Raise mem_budget_gb to at "
            f"least {min_bytes / 1e9!r}, or shrink the batch or sequence length."
            + (f" {detail}" if detail else "")
        )


class InvalidBudgetError(PlannerError, ValueError):
    """A budget that is not a positive finite number of gigabytes."""


class CaptureError(PlannerError):
    """The model could not be captured as a torch.fx graph."""


class UnsupportedModelError(PlannerError):
    """The model holds a pattern planner cannot checkpoint safely (the message names it)."""


class PlanFileError(PlannerError):
    """A saved plan that is malformed, from another version, or for another model."""
