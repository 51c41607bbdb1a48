"""The pipeline: check -> price -> solve -> build, one body for both forms.

Every way in goes through here, so every way in makes the same checks and raises the same errors:

- ``plan()`` runs the four steps for one budget;
- ``apply_plan()`` reads a saved plan and hands it to its form, which applies it in place or
  re-captures the model and builds the plan without solving;
- the command line, ``planner.compare`` and ``planner.fit_batch`` check with
  :func:`check_form_options` and price once with :func:`price_form`, then solve and build per
  budget, solver or batch size with the same options ``plan()`` takes.

The form's own steps are in its module, which offers the same ones for both
(``planner/graph_form.py``, ``planner/inplace_form.py``: ``price``, ``Priced*.build``, the
target's ``apply``, reading its plan file); the Plan they return is ``planner/plans.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from planner import graph_form, inplace_form
from planner.batch_sweep import BatchSweep
from planner.calibration import Calibration
from planner.devices import DeviceProfile, device_profile
from planner.fsdp import FSDPConfig
from planner.graph_form import PricedGraph, PricedModel, build_plan, named_regions, price
from planner.inplace_form import PricedInplace
from planner.passes.step import LossFn, autocast_for
from planner.plan_file import read_plan_body
from planner.plans import GB, InplacePlan, Plan, gb_to_bytes
from planner.priced import OnStep, _no_progress, check_trainable
from planner.solvers.costgraph import Objective, check_objective
from planner.solvers.errors import InvalidBudgetError, PlanFileError
from planner.solvers.registry import DEFAULT_TIME_LIMIT_S

FORMS = ("graph", "inplace")

__all__ = [
    "FORMS",
    "GB",
    "InplacePlan",
    "OnStep",
    "Plan",
    "PlanOptions",
    "PricedGraph",
    "PricedInplace",
    "PricedModel",
    "apply_plan",
    "budget_bytes_from_gb",
    "build_plan",
    "check_form_options",
    "check_trainable",
    "named_regions",
    "plan",
    "price",
    "price_form",
]


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
    return gb_to_bytes(value)


def check_form_options(
    form: str,
    solvers: Sequence[str] = ("auto",),
    *,
    objective: Objective = "time",
    device: str | DeviceProfile | None = None,
    fsdp: FSDPConfig | None = None,
    compiled: bool = False,
) -> DeviceProfile | None:
    """The checks every entry point makes before the slow part; returns the device profile."""
    if compiled and form != "inplace":
        raise ValueError("compiled=True plans the in-place form; use form='inplace'")
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    check_objective(objective)
    check_solver = PricedInplace.check_solver if form == "inplace" else PricedGraph.check_solver
    for name in solvers:
        check_solver(name)
    profile = None if device is None else device_profile(device)
    if fsdp is not None and not isinstance(fsdp, FSDPConfig):
        raise TypeError(f"fsdp must be a planner.FSDPConfig, got {type(fsdp).__name__}")
    if fsdp is not None and form != "inplace":
        raise ValueError(
            "fsdp plans are applied in place before fully_shard (torchtitan's order); plan "
            "in place (form='inplace', the default) with fsdp=..."
        )
    return profile


@dataclass(frozen=True)
class PlanOptions:
    """The options every entry point (``plan``, ``compare``, ``fit_batch``, the command line)
    takes beside the model, its input, the budget and the solver, as ``plan`` documents them:
    built once from their keywords, checked once (:meth:`checked`), then handed on whole."""

    form: str = "inplace"
    loss_fn: LossFn | None = None
    device: str | DeviceProfile | None = None
    fsdp: FSDPConfig | None = None
    calibration: Calibration | str | Path | None = None
    objective: Objective = "time"
    max_recompute_flops_fraction: float | None = None
    compiled: bool = False
    autocast: torch.dtype | None = None  # priced under torch.autocast in this dtype

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> PlanOptions:
        """The options among an entry point's ``arguments`` (its ``locals()`` on entry):
        ``plan``, ``compare`` and ``fit_batch`` spell each option out as a keyword of the
        field's name, so that ``help()`` lists them, and gather them here in one place."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls)})

    def keywords(self) -> dict[str, Any]:
        """These options as the keywords of ``plan``, ``compare`` and ``fit_batch`` (the
        inverse of :meth:`of`), for a caller that holds them whole (the command line)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def checked(self, solvers: Sequence[str] = ("auto",)) -> PlanOptions:
        """These options, checked before the slow part (:func:`check_form_options`) for
        ``solvers``, the device resolved to its profile. A pinned calibration file that exists
        is read here, so that a malformed one fails before the model is traced (pricing reads
        it again, to extend it and write it back)."""
        if isinstance(self.calibration, (str, Path)) and Path(self.calibration).exists():
            Calibration.load(self.calibration)
        profile = check_form_options(
            self.form,
            solvers,
            objective=self.objective,
            device=self.device,
            fsdp=self.fsdp,
            compiled=self.compiled,
        )
        return replace(self, device=profile)

    def price(
        self,
        model: torch.nn.Module,
        example_input: Any,
        on_step: OnStep = _no_progress,
        time_limit_s: float = DEFAULT_TIME_LIMIT_S,
        sweep: BatchSweep | None = None,
    ) -> PricedGraph | PricedInplace:
        """Steps 1 and 2 (:func:`price_form`) with these options as :meth:`checked` returned
        them (not checked again), under ``autocast`` if set (only pricing runs the model; the
        solve and the build are dtype-blind). ``time_limit_s``: tracing the in-place step for
        longer raises a ``PlannerError`` naming the module. ``sweep``: ``fit_batch``'s sweep
        over batch sizes, which this step extends."""
        amp = nullcontext() if self.autocast is None else autocast_for(model, self.autocast)
        with amp:
            return _price_checked(
                model,
                example_input,
                self.form,
                loss_fn=self.loss_fn,
                profile=self.device,  # type: ignore[arg-type]
                fsdp=self.fsdp,
                on_step=on_step,
                calibration=self.calibration,
                time_limit_s=time_limit_s,
                sweep=sweep,
            )

    @property
    def solving(self) -> dict[str, Any]:
        """The keywords of ``Priced.solve`` and ``Priced.plan`` these options set."""
        return {
            "objective": self.objective,
            "max_recompute_flops_fraction": self.max_recompute_flops_fraction,
            "compiled": self.compiled,
        }


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
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    sweep: BatchSweep | None = None,
) -> PricedGraph | PricedInplace:
    """Price one training step of ``model`` for plans of ``form`` (see :func:`plan` for
    ``device``, ``calibration`` and ``fsdp``, the latter in place only; ``sweep``:
    ``fit_batch``'s sweep over batch sizes, which this step extends)."""
    profile = check_form_options(form, device=device, fsdp=fsdp)
    return _price_checked(
        model,
        example_input,
        form,
        loss_fn=loss_fn,
        profile=profile,
        fsdp=fsdp,
        on_step=on_step,
        calibration=calibration,
        time_limit_s=time_limit_s,
        sweep=sweep,
    )


def _price_checked(
    model: torch.nn.Module,
    example_input: Any,
    form: str,
    *,
    loss_fn: LossFn | None,
    profile: DeviceProfile | None,
    fsdp: FSDPConfig | None,
    on_step: OnStep,
    calibration: Calibration | str | Path | None,
    time_limit_s: float,
    sweep: BatchSweep | None = None,
) -> PricedGraph | PricedInplace:
    """:func:`price_form` after its checks (:func:`check_form_options`), the device resolved
    to its ``profile``."""
    if form == "graph":
        return graph_form.price(
            model,
            example_input,
            loss_fn=loss_fn,
            device=profile,
            on_step=on_step,
            calibration=calibration,
            sweep=sweep,
        )
    check_trainable(model)
    on_step("estimate")  # one pass over the eager step: nothing is captured first
    eager = inplace_form.price_inplace(
        model,
        example_input,
        loss_fn,
        device=profile,
        fsdp=fsdp,
        calibration=calibration,
        time_limit_s=time_limit_s,
        sweep=sweep,
    )
    return PricedInplace(model, eager, example_input)


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
    autocast: torch.dtype | None = None,
    compiled: bool = False,
    **solver_opts: Any,
) -> Plan:
    """Plan activation checkpointing for ``model`` so one training step fits the budget.

    ``form="inplace"`` (the default): a plan priced on what eager runs; ``p.apply(model)``
    wraps the model's own modules (planner/inplace.py) and the model trains as before, at any
    shape up to the planned one.
    ``form="graph"``: a plan whose ``module`` (a GraphModule, fixed to the captured shapes;
    readable with ``print(p.module.code)``, exportable) carries it out.

    ``example_input``: a tensor, a tuple of tensors, or a dict of keyword tensors.
    ``loss_fn``: the loss the step differentiates, ``loss_fn(output)`` or ``loss_fn(output,
    batch)`` (the batch: ``example_input``); None: the model's own ``loss`` (Hugging Face
    style), else the sum of its floating outputs (with a ``LossFallbackWarning``).
    ``mem_budget_gb``: peak bytes of one forward+loss+backward step above the pre-step baseline
    (parameters and optimizer state), in decimal GB; ``planner.step_budget_gb`` derives it
    from a device's memory (``planner/device_budget.py``). Raises ``InfeasibleBudgetError`` (with
    the least feasible budget) when no schedule fits. ``device``: whose step time to predict and
    minimise, a profile name (``"h100"``, ``"a100-80gb"``, ``"a100-40gb"``, ``"cpu"``) or a
    ``planner.DeviceProfile``, e.g. ``"h100"`` for a model built on the meta device; None: the
    model's own device, its ops timed there from its calibration (``planner/calibration.py``),
    or ``calibration`` when given.
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
    ``autocast``: the dtype you train under ``torch.autocast`` in (``torch.bfloat16``,
    ``torch.float16``): the step is priced as inside ``torch.autocast(<the model's device
    type>, dtype=autocast)``, as when ``plan`` is called inside that context (None: the
    caller's context, if any).
    ``compiled``: the model will run under ``torch.compile``: plan without nested regions
    (compile flattens them) against the budget less ``planner.compiled.COMPILED_MARGIN``, which
    the summary states (``planner/compiled.py`` says why; in place only).
    """
    budget_bytes = budget_bytes_from_gb(mem_budget_gb)
    # fail on an unknown form, solver or option before the slow part
    options = PlanOptions.of(locals()).checked((solver,))
    time_limit_s = solver_opts.get("time_limit_s", DEFAULT_TIME_LIMIT_S)
    priced = options.price(model, example_input, time_limit_s=time_limit_s)
    return priced.plan(budget_bytes, solver, **options.solving, **solver_opts)


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
        return inplace_form.apply_plan_file(model, path)
    body = read_plan_body(path)
    if body["form"] != "graph":
        raise PlanFileError(
            f"{path} holds an in-place plan: apply it with planner.apply_plan(model, path) "
            f"(no example input), or plan with form='graph' for a GraphModule."
        )
    return graph_form.load(body, path, model, example_input, loss_fn)
