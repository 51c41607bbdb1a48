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
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from planner.anchors import anchor, check_anchors, default_anchors, hf_enabled
from planner.calibration import Calibration
from planner.devices import DeviceProfile
from planner.fsdp import FSDPConfig
from planner.inplace import remove
from planner.inplace_form import SPAN_SOLVERS
from planner.measurement import Measurement
from planner.measurement import measure as measure_step
from planner.passes.step import LossFn
from planner.planning import PlanOptions
from planner.plans import GB, Plan, gb_to_bytes
from planner.plots import plot_pareto
from planner.report import (
    data_frame,
    format_bytes,
    format_ms,
    format_quantity,
    natural_width,
    plain_text,
    quantity_label,
)
from planner.solvers.costgraph import CostGraph, Objective
from planner.solvers.errors import InfeasibleBudgetError, PlannerError
from planner.solvers.registry import (
    DEFAULT_TIME_LIMIT_S,
    SOLVERS,
    SharedTimeLimit,
    get_solver,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.table import Table
# Cheap, well-known policies first, then the optimising solvers; unknown ones follow by name.
PREFERRED_ORDER = ("none", "uniform", "sqrt", "revolve", "selective", "sac", "greedy", "dp", "ilp")
DEFAULT_BUDGET_FRACTIONS = (0.8, 0.6, 0.4, 0.2)  # of the predicted eager peak
# What a console too narrow for the whole table shows (Comparison.__rich_console__)
NARROW_COLUMNS = ("solver", "budget", "feasible", "predicted peak", "predicted step")


@dataclass(frozen=True)
class Row:
    """One (solver, budget) result. Infeasible rows carry the least feasible budget instead."""

    solver: str
    budget_bytes: int
    feasible: bool
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    recompute_flops_pct: float | None  # extra forward FLOPs as % of one eager fwd+bwd step
    step_time_ratio: float | None  # measured step time / the unmodified model's
    solve_time_s: float
    least_feasible_bytes: int | None = None
    note: str = ""
    recompute_time_s: float | None = None  # predicted, the recomputation alone
    # forward + backward + what checkpointing adds (Plan's)
    predicted_step_time_s: float | None = None
    measured_step_time_s: float | None = None
    offload_bytes: int = 0  # predicted bytes its offload regions send to host
    # the plan's predictions that have no column above, (name, value): plans.Predictions.others
    other_predictions: tuple[tuple[str, float], ...] = ()
    # Predicted seconds checkpointing adds to the step: recomputation, each region's
    # bookkeeping, exposed offload transfers. What dp and ilp minimise; tables and plots rank
    # by it (a plan can recompute less than dp's and still add more).
    added_time_s: float | None = None


@dataclass(frozen=True)
class Comparison:
    """Rows of ``compare()`` plus the eager reference they are judged against."""

    rows: tuple[Row, ...]
    eager_predicted_peak_bytes: int
    eager_measured_peak_bytes: int | None
    eager_step_time_s: float | None
    step_flops: int
    estimate_time_s: float
    # (solver, budget_bytes) -> plan for each feasible row, to inspect or train one of them.
    plans: Mapping[tuple[str, int], Plan] = field(default_factory=dict, repr=False, compare=False)
    form: str = "graph"  # of the plans: "inplace" (p.apply(model)) or "graph" (p.module)

    def plan(self, solver: str, budget_gb: float) -> Plan:
        """The plan a feasible row made (budget in decimal GB, as given to ``compare``)."""
        key = (solver, gb_to_bytes(budget_gb))
        if key not in self.plans:
            made = ", ".join(f"{s} @ {b / GB:g} GB" for s, b in self.plans)
            raise KeyError(f"no feasible plan for {solver!r} at {budget_gb} GB; made: {made}")
        return self.plans[key]

    def to_pandas(self) -> Any:
        """The rows as a ``pandas.DataFrame`` (pandas is an optional dependency); other
        predictions a column each, by name."""
        frame = data_frame(self.rows, "Comparison.to_pandas()")
        others = frame.pop("other_predictions") if len(frame) else []
        for name in self._other_names():
            frame[f"predicted_{name}"] = [dict(o).get(name) for o in others]
        return frame

    def _other_names(self) -> list[str]:
        return list(dict.fromkeys(n for r in self.rows for n, _ in r.other_predictions))

    def ranked(self) -> list[Row]:
        """Rows by budget (as given), and within one budget by the predicted time checkpointing
        adds to the step, least first (what dp minimises); rows that do not fit come last."""
        budgets = list(dict.fromkeys(r.budget_bytes for r in self.rows))
        return sorted(
            self.rows,
            key=lambda r: (
                budgets.index(r.budget_bytes),
                not r.feasible,
                r.added_time_s if r.added_time_s is not None else float("inf"),
            ),
        )

    def _cells(self) -> tuple[list[Row], list[str], list[list[str]]]:
        measured = any(r.measured_peak_bytes is not None for r in self.rows)
        header = ["solver", "budget", "feasible", "predicted peak"]
        header += ["measured peak", "step time ratio"] if measured else []
        header += ["predicted step"] + (["measured step"] if measured else [])
        header += ["added time", "recompute time", "recompute FLOPs", "solve time"]
        offloads = any(r.offload_bytes for r in self.rows)
        header += ["offloaded"] if offloads else []
        others = self._other_names()
        header += [quantity_label(n) for n in others]
        rows = self.ranked()
        body = []
        for r in rows:
            solver = r.solver
            if r.note.startswith("chose "):  # 'auto' names the solver it picked
                solver += f" ({r.note.removeprefix('chose ')})"
            if r.feasible:
                cells = [solver, _mib(r.budget_bytes), "yes", _mib(r.predicted_peak_bytes)]
                if measured:
                    cells += [_mib(r.measured_peak_bytes), _ratio(r.step_time_ratio)]
                cells += [_ms(r.predicted_step_time_s)]
                cells += [_ms(r.measured_step_time_s)] if measured else []
                cells += [_ms(r.added_time_s), _ms(r.recompute_time_s)]
                cells += [f"+{r.recompute_flops_pct:.1f}%", f"{r.solve_time_s:.2f} s"]
                cells += [_mib(r.offload_bytes)] if offloads else []
                own = dict(r.other_predictions)
                cells += ["-" if n not in own else format_quantity(n, own[n]) for n in others]
            else:
                least = (
                    f"no: least {_mib(r.least_feasible_bytes)}"
                    if r.least_feasible_bytes is not None
                    else f"no: {r.note}"
                )
                cells = [solver, _mib(r.budget_bytes), least, "-"]
                cells += ["-", "-"] if measured else []
                cells += ["-"] + (["-"] if measured else [])
                cells += ["-", "-", "-", f"{r.solve_time_s:.2f} s"]
                cells += ["-"] if offloads else []
                cells += ["-"] * len(others)
            body.append(cells)
        return rows, header, body

    def _caption(self) -> str:
        text = f"eager step: predicted peak {_mib(self.eager_predicted_peak_bytes)}"
        if self.eager_measured_peak_bytes is not None:
            text += f", measured peak {_mib(self.eager_measured_peak_bytes)}"
        if self.eager_step_time_s is not None:
            text += f", step time {self.eager_step_time_s * 1e3:,.1f} ms"
        text += f"; {self.step_flops / 1e9:,.2f} GFLOPs per step"
        return (
            text
            + "; added time (what checkpointing adds: recomputation and each region's bookkeeping),"
            " recompute time and predicted step: the step-time model (op timings or a roofline)"
        )

    def to_markdown(self) -> str:
        """A GitHub markdown table, with the eager reference as its first line."""
        _, header, body = self._cells()
        lines = [self._caption(), "", "| " + " | ".join(header) + " |"]
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines) + "\n"

    def table(self) -> Table:
        """The whole table, every column, as a ``rich.table.Table``."""
        return self._table(*self._cells())

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        """The whole table where it fits the console; else its NARROW_COLUMNS alone and a line
        that says where the rest is (an 80-column terminal crops the whole table's 10 to 15
        columns past reading)."""
        rows, header, body = self._cells()
        table = self._table(rows, header, body)
        if natural_width(table) <= options.max_width:
            yield table
            return
        keep = [i for i, column in enumerate(header) if column in NARROW_COLUMNS]
        narrow = [[cells[i] for i in keep] for cells in body]
        yield self._table(rows, [header[i] for i in keep], narrow)
        yield (
            f"{len(header) - len(keep)} more columns in a wider console, print(comparison) "
            "or comparison.to_markdown()"
        )

    def _table(self, rows: list[Row], header: list[str], body: list[list[str]]) -> Table:
        from rich.table import Table

        title = f"planner.compare ({'in place' if self.form == 'inplace' else 'graph form'})"
        table = Table(title=title, caption=self._caption(), title_justify="left")
        for column in header:
            left = column in ("solver", "feasible")
            table.add_column(column, justify="left" if left else "right")
        for r, cells in zip(rows, body):
            table.add_row(*cells, style=None if r.feasible else "dim")
        return table

    def print_table(self, console: Any = None) -> None:
        """Print the table to the terminal (or to the given ``rich.console.Console``)."""
        from rich.console import Console

        (console or Console()).print(self)

    def __str__(self) -> str:
        return plain_text(self.table(), width=200)

    def plot(self, *, ax: Any = None) -> Figure:
        """Peak memory vs the predicted time checkpointing adds to the step: each solver's
        front, eager, the budgets."""
        return plot_pareto(self, ax=ax)


def _mib(n_bytes: int | None) -> str:
    return "-" if n_bytes is None else format_bytes(n_bytes)


def _ms(time_s: float | None) -> str:
    return "-" if time_s is None else format_ms(time_s)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


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
    if budgets_gb is not None:
        budgets_bytes = [gb_to_bytes(gb) for gb in budgets_gb]
        if not budgets_bytes or min(budgets_bytes) <= 0:
            raise ValueError(f"budgets_gb must be positive numbers of GB, got {budgets_gb!r}")
    fractions = tuple(budget_fractions or DEFAULT_BUDGET_FRACTIONS)
    if budgets_gb is not None and budget_fractions is not None:
        raise ValueError("give budgets_gb or budget_fractions, not both")
    if not all(f > 0 for f in fractions):
        raise ValueError(f"budget_fractions must be positive, got {budget_fractions!r}")
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
        if budgets_gb is None:
            budgets_bytes = [round(f * eager_predicted) for f in fractions]

        eager = None
        if measure:
            bar.set_description("measure eager")
            eager = measure_step(model, example_input, loss_fn, repeats=repeats)
        step_flops = max(priced.graph.step_flops, 1)

        rows: list[Row] = []
        plans: dict[tuple[str, int], Plan] = {}
        runs = _Runs(model, example_input, loss_fn, repeats)
        limit = SharedTimeLimit.starting_now(time_limit_s)
        solves_left = len(names) * len(budgets_bytes)
        # A search's share counts the searches left alone: the quick solvers use milliseconds
        # of theirs, and dp's first solve, which the later budgets read (solved_once), got a
        # twenty-fourth of the limit and was cut short on a slow machine.
        searching = {n: get_solver(n).options.searches for n in names}
        searches_left = sum(searching.values()) * len(budgets_bytes)
        for budget_bytes in budgets_bytes:
            for name in names:
                bar.set_description(f"{name} @ {_mib(budget_bytes)}")
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
                    rows.append(
                        _infeasible(name, budget_bytes, time.perf_counter() - t0, least=e.min_bytes)
                    )
                    bar.update()
                    continue
                except PlannerError as e:  # e.g. a solver that does not handle this graph
                    rows.append(
                        _infeasible(
                            name,
                            budget_bytes,
                            time.perf_counter() - t0,
                            note=str(e).splitlines()[0],
                        )
                    )
                    bar.update()
                    continue
                solve_time_s = time.perf_counter() - t0
                p = priced.build_solved(schedule, budget_bytes, solve_time_s, options.compiled)
                measured = None
                if eager is not None:
                    measured = runs.measure(p)
                rows.append(_row(name, p, budget_bytes, measured, eager, priced.graph))
                plans[(name, budget_bytes)] = p
                bar.update()
        for name in anchor_names:
            bar.set_description(name)
            t0 = time.perf_counter()
            try:
                made = anchor(name, priced, model)
            except PlannerError as e:  # no repeated blocks; a layer HF wraps is no region
                if explicit_anchors:
                    raise
                note = str(e).splitlines()[0]
                for budget_bytes in budgets_bytes:
                    rows.append(_infeasible(name, budget_bytes, 0.0, note=note))
                bar.update(len(budgets_bytes))
                continue
            solve_time_s = time.perf_counter() - t0
            for budget_bytes in budgets_bytes:
                p = priced.build_solved(made.schedule, budget_bytes, solve_time_s, False)
                if p.predicted_peak_bytes > budget_bytes:
                    least = p.predicted_peak_bytes
                    rows.append(_infeasible(name, budget_bytes, solve_time_s, least=least))
                    bar.update()
                    continue
                measured = None
                if eager is not None:
                    measured = runs.measure_hf(p) if made.hf else runs.measure(p)
                rows.append(_row(name, p, budget_bytes, measured, eager, priced.graph))
                plans[(name, budget_bytes)] = p
                bar.update()
    finally:
        bar.close()
    return Comparison(
        rows=tuple(rows),
        eager_predicted_peak_bytes=eager_predicted,
        eager_measured_peak_bytes=None if eager is None else eager.peak_bytes,
        eager_step_time_s=None if eager is None else eager.step_time_s,
        step_flops=priced.graph.step_flops,
        estimate_time_s=estimate_time_s,
        plans=plans,
        form=form,
    )


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
