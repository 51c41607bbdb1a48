"""The graph form: a plan carried out by a GraphModule (``plan(..., form="graph")``).

Its steps, as the in-place form's (``planner/inplace_form.py``): :func:`price` captures the
model (``passes/capture.py``) and prices the captured graph (``passes/estimate.py``);
``PricedGraph.build`` rewrites the captured module by a schedule (``passes/rewrite.py``); the
plan's target, :class:`GraphTarget`, holds that module (``p.module``: fixed to the captured
shapes, readable with ``print(p.module.code)``, exportable) and the graph's fingerprint, its
part of the plan file; :func:`load` re-captures the model and rebuilds a saved plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from planner import hf_checkpointing
from planner.batch_sweep import BatchSweep
from planner.calibration import Calibration
from planner.devices import DeviceProfile, device_profile, profile_of_model
from planner.passes.capture import capture
from planner.passes.estimate import estimate
from planner.passes.rewrite import node_interval, region_name, rewrite
from planner.passes.step import LossFn, join_input, model_input, takes_batch
from planner.plan_file import graph_fingerprint, malformed, read_regions
from planner.plans import Plan, Region
from planner.priced import OnStep, Priced, _no_progress, check_trainable, op_timer, predictions
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.costgraph import Region as Span
from planner.solvers.errors import PlanFileError, PlannerError
from planner.solvers.simulate import simulate
from planner.target import FormTarget

FORM = "graph"


@dataclass(frozen=True)
class GraphTarget(FormTarget):
    """A graph plan's own part: the module that carries it out and the captured graph's
    fingerprint, so that a saved plan is only applied where it fits."""

    module: torch.fx.GraphModule = field(repr=False)
    fingerprint: str

    form: ClassVar[str] = FORM

    def apply(self, plan: Plan, model: torch.nn.Module) -> torch.nn.Module:
        raise PlannerError(
            "a graph plan is carried out by p.module (a GraphModule), not on the model's own "
            "modules; plan without form='graph' (form='inplace' is the default) to apply a plan "
            "in place"
        )

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint}


@dataclass(frozen=True)
class PricedGraph(Priced):
    """A model captured and priced once (steps 1 and 2): what every solve of it starts from."""

    module: torch.fx.GraphModule  # the captured graph, sharing the model's parameters
    graph: CostGraph
    fingerprint: str

    form: ClassVar[str] = FORM

    def build(
        self,
        schedule: Schedule,
        budget_bytes: int,
        regions: list[Region] | None = None,
        *,
        solve_time_s: float = 0.0,
    ) -> Plan:
        """Step 4: carry ``schedule`` out on the captured module (:func:`build_plan`)."""
        return build_plan(
            self.module,
            self.graph,
            schedule,
            budget_bytes,
            regions,
            solve_time_s=solve_time_s,
            baseline_peak_bytes=self.eager_peak_bytes,
        )


PricedModel = PricedGraph  # its earlier name


def price(
    model: torch.nn.Module,
    example_input: Any,
    *,
    loss_fn: LossFn | None = None,
    device: str | DeviceProfile | None = None,
    on_step: OnStep = _no_progress,
    calibration: Calibration | str | Path | None = None,
    sweep: BatchSweep | None = None,
) -> PricedGraph:
    """Steps 1 and 2 of the pipeline: check the model, capture it, price one training step.

    ``device``: the device whose time to predict, a profile name (``"h100"``, ``"a100-80gb"``,
    ``"a100-40gb"``, ``"cpu"``) or a ``planner.DeviceProfile``; None: the model's own device,
    priced from its calibration (``planner/calibration.py``), or ``calibration`` when given. Raises
    ``UnsupportedModelError`` for a model with nothing to train or no loss to differentiate
    (pass ``loss_fn``), ``CaptureError`` when it cannot be captured.
    """
    profile = None if device is None else device_profile(device)
    check_trainable(model)
    on_step("capture")
    # what the model takes of the batch (a loss_fn(output, batch) may read labels it does not)
    taken = example_input
    if takes_batch(loss_fn):
        taken = join_input(example_input, *model_input(model, example_input, loss_fn))
    with hf_checkpointing.paused(model):  # priced as it runs under the plan
        captured = capture(model, taken)
    on_step("estimate")
    timer = op_timer(model, captured.module, example_input, loss_fn, profile, calibration, sweep)
    graph = estimate(
        captured.module,
        captured.args,
        captured.kwargs,
        loss_fn=loss_fn,
        rates=profile or profile_of_model(model),
        time_ops=timer is not None,
        timer=timer,
        batch=example_input,
    )
    return PricedGraph(captured.module, graph, graph_fingerprint(captured.module))


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


def with_rng_state(graph: CostGraph, regions: list[Region]) -> list[Region]:
    """``regions`` (of ``graph``'s nodes) each preserving its RNG state exactly when a node in
    it draws random numbers (``CostGraph.preserves_rng_state``), as simulate prices it (Rule
    12): a plan read from a file takes it from the graph captured now, not from the file."""
    index = {node.name: i for i, node in enumerate(graph.nodes)}
    out = []
    for r in regions:
        start, stop = index[r.nodes[0]], index[r.nodes[-1]] + 1
        out.append(replace(r, preserve_rng_state=graph.preserves_rng_state(start, stop)))
    return out


def build_plan(
    gm: torch.fx.GraphModule,
    graph: CostGraph,
    schedule: Schedule,
    budget_bytes: int,
    regions: list[Region] | None = None,
    *,
    solve_time_s: float = 0.0,
    baseline_peak_bytes: int | None = None,
) -> Plan:
    """Step 4: rewrite ``gm`` by ``schedule`` and price the result with ``simulate``
    (``baseline_peak_bytes``: as for ``priced.predictions``)."""
    simulation = simulate(graph, schedule)  # also validates the schedule against the graph
    regions = named_regions(gm, graph, schedule) if regions is None else regions
    regions = with_rng_state(graph, regions)
    return Plan(
        regions=tuple(regions),
        target=GraphTarget(rewrite(gm, regions), graph_fingerprint(gm)),
        solve_time_s=solve_time_s,
        **predictions(graph, schedule, simulation, budget_bytes, baseline_peak_bytes),
    )


def load(
    body: dict[str, Any],
    path: str | Path,
    model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None = None,
) -> Plan:
    """``planner.apply_plan`` of a graph plan file's checked ``body``: re-capture ``model``,
    check it is the graph the plan was made for, and rebuild the plan (no solve)."""
    try:
        named = read_regions(body)
        budget_bytes, solver = int(body["budget_bytes"]), str(body["solver"])
        fingerprint = str(body["fingerprint"])
    except (KeyError, TypeError, ValueError) as e:
        raise malformed(path, e) from e
    priced = price(model, example_input, loss_fn=loss_fn)
    if priced.fingerprint != fingerprint:
        raise PlanFileError(
            f"the plan in {path} was made for another model or other input shapes (the captured "
            f"graph's fingerprint differs). Plan this model with planner.plan(...) and save it, "
            f"or apply the plan to the model and input shapes it was made for."
        )
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
        spans.append(Span(start, stop, r.depth, r.kind, saved))  # type: ignore[arg-type]
    schedule = Schedule(regions=tuple(spans), solver=solver, note=f"applied from {path}")
    return priced.build(schedule, budget_bytes, list(named))
