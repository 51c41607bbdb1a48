"""What ``planner.compare`` returns: a :class:`Row` per (solver, budget), gathered in a
:class:`Comparison` that prints as a table (rich, plain text or markdown) and plots its
memory/time front.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import Console, ConsoleOptions, RenderResult
    from rich.table import Table

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
