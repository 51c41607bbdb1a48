"""The pipeline: capture -> estimate -> solve -> build, and the Plan it returns.

Every way in goes through here, so every way in makes the same checks and raises the same errors:

- ``plan()`` runs the four steps for one budget;
- ``apply_plan()`` runs capture and estimate, takes the schedule from a saved file instead of a
  solver, and builds;
- the command line, ``planner.compare`` and ``planner.fit_batch`` price once in either form
  (``planner/priced.py``: :func:`price` here for the graph form), then solve and build per
  budget, solver or batch size with the same options ``plan()`` takes.

Import order is one way: this module uses ``plan_file`` (the file format) and ``report`` (the
text), which never import it back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from planner import hf_checkpointing
from planner.calibration import Calibration, CalibrationTimer, model_dtype
from planner.compiled import COMPILED_MARGIN, solve_compiled
from planner.devices import DeviceProfile, device_profile
from planner.fsdp import FSDPConfig
from planner.inplace import (
    InplacePlan,
    apply_plan_file,
    build_inplace_plan,
    check_span_solver,
    predictions,
    price_inplace,
)
from planner.measurement import measured_step_time
from planner.passes.capture import capture
from planner.passes.estimate import estimate
from planner.passes.rewrite import NamedRegion, node_interval, region_name, rewrite
from planner.passes.step import LossFn, join_input, model_input, takes_batch
from planner.plan_file import graph_fingerprint, load_plan_file, save_plan
from planner.report import plan_summary
from planner.solvers.costgraph import (
    CostGraph,
    Objective,
    Region,
    Schedule,
    check_objective,
)
from planner.solvers.errors import (
    InvalidBudgetError,
    PlanFileError,
    PlannerError,
    UnsupportedModelError,
)
from planner.solvers.registry import get_solver, solve
from planner.solvers.simulate import Simulation, simulate

GB = 10**9  # mem_budget_gb counts decimal gigabytes, as its name says
FORMS = ("graph", "inplace")

# Called with the name of each step as it starts ("capture", "estimate", "solve", "build"),
# e.g. to move a progress bar.
OnStep = Callable[[str], None]


def _no_progress(step: str) -> None:
    pass


@dataclass(frozen=True)
class Plan:
    """A checkpoint plan and the module that carries it out.

    ``module`` shares the model's parameters; train it in the model's place. Bytes are peak
    bytes of one forward+loss+backward step above the pre-step baseline (DESIGN.md).
    """

    module: torch.fx.GraphModule
    solver: str
    regions: tuple[NamedRegion, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    predicted_recompute_flops: int
    step_flops: int
    fingerprint: str  # of the captured graph, so a saved plan is only applied where it fits
    graph: CostGraph = field(repr=False)
    schedule: Schedule = field(repr=False)
    simulation: Simulation = field(repr=False)
    solve_time_s: float = 0.0  # the solver's wall time (0 for a plan applied from a file)

    form = "graph"

    @property
    def predicted_recompute_time_s(self) -> float:
        return self.simulation.recompute_time_s

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        raise PlannerError(
            "a graph plan is carried out by p.module (a GraphModule), not on the model's own "
            "modules; plan without form='graph' (form='inplace' is the default) to apply a plan "
            "in place"
        )

    @property
    def predicted_step_time_s(self) -> float:
        """Forward + backward + recomputation (+ offload transfers) of one step, in seconds."""
        return self.simulation.step_time_s

    def summary(self, verbose: bool = False) -> str:
        """The regions, what each frees and what its recomputation costs, and the totals.

        ``verbose`` adds what the solver reported (its note, optimality gap) and per-region
        node counts and kept nodes.
        """
        return plan_summary(self, verbose=verbose)

    def save(self, path: str | Path) -> None:
        """Write a versioned JSON that ``planner.apply_plan`` re-applies without solving."""
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


@dataclass(frozen=True)
class PricedModel:
    """A model captured and priced once (steps 1 and 2): what every solve of it starts from."""

    module: torch.fx.GraphModule  # the captured graph, sharing the model's parameters
    graph: CostGraph
    fingerprint: str

    @cached_property
    def eager_peak_bytes(self) -> int:
        """Predicted peak of one step without checkpointing."""
        return simulate(self.graph, Schedule()).peak_bytes

    def solve(
        self,
        budget_bytes: int,
        solver: str = "auto",
        *,
        objective: Objective = "time",
        max_recompute_flops_fraction: float | None = None,
        **solver_opts: Any,
    ) -> Schedule:
        """Step 3: the schedule ``solver`` chooses for ``budget_bytes``, minimising
        ``objective`` (``"time"`` or ``"flops"``, see ``graph_for_objective``), recomputing at
        most ``max_recompute_flops_fraction`` of the step's FLOPs if given (see :func:`plan`).

        ``solver_opts`` go to the solver unchanged (its own options; unknown ones are its
        error to raise).
        """
        return solve(
            self.graph, budget_bytes, solver, objective, max_recompute_flops_fraction, **solver_opts
        )

    def build(
        self,
        schedule: Schedule,
        budget_bytes: int,
        regions: list[NamedRegion] | None = None,
        *,
        solve_time_s: float = 0.0,
    ) -> Plan:
        """Step 4: carry ``schedule`` out on the captured module (:func:`build_plan`)."""
        return build_plan(
            self.module, self.graph, schedule, budget_bytes, regions, solve_time_s=solve_time_s
        )

    def plan(
        self,
        budget_bytes: int,
        solver: str = "auto",
        *,
        objective: Objective = "time",
        max_recompute_flops_fraction: float | None = None,
        on_step: OnStep = _no_progress,
        **solver_opts: Any,
    ) -> Plan:
        """Steps 3 and 4: solve for ``budget_bytes`` with ``solver`` and build the plan."""
        on_step("solve")
        t0 = time.perf_counter()
        schedule = self.solve(
            budget_bytes,
            solver,
            objective=objective,
            max_recompute_flops_fraction=max_recompute_flops_fraction,
            **solver_opts,
        )
        solve_time_s = time.perf_counter() - t0
        on_step("build")
        return self.build(schedule, budget_bytes, solve_time_s=solve_time_s)


def check_trainable(model: torch.nn.Module) -> None:
    """UnsupportedModelError for a model with no parameter to train."""
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModelError(
            f"no parameter of {type(model).__name__} requires grad, so a training step has "
            f"nothing to differentiate and nothing to checkpoint; unfreeze what you train "
            f"(param.requires_grad_(True)) before planning"
        )


def price(
    model: torch.nn.Module,
    example_input: Any,
    *,
    loss_fn: LossFn | None = None,
    device: str | DeviceProfile | None = None,
    on_step: OnStep = _no_progress,
    calibration: Calibration | str | Path | None = None,
) -> PricedModel:
    """Steps 1 and 2 of the pipeline: check the model, capture it, price one training step.

    ``device``: the device whose time to predict, a profile name (``"h100"``, ``"a100-80gb"``,
    ``"a100-40gb"``, ``"cpu"``) or a ``planner.DeviceProfile``; None: the model's own device,
    priced from its calibration (``planner/calibration.py``), or ``calibration`` when given.
    Raises ``UnsupportedModelError`` for a model with nothing to train or no loss to
    differentiate (pass ``loss_fn``), ``CaptureError`` when it cannot be captured.
    """
    profile = None if device is None else device_profile(device)
    check_trainable(model)
    on_step("capture")
    # what the model takes of the batch (a loss_fn(output, batch) may read labels it does not)
    taken = example_input
    if takes_batch(loss_fn):
        taken = join_input(example_input, *model_input(model, example_input, loss_fn))
    captured = capture(model, taken)
    on_step("estimate")
    # On the device itself, time the graph's own ops there; elsewhere (the meta device, or a
    # profile asked for) the roofline with the profile's rates is all there is.
    on_device = any(p.device.type != "meta" for p in model.parameters())
    time_ops = profile is None and on_device
    graph = estimate(
        captured.module,
        captured.args,
        captured.kwargs,
        loss_fn=loss_fn,
        rates=profile,
        time_ops=time_ops,
        timer=CalibrationTimer(
            model_dtype(model),
            calibration,
            step=lambda clock: measured_step_time(
                captured.module, example_input, loss_fn, clock=clock
            ),
        )
        if time_ops
        else None,
        batch=example_input,
    )
    return PricedModel(captured.module, graph, graph_fingerprint(captured.module))


def plan(
    model: torch.nn.Module,
    example_input: Any,
    mem_budget_gb: float,
    solver: str = "auto",
    *,
    loss_fn: LossFn | None = None,
    form: str = "inplace",
    device: str | DeviceProfile | None = None,
    fsdp: FSDPConfig | None = None,
    objective: Objective = "time",
    max_recompute_flops_fraction: float | None = None,
    calibration: Calibration | str | Path | None = None,
    compiled: bool = False,
    **solver_opts: Any,
) -> Plan | InplacePlan:
    """Plan activation checkpointing for ``model`` so one training step fits the budget.

    ``form="inplace"`` (the default): an InplacePlan priced on what eager runs;
    ``p.apply(model)`` wraps the model's own modules (planner/inplace.py) and the model trains
    as before, at any shape up to the planned one.
    ``form="graph"``: a Plan whose ``module`` (a GraphModule, fixed to the captured shapes;
    readable with ``print(p.module.code)``, exportable) carries it out.

    ``example_input``: a tensor, a tuple of tensors, or a dict of keyword tensors.
    ``mem_budget_gb``: peak bytes of one forward+loss+backward step above the pre-step baseline
    (parameters and optimizer state), in decimal GB; ``planner.step_budget_gb`` derives it
    from a device's memory (``planner/device_budget.py``). Raises ``InfeasibleBudgetError`` (with
    the least feasible budget) when no schedule fits. ``device``: whose step time to predict and
    minimise (see :func:`price`), e.g. ``"h100"`` for a model built on the meta device.
    ``fsdp``: an ``FSDPConfig`` (the in-place form only): plan one rank of FSDP2 sharding, its
    example input that rank's micro-batch and the budget that rank's peak (``planner/fsdp.py``);
    shard with ``planner.fsdp.shard(model, config)`` after ``p.apply(model)``.
    ``objective``: what the solver minimises within the budget, the predicted step time
    (``"time"``) or the recomputed FLOPs (``"flops"``: deterministic, the same plan on any
    machine; ties go to the faster plan). Either way the plan reports its predicted time.
    ``max_recompute_flops_fraction``: recompute at most this fraction of the step's FLOPs
    (``0.005``: 0.5%), the fastest such plan; trading time against FLOPs takes about ten
    solves. Raises ``RecomputeCapError`` (with the least fraction reachable) when no plan
    within the budget does.
    """
    budget_bytes = budget_bytes_from_gb(mem_budget_gb)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    check_objective(objective)
    get_solver(solver)  # fail on an unknown solver before the slow part
    if device is not None:
        device = device_profile(device)  # fail on an unknown profile before the slow part
    if fsdp is not None and not isinstance(fsdp, FSDPConfig):
        raise TypeError(f"fsdp must be a planner.FSDPConfig, got {type(fsdp).__name__}")
    if fsdp is not None and form != "inplace":
        raise ValueError(
            "fsdp plans are applied in place before fully_shard (torchtitan's order); plan "
            "with planner.plan(..., form='inplace', fsdp=...)"
        )
    if compiled and form != "inplace":
        raise ValueError("compiled=True plans the in-place form; use form='inplace'")
    if form == "inplace":
        check_trainable(model)
        check_span_solver(solver)
        eg = price_inplace(
            model, example_input, loss_fn, device=device, fsdp=fsdp, calibration=calibration
        )
        start_s = time.perf_counter()
        if compiled:
            schedule = solve_compiled(
                eg.graph, budget_bytes, solver, objective, max_recompute_flops_fraction, solver_opts
            )
        else:
            schedule = solve(
                eg.graph, budget_bytes, solver, objective, max_recompute_flops_fraction,
                **solver_opts,
            )  # fmt: skip
        solve_time_s = time.perf_counter() - start_s
        inplace = build_inplace_plan(
            model,
            eg,
            schedule,
            budget_bytes,
            solve_time_s=solve_time_s,
            example_input=example_input,
        )
        return replace(inplace, compiled_margin=COMPILED_MARGIN) if compiled else inplace
    with hf_checkpointing.paused(model):  # priced as it runs under the plan
        priced = price(
            model, example_input, loss_fn=loss_fn, device=device, calibration=calibration
        )
    return priced.plan(
        budget_bytes,
        solver,
        objective=objective,
        max_recompute_flops_fraction=max_recompute_flops_fraction,
        **solver_opts,
    )


def apply_plan(
    model: torch.nn.Module,
    path: str | Path,
    example_input: Any = None,
    *,
    loss_fn: LossFn | None = None,
) -> Plan | torch.nn.Module:
    """Apply the saved plan at ``path`` without solving again.

    Without ``example_input`` (an in-place plan): wrap ``model``'s own modules and return the
    same model (``planner/inplace.py``). With it (a graph plan): re-capture ``model`` and return
    the Plan whose ``module`` carries it out.

    Refuses (``PlanFileError``) a file that is malformed, edited, from another format version,
    or made for another model (or, for a graph plan, other input shapes).
    """
    if example_input is None:
        return apply_plan_file(model, path)
    body = load_plan_file(path)
    priced = price(model, example_input, loss_fn=loss_fn)
    if priced.fingerprint != body["fingerprint"]:
        raise PlanFileError(
            f"the plan in {path} was made for another model or other input shapes (the captured "
            f"graph's fingerprint differs). Plan this model with planner.plan(...) and save it, "
            f"or apply the plan to the model and input shapes it was made for."
        )
    named: list[NamedRegion] = body["regions"]
    index = {node.name: i for i, node in enumerate(priced.graph.nodes)}
    spans = []
    for r in named:
        try:
            start, stop = node_interval(r, index)
        except ValueError as e:
            raise PlanFileError(
                f"region {r.name!r} in {path} does not name a contiguous run of this graph's "
                f"nodes ({e}). Plan this model anew with planner.plan(...)."
            ) from None
        saved = frozenset(index[n] for n in r.saved_nodes if n in index)
        spans.append(Region(start, stop, r.depth, r.kind, saved))  # type: ignore[arg-type]
    schedule = Schedule(regions=tuple(spans), solver=body["solver"], note=f"applied from {path}")
    return priced.build(schedule, int(body["budget_bytes"]), named)


def named_regions(
    gm: torch.fx.GraphModule, graph: CostGraph, schedule: Schedule
) -> list[NamedRegion]:
    """Turn a solver's index intervals into named regions of fx node names."""
    taken: set[str] = set()
    regions = []
    for r in sorted(schedule.regions, key=lambda r: (r.start, -r.stop)):
        nodes = tuple(graph.nodes[i].name for i in range(r.start, r.stop))
        name = region_name(gm, nodes, taken)
        taken.add(name)
        saved = tuple(graph.nodes[i].name for i in sorted(r.saved_nodes))
        regions.append(NamedRegion(name, nodes, depth=r.depth, kind=r.kind, saved_nodes=saved))
    return regions


def build_plan(
    gm: torch.fx.GraphModule,
    graph: CostGraph,
    schedule: Schedule,
    budget_bytes: int,
    regions: list[NamedRegion] | None = None,
    *,
    solve_time_s: float = 0.0,
) -> Plan:
    """Step 4: rewrite ``gm`` by ``schedule`` and price the result with ``simulate``."""
    simulation = simulate(graph, schedule)  # also validates the schedule against the graph
    regions = named_regions(gm, graph, schedule) if regions is None else regions
    return Plan(
        module=rewrite(gm, regions),
        regions=tuple(regions),
        fingerprint=graph_fingerprint(gm),
        solve_time_s=solve_time_s,
        **predictions(graph, schedule, simulation, budget_bytes),
    )
