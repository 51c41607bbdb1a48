"""The Plan: one frozen type for plans of either form. The Region it lists, with its place in
the model, is ``passes/regions.py``'s (``planner.Region``; the rewrite pass takes it too).

A plan is data: the regions to checkpoint, what it predicts for one step, the budget, the
solver and its note, and its ``target``, the form's own part (``planner/graph_form.py``: the
GraphModule that carries it out; ``planner/inplace_form.py``: what applying it to the model's
own modules checks). What a plan does (``apply``, ``summary``, ``save``) its target does, so
this module imports nothing of the pipeline, and ``report``, ``plots`` and ``plan_file``, which
read plans, import nothing of the pipeline but this.

A new prediction is one more field of :class:`Predictions` (a unit at the end of its name:
``_bytes``, ``_flops``, ``_s``) and the line of :meth:`Predictions.of` that computes it from
the priced step and its simulation; the plan file and the summary read the fields as they find
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from planner.passes.regions import Region
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.simulate import Simulation

if TYPE_CHECKING:
    import torch

GB = 10**9  # mem_budget_gb counts decimal gigabytes, as its name says


def gb_to_bytes(gb: float) -> int:
    """Decimal gigabytes (10^9 bytes) in bytes, as every budget and device size is counted."""
    return round(float(gb) * GB)


@dataclass(frozen=True)
class Predictions:
    """What a plan predicts for one forward+loss+backward step, units in the names.

    Bytes are peaks above the pre-step baseline (DESIGN.md). Times are 0 in a plan read from a
    file saved before they were recorded.
    """

    peak_bytes: int
    baseline_peak_bytes: int  # the same step without checkpointing
    recompute_flops: int
    step_flops: int  # of one step without checkpointing (forward + backward)
    recompute_time_s: float = 0.0
    step_time_s: float = 0.0  # forward + backward + recompute (+ offload transfers)

    # the fields the summary and compare's table put in words of their own; any other is shown
    # by its name and unit (:meth:`others`)
    described: ClassVar[frozenset[str]] = frozenset(
        {
            "peak_bytes",
            "baseline_peak_bytes",
            "recompute_flops",
            "step_flops",
            "recompute_time_s",
            "step_time_s",
        }
    )

    @classmethod
    def of(cls, graph: CostGraph, simulation: Simulation, baseline_peak_bytes: int) -> Predictions:
        """What a plan of either form predicts: ``simulation`` of a schedule over the priced
        step ``graph``, whose peak without checkpointing is ``baseline_peak_bytes``."""
        return cls(
            peak_bytes=simulation.peak_bytes,
            baseline_peak_bytes=baseline_peak_bytes,
            recompute_flops=simulation.recompute_flops,
            step_flops=graph.step_flops,
            recompute_time_s=simulation.recompute_time_s,
            step_time_s=simulation.step_time_s,
        )

    def others(self) -> tuple[tuple[str, float], ...]:
        """(name, value) of every field not in ``described``, in declaration order."""
        return tuple(
            (f.name, getattr(self, f.name)) for f in fields(self) if f.name not in self.described
        )


class Target(Protocol):
    """A plan's form: what it adds to the plan, and what the plan's own methods ask of it."""

    form: ClassVar[str]

    def apply(self, plan: Plan, model: torch.nn.Module) -> torch.nn.Module: ...

    def summary(self, plan: Plan, verbose: bool) -> str: ...

    def save(self, plan: Plan, path: str | Path) -> None: ...


@dataclass(frozen=True)
class Plan:
    """A checkpoint plan, of either form (``form``: "inplace" or "graph").

    In place (the default of ``planner.plan``): ``p.apply(model)`` wraps the model's own
    region modules and the model trains as before. Graph: ``p.module`` (a GraphModule sharing
    the model's parameters) carries it out; train it in the model's place.

    ``graph``, ``schedule`` and ``simulation`` are the priced step, the solver's schedule and
    its simulation (None in an in-place plan read from a file). The target's own fields read
    through the plan: ``p.module`` and ``p.fingerprint`` (graph), ``p.model_class``,
    ``p.planned_shape``, ... (in place).
    """

    solver: str
    regions: tuple[Region, ...]
    budget_bytes: int
    predictions: Predictions
    target: Target
    notes: str = ""  # what the solver said of its schedule
    # plan(..., compiled=True): solved flat against budget_bytes * (1 - compiled_margin)
    # (planner/compiled.py); 0.0 for an eager plan and for a plan read from a file
    compiled_margin: float = field(default=0.0, repr=False)
    solve_time_s: float = field(default=0.0, repr=False)  # 0 for a plan read from a file
    graph: CostGraph | None = field(default=None, repr=False, compare=False)
    schedule: Schedule | None = field(default=None, repr=False, compare=False)
    simulation: Simulation | None = field(default=None, repr=False, compare=False)

    @property
    def form(self) -> str:
        return self.target.form

    def __getattr__(self, name: str) -> Any:
        # the target's fields (p.module, p.planned_shape, ...); never while being built
        if name.startswith("_") or name == "target":
            raise AttributeError(name)
        try:
            return getattr(self.target, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__} ({self.form} form) has no attribute {name!r}"
            ) from None

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Carry the plan out on ``model``'s own modules (in place); returns the same object.
        The model warns once (``planner.OverShapeWarning``) when called with a larger input
        than planned. A graph plan raises: train ``p.module`` instead."""
        return self.target.apply(self, model)

    def summary(self, verbose: bool = False) -> str:
        """The regions, what each frees and what its recomputation costs, and the totals.

        ``verbose`` adds what the solver reported (its note, optimality gap) and per-region
        node counts and kept nodes.
        """
        return self.target.summary(self, verbose)

    def save(self, path: str | Path) -> None:
        """Write a versioned JSON that ``planner.apply_plan`` re-applies without solving."""
        self.target.save(self, path)

    # the predictions under the names plans have always had
    @property
    def predicted_peak_bytes(self) -> int:
        return self.predictions.peak_bytes

    @property
    def baseline_peak_bytes(self) -> int:
        return self.predictions.baseline_peak_bytes

    @property
    def predicted_recompute_flops(self) -> int:
        return self.predictions.recompute_flops

    @property
    def step_flops(self) -> int:
        return self.predictions.step_flops

    @property
    def predicted_recompute_time_s(self) -> float:
        return self.predictions.recompute_time_s

    @property
    def predicted_step_time_s(self) -> float:
        """Forward + backward + recomputation (+ offload transfers) of one step, in seconds."""
        return self.predictions.step_time_s

    @property
    def module_regions(self) -> tuple[Region, ...]:
        """The regions (what in-place plans called their module regions)."""
        return self.regions


InplacePlan = Plan  # the name in-place plans had; one type now
