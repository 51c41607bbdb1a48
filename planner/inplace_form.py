"""The in-place form: a plan carried out on the model's own modules (``planner.plan``'s
default; ``p.apply(model)``, ``planner.apply_plan(model, path)``).

Its steps, as the graph form's (``planner/graph_form.py``): :func:`price_inplace` prices the
model's eager step (``passes/eager.py``: every region a module call); ``PricedInplace.build``
turns a schedule into regions named by module paths, with what applying them needs; the
plan's target, :class:`InplaceTarget`, checks the model is the one planned and wraps its
modules (the run time: ``planner/inplace.py``), and holds its part of the plan file, the module
tree and parameter shapes; :func:`load` reads a saved plan back.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from planner import hf_checkpointing
from planner.batch_sweep import BatchSweep
from planner.calibration import Calibration
from planner.devices import DeviceProfile, profile_of_model
from planner.fsdp import FSDPConfig, per_rank
from planner.guard import PlannedShape, install_guard, planned_shape
from planner.inplace import apply_regions
from planner.inplace_check import check_fits, module_tree, parameter_shapes
from planner.passes.eager import EagerGraph, eager_graph
from planner.passes.step import LossFn
from planner.plan_file import malformed, read_plan_body, read_predictions, read_regions
from planner.plans import Plan, Region
from planner.priced import Priced, op_timer, predictions
from planner.pricing_cache import pricing_key, reuse_priced
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.errors import PlanFileError, PlannerError, UnsupportedModelError
from planner.solvers.registry import get_solver
from planner.solvers.simulate import simulate
from planner.target import FormTarget

FORM = "inplace"
# every solver keeps to CostGraph.region_spans (the classic ones by way of solvers/blocks.py)
SPAN_SOLVERS = (
    "auto",
    "dp",
    "ilp",
    "none",
    "uniform",
    "sqrt",
    "greedy",
    "revolve",
    "selective",
    "sac",
)


@dataclass(frozen=True)
class InplaceTarget(FormTarget):
    """An in-place plan's own part: what applying it checks of the model, and the shape it was
    planned at. ``parameter_shapes`` (name, shape) of every parameter: a plan never applies to
    a model of other widths (empty: a file saved before they were recorded, not checked);
    ``precision``: the dtypes it was priced in (passes/step.py precision_text);
    ``planned_shape``: the example input's shape and how the peak scales off it
    (planner/guard.py), None for a plan built without an example input or read from a file
    saved before plans recorded it; ``traced_forwards``: the modules whose forward the plan
    runs as torch.fx traces it (``passes/eager.py`` ``EagerGraph.traced_forwards_needed``)."""

    model_class: str
    module_tree: tuple[tuple[str, str], ...] = field(repr=False)
    parameter_shapes: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), repr=False)
    precision: str = ""
    planned_shape: PlannedShape | None = field(default=None, repr=False)
    # modules whose own forward runs as fx traces it (passes/parent_spans.py), as priced:
    # those with spans of their own among the regions or inside a region
    traced_forwards: tuple[str, ...] = ()

    form: ClassVar[str] = FORM

    @property
    def module(self) -> torch.nn.Module:
        raise PlannerError(
            "an in-place plan has no separate module: apply it to your model with "
            "p.apply(model) (or planner.apply_plan(model, path)), and train the model itself; "
            "plan with form='graph' for a GraphModule"
        )

    def apply(self, plan: Plan, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``model``'s own region modules in place, once it is checked to be the model
        ``plan`` was made for; the model warns once (``planner.OverShapeWarning``) when called
        with a larger input than planned."""
        return self.apply_checked(plan, model, "the plan")

    def apply_checked(self, plan: Plan, model: torch.nn.Module, source: str) -> torch.nn.Module:
        check_fits(
            model,
            self.model_class,
            self.module_tree,
            plan.regions,
            source,
            self.parameter_shapes,
            self.traced_forwards,
        )
        apply_regions(model, plan.regions, plan, self.traced_forwards)
        install_guard(model, self.planned_shape, plan.budget_bytes)
        return model

    def to_json(self) -> dict[str, Any]:
        return {
            "model_class": self.model_class,
            "fingerprint": _tree_hash(self.module_tree),
            "module_tree": [list(m) for m in self.module_tree],
            "parameter_shapes": [[name, list(shape)] for name, shape in self.parameter_shapes],
            "precision": self.precision,
            "traced_forwards": list(self.traced_forwards),
            "planned_shape": None
            if (shape := self.planned_shape) is None
            else {
                "shape": list(shape.shape),
                "predicted_peak_bytes": shape.predicted_peak_bytes,
                "fixed_bytes": shape.fixed_bytes,
                "attention_share": shape.attention_share,
            },
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> InplaceTarget:
        """KeyError, TypeError or ValueError for a malformed part."""
        tree = tuple((str(p), str(k)) for p, k in body["module_tree"])
        if _tree_hash(tree) != body["fingerprint"]:
            raise ValueError("module tree fingerprint")
        shape = body.get("planned_shape")  # absent from files saved before it was recorded
        if shape is not None:
            shape = PlannedShape(
                shape=tuple(int(d) for d in shape["shape"]),
                predicted_peak_bytes=int(shape["predicted_peak_bytes"]),
                fixed_bytes=int(shape["fixed_bytes"]),
                attention_share=float(shape["attention_share"]),
            )
        return cls(
            model_class=str(body["model_class"]),
            module_tree=tree,
            parameter_shapes=tuple(
                (str(name), tuple(int(d) for d in dims))
                for name, dims in body.get("parameter_shapes", ())
            ),
            precision=str(body.get("precision", "")),
            planned_shape=shape,
            traced_forwards=tuple(str(p) for p in body.get("traced_forwards", ())),
        )


def _tree_hash(tree: tuple[tuple[str, str], ...]) -> str:
    return hashlib.sha256(json.dumps(tree).encode()).hexdigest()


@dataclass(frozen=True)
class PricedInplace(Priced):
    """A model's eager step priced once for in-place plans: what every solve of it starts from
    (the same steps as ``graph_form.PricedGraph``: ``solve``, ``build``, ``plan``)."""

    model: torch.nn.Module
    eager: EagerGraph
    example_input: Any = None  # the shape the applied plan guards (planner/guard.py)

    form: ClassVar[str] = FORM
    form_solvers: ClassVar[tuple[str, ...] | None] = SPAN_SOLVERS

    @property
    def graph(self) -> CostGraph:  # type: ignore[override]
        return self.eager.graph

    @staticmethod
    def check_solver(solver: str) -> None:
        check_span_solver(solver)

    def build(self, schedule: Schedule, budget_bytes: int, *, solve_time_s: float = 0.0) -> Plan:
        return build_inplace_plan(
            self.model,
            self.eager,
            schedule,
            budget_bytes,
            solve_time_s=solve_time_s,
            example_input=self.example_input,
            baseline_peak_bytes=self.eager_peak_bytes,
        )


def check_span_solver(solver: str) -> None:
    """UnsupportedModelError for a solver whose regions need not be module calls."""
    get_solver(solver)  # an unknown name fails with the registry's own message
    if solver not in SPAN_SOLVERS:
        raise UnsupportedModelError(
            f"solver {solver!r} places regions between arbitrary nodes; an in-place plan's "
            f"regions are module calls, which only {', '.join(map(repr, SPAN_SOLVERS))} keep "
            f"to. Use one of those, or plan with form='graph'."
        )


def price_inplace(
    model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None = None,
    *,
    device: DeviceProfile | None = None,
    fsdp: FSDPConfig | None = None,
    calibration: Calibration | str | Path | None = None,
    time_limit_s: float | None = None,
    sweep: BatchSweep | None = None,
) -> EagerGraph:
    """Price ``model``'s eager step for an in-place plan.

    ``device``: the profile to price time for; None prices the model's own device, from its
    calibration (``planner/calibration.py``: its ops timed there once, as ``graph_form.price``
    does for a graph). ``calibration``: pin one (a ``Calibration`` or the path of one).
    ``fsdp``: price one rank of FSDP2 sharding instead of one process holding the whole model
    (``planner/fsdp.py``).
    """

    def make() -> EagerGraph:
        timer = op_timer(model, model, example_input, loss_fn, device, calibration, sweep)
        with hf_checkpointing.paused(model):
            eg = eager_graph(
                model,
                example_input,
                loss_fn,
                rates=device or profile_of_model(model),
                time_ops=timer is not None,
                timer=timer,
                parent_spans=fsdp is None,
                time_limit_s=time_limit_s,
            )
        return eg if fsdp is None else per_rank(model, eg, fsdp)

    # the same model and input shapes priced earlier in this process: the same pricing
    key = pricing_key(model, example_input, calibration, "inplace", loss_fn, device, fsdp)
    return reuse_priced(key, model, make)


def build_inplace_plan(
    model: torch.nn.Module,
    eg: EagerGraph,
    schedule: Schedule,
    budget_bytes: int,
    *,
    solve_time_s: float = 0.0,
    example_input: Any = None,
    baseline_peak_bytes: int | None = None,
) -> Plan:
    """The plan for ``schedule``; ``example_input``: the input it was priced on, recorded so
    that the applied model can tell a larger one (planner/guard.py); ``baseline_peak_bytes``:
    as for ``priced.predictions``."""
    graph = eg.graph
    simulation = simulate(graph, schedule)  # validates: regions are module spans
    regions = []
    for r in sorted(schedule.regions, key=lambda r: (r.start, -r.stop)):
        place = eg.places[(r.start, r.stop)]
        saved = sorted(r.saved_nodes)
        regions.append(
            Region.at(
                place,
                nodes=tuple(graph.nodes[i].name for i in range(r.start, r.stop)),
                depth=r.depth,
                kind=r.kind,
                saved_nodes=tuple(graph.nodes[i].name for i in saved),
                keeps=tuple(eg.op_key(i, r.start) for i in saved),
                ops=tuple(eg.op_sequence(r.start, r.stop)),
                state_buffers=eg.state_buffers.get(place.name, ()),
                preserve_rng_state=graph.preserves_rng_state(r.start, r.stop),
            )
        )
    target = InplaceTarget(
        model_class=type(model).__name__,
        module_tree=module_tree(model),
        parameter_shapes=parameter_shapes(model),
        precision=eg.graph.meta.get("precision", ""),
        traced_forwards=eg.traced_forwards_needed((r.start, r.stop) for r in schedule.regions),
        planned_shape=(
            None
            if example_input is None
            else planned_shape(example_input, graph, simulation.peak_bytes)
        ),
    )
    return Plan(
        regions=tuple(regions),
        target=target,
        solve_time_s=solve_time_s,
        **predictions(graph, schedule, simulation, budget_bytes, baseline_peak_bytes),
    )


def read(body: dict[str, Any], path: str | Path) -> Plan:
    """The in-place plan in a checked plan file ``body`` (no graph: the predictions are the
    saved ones)."""
    try:
        return Plan(
            solver=str(body["solver"]),
            regions=read_regions(body),
            budget_bytes=int(body["budget_bytes"]),
            predictions=read_predictions(body["predictions"]),
            target=InplaceTarget.from_json(body),
            notes=str(body.get("notes", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise malformed(path, e) from e


def load_inplace(path: str | Path) -> Plan:
    """Read an in-place plan file (no graph: the predictions are the saved ones)."""
    body = read_plan_body(path)
    if body["form"] != FORM:
        raise PlanFileError(
            f"{path} holds a graph plan (regions of a captured graph), which needs the model's "
            f"example input: planner.apply_plan(model, path, example_input). To apply a plan "
            f"in place, plan with planner.plan(..., form='inplace') and save that."
        )
    return read(body, path)


def apply_plan_file(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """``planner.apply_plan(model, path)``: check the file fits ``model``, then wrap in place."""
    plan = load_inplace(path)
    return plan.target.apply_checked(plan, model, str(path))
