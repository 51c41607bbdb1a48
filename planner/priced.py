"""A model priced once, then solved and built as often as asked: what both forms share.

``planner.plan`` prices, solves and builds once. The command line (a budget given as a
percentage of the priced eager peak), ``planner.compare`` (every solver at every budget) and
``planner.fit_batch`` (the best plan per batch size) price once and solve many times. Each form
(``planner/graph_form.py``, ``planner/inplace_form.py``) prices into a subclass of
:class:`Priced`, which offers the same steps: ``solve``, ``build`` (the form's own), ``plan``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch

from planner.batch_sweep import BatchSweep
from planner.calibration import Calibration, CalibrationTimer, model_dtype
from planner.compiled import COMPILED_MARGIN, solve_compiled
from planner.devices import DeviceProfile
from planner.measurement import measured_step_time
from planner.passes.step import LossFn
from planner.plans import Plan, Predictions
from planner.solvers.costgraph import CostGraph, Objective, Schedule
from planner.solvers.errors import UnsupportedModelError
from planner.solvers.registry import get_solver, solve
from planner.solvers.simulate import Simulation, simulate

# Called with the name of each step as it starts ("capture", "estimate", "solve", "build"),
# e.g. to move a progress bar.
OnStep = Callable[[str], None]


def _no_progress(step: str) -> None:
    pass


def check_trainable(model: torch.nn.Module) -> None:
    """UnsupportedModelError for a model with no parameter to train."""
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModelError(
            f"no parameter of {type(model).__name__} requires grad, so a training step has "
            f"nothing to differentiate and nothing to checkpoint; unfreeze what you train "
            f"(param.requires_grad_(True)) before planning"
        )


def op_timer(
    model: torch.nn.Module,
    runs: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None,
    device: DeviceProfile | None,
    calibration: Calibration | str | Path | None,
    sweep: BatchSweep | None = None,
) -> CalibrationTimer | None:
    """What times a priced step's ops: on the model's own device (no ``device`` profile asked
    for, parameters not on the meta device), its calibration (``planner/calibration.py``, or
    ``calibration`` when given), whose step measurements run ``runs``, in ``fit_batch`` extending
    its ``sweep``; None elsewhere, where the roofline with the profile's rates is all there is."""
    on_device = any(p.device.type != "meta" for p in model.parameters())
    if device is not None or not on_device:
        return None
    return CalibrationTimer(
        model_dtype(model),
        calibration,
        step=lambda clock: measured_step_time(runs, example_input, loss_fn, clock=clock),
        sweep=sweep,
    )


def predictions(
    graph: CostGraph,
    schedule: Schedule,
    simulation: Simulation,
    budget_bytes: int,
    baseline_peak_bytes: int | None = None,
) -> dict[str, Any]:
    """The fields a plan of either form takes from its solve. ``baseline_peak_bytes``: the
    step's peak without checkpointing when known (``Priced.eager_peak_bytes``, simulated once
    per pricing); None simulates it."""
    if baseline_peak_bytes is None:
        baseline_peak_bytes = no_checkpoint_peak_bytes(graph)
    return dict(
        solver=schedule.solver,
        budget_bytes=budget_bytes,
        predictions=Predictions.of(graph, simulation, baseline_peak_bytes),
        notes=schedule.note,
        graph=graph,
        schedule=schedule,
        simulation=simulation,
    )


def no_checkpoint_peak_bytes(graph: CostGraph) -> int:
    """Predicted peak of one step of ``graph`` without checkpointing (what a plan's saving is
    measured against and a percentage budget is a share of)."""
    return simulate(graph, Schedule()).peak_bytes


class Priced:
    """Steps 3 and 4 over a priced step (``graph``): what every solve of it starts from.

    A form subclasses it with its ``build`` and, where it takes fewer solvers, its
    ``form_solvers`` and ``check_solver``.
    """

    form: ClassVar[str]
    graph: CostGraph
    # The solvers this form carries out; None: every registered one.
    form_solvers: ClassVar[tuple[str, ...] | None] = None

    @staticmethod
    def check_solver(solver: str) -> None:
        """Raise for a solver this form cannot carry out (the registry's own check by
        default: an unknown name)."""
        get_solver(solver)

    @cached_property
    def eager_peak_bytes(self) -> int:
        """Predicted peak of one step without checkpointing, simulated once per pricing."""
        return no_checkpoint_peak_bytes(self.graph)

    def solve(
        self,
        budget_bytes: int,
        solver: str = "auto",
        *,
        objective: Objective = "time",
        max_recompute_flops_fraction: float | None = None,
        compiled: bool = False,
        **solver_opts: Any,
    ) -> Schedule:
        """Step 3: the schedule ``solver`` chooses for ``budget_bytes``, minimising
        ``objective`` (``"time"`` or ``"flops"``, see ``graph_for_objective``), recomputing at
        most ``max_recompute_flops_fraction`` of the step's FLOPs if given (see
        ``planner.plan``); ``compiled``: flat and within the budget less the stated margin
        (``planner/compiled.py``).

        ``solver_opts`` go to the solver unchanged (its own options; unknown ones are its
        error to raise).
        """
        # An unknown name is the registry's error in the solve below, its one lookup; only a
        # name this form cannot carry out must be refused before the solver runs.
        if self.form_solvers is not None and solver not in self.form_solvers:
            self.check_solver(solver)
        if compiled:
            return solve_compiled(
                self.graph,
                budget_bytes,
                solver,
                objective,
                max_recompute_flops_fraction,
                solver_opts,
            )
        return solve(
            self.graph, budget_bytes, solver, objective, max_recompute_flops_fraction, **solver_opts
        )

    def build(self, schedule: Schedule, budget_bytes: int, *, solve_time_s: float = 0.0) -> Plan:
        """Step 4: the plan that carries ``schedule`` out, in this form."""
        raise NotImplementedError

    def plan(
        self,
        budget_bytes: int,
        solver: str = "auto",
        *,
        compiled: bool = False,
        on_step: OnStep = _no_progress,
        **solve_options: Any,
    ) -> Plan:
        """Steps 3 and 4: :meth:`solve` for ``budget_bytes`` with ``solver`` and build the plan.

        ``solve_options``: the rest of :meth:`solve`'s keywords (``objective``,
        ``max_recompute_flops_fraction``, the solver's own options), handed on unchanged;
        ``compiled`` also marks the built plan (:meth:`build_solved`)."""
        on_step("solve")
        t0 = time.perf_counter()
        schedule = self.solve(budget_bytes, solver, compiled=compiled, **solve_options)
        solve_time_s = time.perf_counter() - t0
        on_step("build")
        return self.build_solved(schedule, budget_bytes, solve_time_s, compiled)

    def build_solved(
        self, schedule: Schedule, budget_bytes: int, solve_time_s: float, compiled: bool
    ) -> Plan:
        """Step 4 after :meth:`solve`: :meth:`build`, with the margin a ``compiled`` solve
        planned within recorded on the plan (``planner/compiled.py``)."""
        built = self.build(schedule, budget_bytes, solve_time_s=solve_time_s)
        return replace(built, compiled_margin=COMPILED_MARGIN) if compiled else built
