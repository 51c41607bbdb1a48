"""What both forms' targets share: a plan's summary and its file, through ``report`` and
``plan_file``.

A target is the form's own part of a plan (``graph_form.GraphTarget``,
``inplace_form.InplaceTarget``); ``Plan.summary``, ``Plan.save`` and ``Plan.apply`` ask it, so
that ``planner/plans.py`` imports neither the report nor the file format.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from planner.plan_file import save_plan
from planner.plans import Plan
from planner.report import plan_summary


class FormTarget:
    """Base of the two forms' targets (frozen dataclasses holding the form's own fields)."""

    form: ClassVar[str]

    def apply(self, plan: Plan, model: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        """The target's fields as JSON values, the form's part of the plan file."""
        raise NotImplementedError

    def summary(self, plan: Plan, verbose: bool) -> str:
        return plan_summary(plan, verbose=verbose)

    def save(self, plan: Plan, path: str | Path) -> None:
        save_plan(plan, path, self.to_json())
