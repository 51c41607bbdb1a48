"""``planner.compare``: every solver at every budget on one model, side by side.

The model is priced once, in place (the default) or as a graph (``planning.price_form``); each
solver then solves the same CostGraph with the same options (``objective``, FLOPs cap, device),
so rows differ only by solver and budget. With ``measure=True`` each plan also runs one real
training step (``planner.measure``) for its measured peak and step time against the unmodified
model's: an in-place plan applied to the model for it and removed after.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from planner.anchors import anchor, check_anchors, default_anchors, hf_enabled
from planner.calibration import Calibration
from planner.comparison_result import NARROW_COLUMNS, Comparison, Row
from planner.devices import DeviceProfile
from planner.fsdp import FSDPConfig
from planner.inplace import remove
from planner.inplace_form import SPAN_SOLVERS
from planner.measurement import Measurement
from planner.measurement import measure as measure_step
from planner.passes.step import LossFn
from planner.planning import PlanOptions
from planner.plans import Plan, gb_to_bytes
from planner.priced import Priced
from planner.report import format_bytes
from planner.solvers.costgraph import CostGraph, Objective
from planner.solvers.errors import InfeasibleBudgetError, PlannerError
from planner.solvers.registry import (
    DEFAULT_TIME_LIMIT_S,
    SOLVERS,
    SharedTimeLimit,
    get_solver,
)

__all__ = ["NARROW_COLUMNS", "Comparison", "Row", "compare", "measure_plan", "solver_names"]

# Cheap, well-known policies first, then the optimising solvers; unknown ones follow by name.
PREFERRED_ORDER = ("none", "uniform", "sqrt", "revolve", "selective", "sac", "greedy", "dp", "ilp")
DEFAULT_BUDGET_FRACTIONS = (0.8, 0.6, 0.4, 0.2)  # of the predicted eager peak


def solver_names(form: str | None = None) -> list[str]:
    """Every registered solver except 'auto' (which picks one of them), well-known ones first;
    with ``form``, those that plan in it (in place: ``inplace_form.SPAN_SOLVERS``)."""
    get_solver("none")  # loads the solver modules, which register themselves
    names = [n for n in SOLVERS if n != "auto" and (form != "inplace" or n in SPAN_SOLVERS)]
    return sorted(
        names,
        key=lambda n: (
            (PREFERRED_ORDER.index(n), n) if n in PREFERRED_ORDER else (len(PREFERRED_ORDER), n)
        ),
    )


def compare(
    model: torch.nn.Module,
    example_input: Any,
    budgets_gb: Sequence[float] | None = None,
    solvers: Sequence[str] | None = None,
    measure: bool = False,
    *,
    form: str = "inplace",
    loss_fn: LossFn | None = None,
    budget_fractions: Sequence[float] | None = None,
    objective: Objective = "time",
    max_recompute_flops_fraction: float | None = None,
    device: str | DeviceProfile | None = None,
    fsdp: FSDPConfig | None = None,
    solver_opts: Mapping[str, Mapping[str, Any]] | None = None,
    repeats: int = 3,
    progress: bool = False,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    calibration: Calibration | str | Path | None = None,
    compiled: bool = False,
    autocast: torch.dtype | None = None,
    anchors: Sequence[str] | None = None,
) -> Comparison:
    """Run every solver at every budget on one pricing of ``model``; one row each.

    ``form``: the plans' form, as for ``planner.plan``: "inplace" (the default: every solver,
    its regions module calls; the classic strategies count the model's repeated blocks,
    ``solvers/blocks.py``) or "graph". ``budgets_gb``: decimal GB (10^9 bytes), as ``plan``'s
    ``mem_budget_gb``. Without it, the budgets are ``budget_fractions`` of the predicted eager
    peak (default 0.8, 0.6, 0.4, 0.2). ``solvers``: registered solver names (default: all but
    'auto' that apply to ``form``). ``measure``: also run each plan's real training step
    (``planner.measure``, ``repeats`` timed steps) for the measured peak and the step-time ratio
    against the unmodified model; an in-place plan is applied to ``model`` for its measurement
    and removed again (``planner.remove``).
    ``objective``, ``max_recompute_flops_fraction``, ``device``, ``fsdp`` (in place only, not
    with ``measure``): as for ``planner.plan``, the same for every row (a solver that cannot
    keep to the FLOPs cap gets a row saying so). ``solver_opts``: extra keyword options per
    solver name, e.g. ``{"ilp": {"time_limit_s": 5}}``.
    ``progress``: show a progress bar (only once a step takes more than half a second).
    ``time_limit_s``: one limit for all the solves together, each taking an equal share of what
    is left (a solver's own ``time_limit_s`` in ``solver_opts`` caps its share further).
    ``calibration``, ``compiled``, ``autocast``: as for ``planner.plan``.
    ``anchors``: rows for what a user does by hand (``planner/anchors.py``): ``"every-block"``
    (torch.utils.checkpoint on every repeated block) and ``"hf"`` (Hugging Face's own
    checkpointing of each layer, in place), priced on the same CostGraph and, with ``measure``,
    run for real (``"hf"`` with Hugging Face's checkpointing itself on). Default: with the
    default ``solvers``, both where the model has them (``"hf"``: a Hugging Face model, in
    place); with named ``solvers``, none. ``()`` for none.
    """
    names = list(solvers) if solvers is not None else solver_names(form)
    explicit_anchors = anchors is not None
    if explicit_anchors:
        anchor_names = tuple(anchors)  # type: ignore[arg-type]
    else:  # named solvers are what was asked for; the default list has the anchors beside it
        anchor_names = default_anchors(model, form) if solvers is None else ()
    check_anchors(anchor_names, form)
    # unknown names, options and solvers that do not suit the form fail before the work
    options = PlanOptions.of(locals()).checked(names)
    if fsdp is not None and measure:
        raise ValueError(
            "measure=True runs one process, while an fsdp plan is priced for one rank of "
            "FSDP2; measure it sharded, under torchrun (examples/fsdp.py), or compare "
            "without measure"
        )
    budgets_bytes, fractions = _budgets_asked(budgets_gb, budget_fractions)
    opts = solver_opts or {}
    unknown = sorted(set(opts) - set(names))
    if unknown:
        raise ValueError(
            f"solver_opts names solvers not compared: {', '.join(unknown)}; it maps a solver "
            f"name to its options, e.g. {{'ilp': {{'time_limit_s': 5}}}}"
        )

    n_budgets = len(budgets_gb) if budgets_gb is not None else len(fractions)
    bar = tqdm(
        total=2 + (len(names) + len(anchor_names)) * n_budgets,
        disable=not progress,
        delay=0.5,
        unit="step",
        desc="capture",
    )

    def on_step(step: str) -> None:
        if step == "estimate":
            bar.update()
            bar.set_description("estimate")

    try:
        t0 = time.perf_counter()
        priced = options.price(model, example_input, on_step, time_limit_s)
        bar.update()
        estimate_time_s = time.perf_counter() - t0
        eager_predicted = priced.eager_peak_bytes
        if budgets_bytes is None:
            budgets_bytes = [round(f * eager_predicted) for f in fractions]
        eager = None
        if measure:
            bar.set_description("measure eager")
            eager = measure_step(model, example_input, loss_fn, repeats=repeats)
        made = _Rows(priced.graph, eager, bar, _Runs(model, example_input, loss_fn, repeats))
        limit = SharedTimeLimit.starting_now(time_limit_s)
        _solve_all(made, priced, names, budgets_bytes, options, opts, limit)
        for name in anchor_names:
            _anchor_rows(made, priced, model, name, budgets_bytes, explicit_anchors)
    finally:
        bar.close()
    return Comparison(
        rows=tuple(made.rows),
        eager_predicted_peak_bytes=eager_predicted,
        eager_measured_peak_bytes=None if eager is None else eager.peak_bytes,
        eager_step_time_s=None if eager is None else eager.step_time_s,
        step_flops=priced.graph.step_flops,
        estimate_time_s=estimate_time_s,
        plans=made.plans,
        form=form,
    )


def _budgets_asked(
    budgets_gb: Sequence[float] | None, budget_fractions: Sequence[float] | None
) -> tuple[list[int] | None, tuple[float, ...]]:
    """compare's budgets in bytes when given in GB (None: fractions of the eager peak, known
    once priced) and the fractions, checked."""
    budgets_bytes = None
    if budgets_gb is not None:
        budgets_bytes = [gb_to_bytes(gb) for gb in budgets_gb]
        if not budgets_bytes or min(budgets_bytes) <= 0:
            raise ValueError(f"budgets_gb must be positive numbers of GB, got {budgets_gb!r}")
    fractions = tuple(budget_fractions or DEFAULT_BUDGET_FRACTIONS)
    if budgets_gb is not None and budget_fractions is not None:
        raise ValueError("give budgets_gb or budget_fractions, not both")
    if not all(f > 0 for f in fractions):
        raise ValueError(f"budget_fractions must be positive, got {budget_fractions!r}")
    return budgets_bytes, fractions


@dataclass
class _Rows:
    """The rows ``compare`` makes, in order, the plans of those a plan was made for, and the
    progress bar that counts them; ``runs`` measures the plans when ``eager`` was measured."""

    graph: CostGraph
    eager: Measurement | None
    bar: Any
    runs: _Runs
    rows: list[Row] = field(default_factory=list)
    plans: dict[tuple[str, int], Plan] = field(default_factory=dict)

    def refused(self, row: Row) -> None:
        self.rows.append(row)
        self.bar.update()

    def planned(self, name: str, p: Plan, budget_bytes: int, hf: bool = False) -> None:
        """The row of plan ``p``, measured (with Hugging Face's checkpointing on: ``hf``)
        when the eager step was."""
        measured = None
        if self.eager is not None:
            measured = self.runs.measure_hf(p) if hf else self.runs.measure(p)
        self.rows.append(_row(name, p, budget_bytes, measured, self.eager, self.graph))
        self.plans[(name, budget_bytes)] = p
        self.bar.update()


def _solve_all(
    made: _Rows,
    priced: Priced,
    names: list[str],
    budgets_bytes: list[int],
    options: PlanOptions,
    opts: Mapping[str, Mapping[str, Any]],
    limit: SharedTimeLimit,
) -> None:
    """A row for every solver at every budget, the solves sharing ``limit``."""
    solves_left = len(names) * len(budgets_bytes)
    # A search's share counts the searches left alone: the quick solvers use milliseconds
    # of theirs, and dp's first solve, which the later budgets read (solved_once), got a
    # twenty-fourth of the limit and was cut short on a slow machine.
    searching = {n: get_solver(n).options.searches for n in names}
    searches_left = sum(searching.values()) * len(budgets_bytes)
    for budget_bytes in budgets_bytes:
        for name in names:
            made.bar.set_description(f"{name} @ {format_bytes(budget_bytes)}")
            t0 = time.perf_counter()
            own = dict(opts.get(name, {}))
            share_s = limit.share_s(searches_left if searching[name] else solves_left)
            own["time_limit_s"] = min(share_s, own.get("time_limit_s", share_s))
            solves_left -= 1
            searches_left -= searching[name]
            try:
                with limit.solving():
                    schedule = priced.solve(budget_bytes, name, **options.solving, **own)
            except InfeasibleBudgetError as e:
                solve_time_s = time.perf_counter() - t0
                made.refused(_infeasible(name, budget_bytes, solve_time_s, least=e.min_bytes))
                continue
            except PlannerError as e:  # e.g. a solver that does not handle this graph
                note = str(e).splitlines()[0]
                made.refused(_infeasible(name, budget_bytes, time.perf_counter() - t0, note=note))
                continue
            solve_time_s = time.perf_counter() - t0
            p = priced.build_solved(schedule, budget_bytes, solve_time_s, options.compiled)
            made.planned(name, p, budget_bytes)


def _anchor_rows(
    made: _Rows,
    priced: Priced,
    model: torch.nn.Module,
    name: str,
    budgets_bytes: list[int],
    explicit: bool,
) -> None:
    """A row at every budget for anchor ``name``, one plan priced at each; a model without
    what the anchor checkpoints gets rows saying so (an error, when the anchor was asked for
    by name: ``explicit``)."""
    made.bar.set_description(name)
    t0 = time.perf_counter()
    try:
        anchored = anchor(name, priced, model)
    except PlannerError as e:  # no repeated blocks; a layer HF wraps is no region
        if explicit:
            raise
        note = str(e).splitlines()[0]
        for budget_bytes in budgets_bytes:
            made.rows.append(_infeasible(name, budget_bytes, 0.0, note=note))
        made.bar.update(len(budgets_bytes))
        return
    solve_time_s = time.perf_counter() - t0
    for budget_bytes in budgets_bytes:
        p = priced.build_solved(anchored.schedule, budget_bytes, solve_time_s, False)
        if p.predicted_peak_bytes > budget_bytes:
            least = p.predicted_peak_bytes
            made.refused(_infeasible(name, budget_bytes, solve_time_s, least=least))
            continue
        made.planned(name, p, budget_bytes, hf=anchored.hf)


def measure_plan(
    p: Plan,
    model: torch.nn.Module,
    example_input: Any,
    loss_fn: LossFn | None = None,
    repeats: int = 3,
) -> Measurement:
    """One real step of ``p`` (``planner.measure``): ``p.module`` for a graph plan; for an
    in-place plan, ``model`` with the plan applied, then removed again (``planner.remove``)."""
    if p.form == "graph":
        return measure_step(p.module, example_input, loss_fn, repeats=repeats)
    p.apply(model)
    try:
        return measure_step(model, example_input, loss_fn, repeats=repeats)
    finally:
        remove(model)


def _row(
    name: str,
    p: Plan,
    budget_bytes: int,
    measured: Measurement | None,
    eager: Measurement | None,
    graph: CostGraph,
) -> Row:
    """The row of a plan ``p`` solver (or anchor) ``name`` made for ``budget_bytes``."""
    return Row(
        solver=name,
        budget_bytes=budget_bytes,
        feasible=p.predicted_peak_bytes <= budget_bytes,
        predicted_peak_bytes=p.predicted_peak_bytes,
        measured_peak_bytes=None if measured is None else measured.peak_bytes,
        recompute_flops_pct=100 * p.predicted_recompute_flops / max(graph.step_flops, 1),
        recompute_time_s=p.predicted_recompute_time_s,
        step_time_ratio=None
        if measured is None or eager is None
        else measured.step_time_s / max(eager.step_time_s, 1e-12),
        solve_time_s=p.solve_time_s,
        note="" if name == p.solver else f"chose {p.solver}",
        predicted_step_time_s=p.predicted_step_time_s,
        measured_step_time_s=None if measured is None else measured.step_time_s,
        offload_bytes=0 if p.simulation is None else p.simulation.offload_bytes,
        other_predictions=p.predictions.others(),
        added_time_s=p.predicted_step_time_s - graph.step_time_s,
    )


class _Runs:
    """Measured steps of the rows' plans, each distinct plan run once: the fixed policies
    (uniform, sqrt, the anchors) make the same plan at every budget they fit."""

    def __init__(
        self, model: torch.nn.Module, example_input: Any, loss_fn: LossFn | None, repeats: int
    ) -> None:
        self.model, self.example_input = model, example_input
        self.loss_fn, self.repeats = loss_fn, repeats
        self.done: dict[Any, Measurement] = {}

    def measure(self, p: Plan) -> Measurement:
        key = ("plan", p.form, p.regions)
        if key not in self.done:
            self.done[key] = measure_plan(
                p, self.model, self.example_input, self.loss_fn, self.repeats
            )
        return self.done[key]

    def measure_hf(self, p: Plan) -> Measurement:
        """A step with Hugging Face's own checkpointing on (the ``hf`` anchor's regions)."""
        key = ("hf", p.regions)
        if key not in self.done:
            with hf_enabled(self.model):
                self.done[key] = measure_step(
                    self.model, self.example_input, self.loss_fn, repeats=self.repeats
                )
        return self.done[key]


def _infeasible(
    solver: str, budget_bytes: int, solve_time_s: float, least: int | None = None, note: str = ""
) -> Row:
    return Row(
        solver=solver,
        budget_bytes=budget_bytes,
        feasible=False,
        predicted_peak_bytes=None,
        measured_peak_bytes=None,
        recompute_flops_pct=None,
        step_time_ratio=None,
        solve_time_s=solve_time_s,
        least_feasible_bytes=least,
        note=note,
    )
