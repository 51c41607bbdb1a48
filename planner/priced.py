"""A model priced once in either form, then solved and built as often as asked.

``planner.plan`` prices, solves and builds once. The command line (a budget given as a
percentage of the priced eager peak), ``planner.compare`` (every solver at every budget) and
``planner.fit_batch`` (the best plan per batch size) price once and solve many times; they take
the priced model from :func:`price_form`, which offers the same steps for both forms:

- ``form="inplace"``: :class:`PricedInplace`, the model's eager step (``inplace.price_inplace``),
  plans carried out by ``p.apply(model)``;
- ``form="graph"``: ``planning.PricedModel``, the captured graph, plans carried out by
  ``p.module``.

Both check the same things before the slow part as ``planner.plan`` does, so every entry point
raises the same errors for the same options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planner import hf_checkpointing
from planner.calibration import Calibration
from planner.devices import DeviceProfile, device_profile
from planner.fsdp import FSDPConfig
from planner.inplace import InplacePlan, build_inplace_plan, check_span_solver, price_inplace
from planner.passes.eager import EagerGraph
from planner.passes.step import LossFn
from planner.planning import (
    FORMS,
    OnStep,
    PricedModel,
    _no_progress,
    check_trainable,
    price,
)
from planner.solvers.costgraph import CostGraph, Objective, Schedule, check_objective
from planner.solvers.registry import get_solver


@dataclass(frozen=True)
class PricedInplace:
    """A model's eager step priced once for in-place plans: what every solve of it starts from.

    The same steps as ``planning.PricedModel``: ``solve``, ``build``, ``plan``.
    """

    model: torch.nn.Module
    eager: EagerGraph
    example_input: Any = None  # the shape the applied plan guards (planner/guard.py)

    form = "inplace"

    @property
    def graph(self) -> CostGraph:
        return self.eager.graph

    # the same no-checkpoint peak and solve as the graph form's, over this form's own graph
    eager_peak_bytes = PricedModel.eager_peak_bytes

    def solve(self, budget_bytes: int, solver: str = "auto", **options: Any) -> Schedule:
        """``PricedModel.solve``, for the solvers whose regions are module calls only
        (``inplace.SPAN_SOLVERS``)."""
        check_span_solver(solver)
        return PricedModel.solve(self, budget_bytes, solver, **options)  # type: ignore[arg-type]

    def build(
        self, schedule: Schedule, budget_bytes: int, *, solve_time_s: float = 0.0
    ) -> InplacePlan:
        return build_inplace_plan(
            self.model,
            self.eager,
            schedule,
            budget_bytes,
            solve_time_s=solve_time_s,
            example_input=self.example_input,
        )

    # solve, then build: the same two steps as the graph form's, over this form's own
    plan = PricedModel.plan


def check_form_options(
    form: str,
    solvers: tuple[str, ...] | list[str] = ("auto",),
    *,
    objective: Objective = "time",
    device: str | DeviceProfile | None = None,
    fsdp: FSDPConfig | None = None,
) -> DeviceProfile | None:
    """The checks ``planner.plan`` makes before the slow part; returns the device profile."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    check_objective(objective)
    for name in solvers:
        check_span_solver(name) if form == "inplace" else get_solver(name)
    profile = None if device is None else device_profile(device)
    if fsdp is not None and not isinstance(fsdp, FSDPConfig):
        raise TypeError(f"fsdp must be a planner.FSDPConfig, got {type(fsdp).__name__}")
    if fsdp is not None and form != "inplace":
        raise ValueError(
            "fsdp plans are applied in place before fully_shard (torchtitan's order); plan "
            "in place (form='inplace', the default) with fsdp=..."
        )
    return profile


def price_form(
    model: torch.nn.Module,
    example_input: Any,
    form: str = "inplace",
    *,
    loss_fn: LossFn | None = None,
    device: str | DeviceProfile | None = None,
    fsdp: FSDPConfig | None = None,
    on_step: OnStep = _no_progress,
    calibration: Calibration | str | Path | None = None,
) -> PricedInplace | PricedModel:
    """Price one training step of ``model`` for plans of ``form`` (see ``planner.plan`` for
    ``device``, ``calibration`` and ``fsdp``, the latter in place only)."""
    profile = check_form_options(form, device=device, fsdp=fsdp)
    if form == "graph":
        with hf_checkpointing.paused(model):  # as planner.plan: captured as the plan runs
            return price(
                model,
                example_input,
                loss_fn=loss_fn,
                device=profile,
                on_step=on_step,
                calibration=calibration,
            )
    check_trainable(model)
    on_step("estimate")  # one pass over the eager step: nothing is captured first
    eager = price_inplace(
        model, example_input, loss_fn, device=profile, fsdp=fsdp, calibration=calibration
    )
    return PricedInplace(model, eager, example_input)
