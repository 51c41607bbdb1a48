"""``plan()``: capture -> estimate -> solve -> rewrite, and the Plan it returns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from planner.passes.capture import capture
from planner.passes.estimate import estimate
from planner.passes.rewrite import Region, region_name, rewrite
from planner.passes.step import LossFn
from planner.plan_file import graph_fingerprint
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.errors import InvalidBudgetError, PlannerError, UnsupportedModelError
from planner.solvers.registry import get_solver
from planner.solvers.simulate import Simulation, simulate

if TYPE_CHECKING:
    from planner.inplace import InplacePlan

GB = 10**9  # mem_budget_gb counts decimal gigabytes, as its name says


@dataclass(frozen=True)
class Plan:
    """A checkpoint plan and the module that carries it out.

    ``module`` shares the model's parameters; train it in the model's place. Bytes are peak
    bytes of one forward+loss+backward step above the pre-step baseline (DESIGN.md).
    """

    module: torch.fx.GraphModule
    solver: str
    regions: tuple[Region, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    predicted_recompute_flops: int
    step_flops: int
    fingerprint: str  # of the captured graph, so a saved plan is only applied where it fits
    graph: CostGraph = field(repr=False)
    schedule: Schedule = field(repr=False)
    simulation: Simulation = field(repr=False)

    form = "graph"

    @property
    def predicted_recompute_time_s(self) -> float:
        return self.simulation.recompute_time_s

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        raise PlannerError(
            "a graph plan is carried out by p.module (a GraphModule), not on the model's own "
            "modules; plan with planner.plan(..., form='inplace') to apply a plan in place"
        )

    def summary(self) -> str:
        """A table of the regions and the predicted memory and recompute cost."""
        from planner.report import plan_summary

        return plan_summary(self)

    def save(self, path: str) -> None:
        """Write a versioned JSON that ``planner.apply_plan`` re-applies without solving."""
        from planner.plan_file import save_plan

        save_plan(self, path)


def budget_bytes_from_gb(mem_budget_gb: Any) -> int:
    """Validate a budget in decimal gigabytes and return it in bytes."""
    try:
        value = float(mem_budget_gb)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(mem_budget_gb, bool) or not math.isfinite(value) or value <= 0:
        raise InvalidBudgetError(
            f"mem_budget_gb must be a positive, finite number of gigabytes (10^9 bytes), got "
            f"{mem_budget_gb!r}; e.g. mem_budget_gb=1.5"
        )
    return round(value * GB)


def named_regions(gm: torch.fx.GraphModule, graph: CostGraph, schedule: Schedule) -> list[Region]:
    """Turn a solver's index intervals into named regions of fx node names."""
    taken: set[str] = set()
    regions = []
    for r in sorted(schedule.regions, key=lambda r: (r.start, -r.stop)):
        nodes = tuple(graph.nodes[i].name for i in range(r.start, r.stop))
        name = region_name(gm, nodes, taken)
        taken.add(name)
        saved = tuple(graph.nodes[i].name for i in sorted(r.saved_nodes))
        regions.append(Region(name, nodes, depth=r.depth, kind=r.kind, saved_nodes=saved))
    return regions


def build_plan(
    gm: torch.fx.GraphModule,
    graph: CostGraph,
    schedule: Schedule,
    budget_bytes: int,
    regions: list[Region] | None = None,
) -> Plan:
    """Rewrite ``gm`` by ``schedule`` and price it: the last step of ``plan`` and ``apply_plan``."""
    simulation = simulate(graph, schedule)
    regions = named_regions(gm, graph, schedule) if regions is None else regions
    return Plan(
        module=rewrite(gm, regions),
        solver=schedule.solver,
        regions=tuple(regions),
        budget_bytes=budget_bytes,
        predicted_peak_bytes=simulation.peak_bytes,
        baseline_peak_bytes=simulate(graph, Schedule()).peak_bytes,
        predicted_recompute_flops=simulation.recompute_flops,
        step_flops=graph.step_flops,
        fingerprint=graph_fingerprint(gm),
        graph=graph,
        schedule=schedule,
        simulation=simulation,
    )


def plan(
    model: torch.nn.Module,
    example_input: Any,
    mem_budget_gb: float,
    solver: str = "auto",
    *,
    loss_fn: LossFn | None = None,
    form: str = "graph",
    **solver_opts: Any,
) -> Plan | InplacePlan:
    """Plan activation checkpointing for ``model`` so one training step fits the budget.

    ``form="graph"``: a Plan whose ``module`` (a GraphModule) carries it out.
    ``form="inplace"``: an InplacePlan priced on what eager runs; ``p.apply(model)`` wraps the
    model's own modules (planner/inplace.py).

    ``example_input``: a tensor, a tuple of tensors, or a dict of keyword tensors.
    ``mem_budget_gb``: peak bytes of one forward+loss+backward step above the pre-step baseline
    (parameters and optimizer state), in decimal GB. Raises ``InfeasibleBudgetError`` (with the
    least feasible budget) when no schedule fits.
    """
    budget_bytes = budget_bytes_from_gb(mem_budget_gb)
    if form not in ("graph", "inplace"):
        raise ValueError(f"form must be 'graph' or 'inplace', got {form!r}")
    solve = get_solver(solver)  # fail on an unknown solver before the slow part
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModelError(
            f"no parameter of {type(model).__name__} requires grad, so a training step has "
            f"nothing to differentiate and nothing to checkpoint; unfreeze what you train "
            f"(param.requires_grad_(True)) before planner.plan()"
        )
    if form == "inplace":
        from planner.inplace import plan_inplace

        return plan_inplace(model, example_input, budget_bytes, solver, loss_fn, **solver_opts)
    captured = capture(model, example_input)
    graph = estimate(captured.module, captured.args, captured.kwargs, loss_fn=loss_fn)
    schedule = solve(graph, budget_bytes, **solver_opts)
    return build_plan(captured.module, graph, schedule, budget_bytes)
