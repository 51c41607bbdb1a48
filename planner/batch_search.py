"""``planner.fit_batch``: the micro-batch size (and checkpoints) that trains fastest under a cap.

Checkpointing frees activations, which lets the batch grow, and a larger batch can more than pay
for the recomputation: samples/s = batch size / step time. For each batch size this prices one
training step (the model's own eager step for in-place plans, ``inplace_form.price``, the
default; its captured graph, ``graph_form.price``, for form="graph"), lets a solver find the
fastest plan under the cap (solvers minimise predicted step time), and
predicts its peak and step time; the winner is the largest batch size within 5% of the most
predicted samples per second (``pick``).

Every figure here is a prediction: peaks from ``solvers/simulate.py``, times from the step-time
model (the graph's own ops timed on the model's device, or a device profile's roofline). Every
batch size is priced from the device's one calibration (``planner/calibration.py``): each size
times only its calls on new shapes, and the figures do not follow the load of the moment from
one size to the next. The sizes' solves share one time limit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from planner.batch_sweep import BatchSweep
from planner.calibration import Calibration
from planner.devices import DeviceProfile
from planner.fsdp import FSDPConfig
from planner.passes.step import LossFn
from planner.planning import PlanOptions, budget_bytes_from_gb
from planner.plans import Plan
from planner.priced import Priced
from planner.report import data_frame, format_bytes, format_ms, plain_text
from planner.solvers.costgraph import CostGraph, Objective
from planner.solvers.errors import InfeasibleBudgetError, RecomputeCapError
from planner.solvers.registry import SharedTimeLimit, default_time_limit_s

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.table import Table

# The default sweep doubles from 1 and stops at the first batch size no plan fits, or here.
MAX_BATCH_SIZE = 4096
# In a sweep, each size's solve may take up to 1/SWEEP_SHARES of the shared time left.
SWEEP_SHARES = 3
# The pick: the largest batch size predicted within this share of the most samples/s. Two
# calibrations of one machine price a step a few percent apart (GPT-ref on a shared 2-core VM:
# 5-7%), and where batch sizes run about as fast per sample (GPT-ref's 2, 4 and 8, within 4%)
# the plain maximum picked whichever the last calibration favoured.
PICK_WITHIN = 0.05


@dataclass(frozen=True)
class BatchRow:
    """One batch size. ``fits`` False: no plan fits the cap (``least_bytes`` is the least peak
    any plan reaches); the planned fields are then None."""

    batch_size: int
    fits: bool
    solver: str | None
    regions: int | None
    predicted_peak_bytes: int | None
    predicted_step_time_s: float | None
    samples_per_s: float | None
    least_bytes: int | None  # for a row that does not fit (None: over the FLOPs cap)
    # Without checkpointing, whether or not it fits the cap.
    eager_peak_bytes: int
    eager_step_time_s: float
    eager_samples_per_s: float
    # no fit and no least known: the solver ran out of time before it knew (least_bytes None)
    cut_short: bool = False

    @classmethod
    def of_plan(cls, batch_size: int, p: Plan, eager: Mapping[str, Any]) -> BatchRow:
        """The row of a size plan ``p`` fits; ``eager``: the eager fields."""
        return cls(
            batch_size=batch_size,
            fits=True,
            solver=p.solver,
            regions=len(p.regions),
            predicted_peak_bytes=p.predicted_peak_bytes,
            predicted_step_time_s=p.predicted_step_time_s,
            samples_per_s=batch_size / p.predicted_step_time_s,
            least_bytes=None,
            **eager,
        )

    @classmethod
    def no_fit(
        cls,
        batch_size: int,
        least_bytes: int | None,
        eager: Mapping[str, Any],
        cut_short: bool = False,
    ) -> BatchRow:
        """The row of a size no plan fits; ``eager``: the eager fields."""
        return cls(
            batch_size=batch_size,
            fits=False,
            solver=None,
            regions=None,
            predicted_peak_bytes=None,
            predicted_step_time_s=None,
            samples_per_s=None,
            least_bytes=least_bytes,
            **eager,
            cut_short=cut_short,
        )


@dataclass(frozen=True)
class BatchFit:
    """What ``fit_batch`` found: a row per batch size tried, and the winner's plan."""

    rows: tuple[BatchRow, ...]
    cap_bytes: int
    device: str
    best_batch_size: int
    # batch size -> its plan, for every row that fits
    plans: Mapping[int, Plan] = field(repr=False, compare=False)

    @property
    def plan(self) -> Plan:
        """The winner's plan: ``save()`` it, or carry it out at the winner's batch
        (``plan.apply(model)`` in place; ``plan.module`` in the graph form)."""
        return self.plans[self.best_batch_size]

    @property
    def best(self) -> BatchRow:
        return next(r for r in self.rows if r.batch_size == self.best_batch_size)

    def to_pandas(self) -> Any:
        """The rows as a ``pandas.DataFrame`` (pandas is an optional dependency)."""
        return data_frame(self.rows, "BatchFit.to_pandas()")

    def __rich__(self) -> Table:
        from rich.table import Table

        table = Table(
            title=f"planner.fit_batch: cap {format_bytes(self.cap_bytes)} "
            f"({self.cap_bytes / 1e9:.3f} GB), device {self.device}",
            caption=f"best: batch {self.best_batch_size}, "
            f"{self.best.samples_per_s:,.1f} samples/s (predicted)",
            title_justify="left",
        )
        for column in (
            "batch",
            "solver",
            "regions",
            "predicted peak",
            "step time",
            "samples/s",
            "no checkpointing: peak",
            "step time ",
            "samples/s ",
        ):
            table.add_column(column, justify="left" if column == "solver" else "right")
        for r in self.rows:
            eager_fits = r.eager_peak_bytes <= self.cap_bytes
            eager = [
                format_bytes(r.eager_peak_bytes) + ("" if eager_fits else " (over)"),
                format_ms(r.eager_step_time_s),
                f"{r.eager_samples_per_s:,.1f}" if eager_fits else "-",
            ]
            if r.fits:
                planned = [
                    r.solver or "",
                    str(r.regions),
                    format_bytes(r.predicted_peak_bytes or 0),
                    format_ms(r.predicted_step_time_s or 0.0),
                    f"{r.samples_per_s:,.1f}",
                ]
            else:
                why = (
                    f"least {format_bytes(r.least_bytes)}"
                    if r.least_bytes is not None
                    else "solver out of time"
                    if r.cut_short
                    else "over the FLOPs cap"
                )
                planned = [f"no fit: {why}", "-", "-", "-", "-"]
            mark = " *" if r.batch_size == self.best_batch_size else ""
            table.add_row(
                f"{r.batch_size}{mark}", *planned, *eager, style=None if r.fits else "dim"
            )
        return table

    def __str__(self) -> str:
        return plain_text(self, width=160)

    def plot(self) -> Figure:
        """Predicted samples/s and peak against batch size, with and without checkpointing."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 4), layout="constrained")
        speed, memory = fig.subplots(1, 2)
        sizes = [r.batch_size for r in self.rows]
        fit = [r for r in self.rows if r.fits]
        eager_fit = [r for r in self.rows if r.eager_peak_bytes <= self.cap_bytes]
        speed.plot(
            [r.batch_size for r in fit],
            [r.samples_per_s for r in fit],
            "o-",
            label="planner (fits the cap)",
        )
        speed.plot(
            [r.batch_size for r in eager_fit],
            [r.eager_samples_per_s for r in eager_fit],
            "s--",
            label="no checkpointing (fits the cap)",
        )
        best = self.best
        speed.scatter(
            [best.batch_size], [best.samples_per_s], s=150, marker="*", color="black", zorder=4
        )
        speed.set_ylabel("predicted samples/s")
        speed.set_title(f"throughput on {self.device} (predicted)")
        memory.plot(
            [r.batch_size for r in fit],
            [r.predicted_peak_bytes / 2**30 for r in fit],
            "o-",
            label="planner",
        )
        memory.plot(
            sizes, [r.eager_peak_bytes / 2**30 for r in self.rows], "s--", label="no checkpointing"
        )
        memory.axhline(self.cap_bytes / 2**30, color="red", lw=1, label="cap")
        memory.set_ylabel("predicted peak of one step (GiB)")
        memory.set_title("memory (predicted)")
        for ax in (speed, memory):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("micro-batch size")
            ax.legend(fontsize=8)
        return fig


def doubling(start: int = 1, stop: int = MAX_BATCH_SIZE) -> Iterable[int]:
    """1, 2, 4, ... up to ``stop``."""
    return itertools.takewhile(lambda b: b <= stop, (start << k for k in itertools.count()))


def pick(rows: Sequence[BatchRow]) -> int:
    """The batch size to train with of these fitting rows: the largest predicted within
    PICK_WITHIN of the most samples/s."""
    most = max(r.samples_per_s or 0.0 for r in rows)
    return max(r.batch_size for r in rows if (r.samples_per_s or 0.0) >= (1 - PICK_WITHIN) * most)


def fit_batch(
    model: torch.nn.Module,
    make_input: Callable[[int], Any],
    mem_budget_gb: float,
    batch_sizes: Sequence[int] | None = None,
    solver: str = "auto",
    device: str | DeviceProfile | None = None,
    *,
    loss_fn: LossFn | None = None,
    max_batch_size: int = MAX_BATCH_SIZE,
    form: str = "inplace",
    objective: Objective = "time",
    max_recompute_flops_fraction: float | None = None,
    fsdp: FSDPConfig | None = None,
    calibration: Calibration | str | Path | None = None,
    compiled: bool = False,
    autocast: torch.dtype | None = None,
    progress: bool = True,
    **solver_opts: Any,
) -> BatchFit:
    """Find the micro-batch size with the most predicted samples/s whose step fits the cap:
    the largest within PICK_WITHIN (5%) of the most, as calibrations differ by that much.

    ``make_input(batch_size)`` returns the example input for that batch size. ``batch_sizes``:
    the sizes to try; None doubles from 1 (1, 2, 4, ...) and stops at the first size even the
    least-memory plan cannot fit (or at ``max_batch_size``). ``mem_budget_gb``: the cap on one
    step's peak, in decimal GB, as for ``planner.plan``. ``device``: whose time to predict, as
    for ``planner.plan`` (None: the model's own device, its ops timed there). ``form``: the
    plans' form, as for ``planner.plan``: "inplace" (apply the winner to your model with
    ``fit.plan.apply(model)``) or "graph" (train ``fit.plan.module``). ``objective``,
    ``max_recompute_flops_fraction``, ``fsdp`` (in place only; ``make_input`` then returns one
    rank's micro-batch) and ``solver_opts``: as for ``planner.plan``, for every batch size.
    ``compiled``, ``autocast``: as for ``planner.plan``. ``calibration``: as for
    ``planner.plan``: pin the device calibration every size is priced with. ``time_limit_s``
    (in ``solver_opts``): one limit for all the sizes' solves together (default the solver's
    own), each size taking an equal share of what is left. ``progress``: a progress bar (shown
    once the sweep takes more than a second).

    Raises ``InfeasibleBudgetError`` when no batch size tried fits, with the least budget of
    the smallest one.
    """
    cap_bytes = budget_bytes_from_gb(mem_budget_gb)
    # fail on an unknown solver or option before the slow part
    options = PlanOptions.of(locals()).checked([solver])
    sweep = batch_sizes is None
    sizes = list(doubling(1, max_batch_size)) if sweep else sorted(set(batch_sizes or ()))
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(
            f"batch_sizes must be positive integers, e.g. [1, 2, 4, 8]; got {batch_sizes!r}"
        )
    rows: list[BatchRow] = []
    plans: dict[int, Plan] = {}
    cap_errors: list[RecomputeCapError] = []
    device_name = ""
    limit = SharedTimeLimit.starting_now(default_time_limit_s(solver, solver_opts))
    bar = tqdm(sizes, disable=not progress, delay=1.0, unit="size", desc="fit_batch")
    # each size prices the calls it shares with the last, grown, from the last's
    scaling = BatchSweep()
    for k, b in enumerate(bar):
        bar.set_description(f"fit_batch: batch {b}")
        priced = options.price(model, make_input(b), sweep=scaling)
        device_name = _device_name(priced.graph)
        eager = _eager_columns(priced, b)
        try:
            # a sweep stops at the first size that does not fit, usually long before the
            # list's end: a share of what is left as if at most SWEEP_SHARES sizes remained
            left = len(sizes) - k
            shares = min(left, SWEEP_SHARES) if sweep else left
            with limit.solving():
                p = priced.plan(
                    cap_bytes,
                    solver,
                    **options.solving,
                    **{**solver_opts, "time_limit_s": limit.share_s(shares)},
                )
        except InfeasibleBudgetError as e:
            # min_bytes None: the solver ran out of time before it knew the least
            rows.append(BatchRow.no_fit(b, e.min_bytes, eager, cut_short=e.min_bytes is None))
            if sweep:
                break  # a larger batch needs more still
            continue
        except RecomputeCapError as e:  # fits the cap only by recomputing more than allowed
            cap_errors.append(e)
            rows.append(BatchRow.no_fit(b, None, eager))
            if sweep:
                break  # a larger batch needs more still
            continue
        rows.append(BatchRow.of_plan(b, p, eager))
        plans[b] = p
    bar.close()
    fitting = [r for r in rows if r.fits]
    if not fitting:
        raise _no_fit(rows, cap_errors, cap_bytes)
    return BatchFit(
        rows=tuple(rows),
        cap_bytes=cap_bytes,
        device=device_name,
        best_batch_size=pick(fitting),
        plans=plans,
    )


def _device_name(graph: CostGraph) -> str:
    """Whose time a priced step predicts, and how: its device, ops timed or a roofline."""
    timing = " (ops timed)" if graph.meta["timing"].startswith("ops timed") else " (roofline)"
    return graph.meta.get("device", "") + timing


def _eager_columns(priced: Priced, batch_size: int) -> dict[str, Any]:
    """A row's fields for the step without checkpointing, whether or not it fits the cap."""
    eager_s = priced.graph.step_time_s
    return dict(
        eager_peak_bytes=priced.eager_peak_bytes,
        eager_step_time_s=eager_s,
        eager_samples_per_s=batch_size / eager_s,
    )


def _no_fit(
    rows: Sequence[BatchRow], cap_errors: Sequence[RecomputeCapError], cap_bytes: int
) -> Exception:
    """What ``fit_batch`` raises when no batch size tried fits: the FLOPs cap's error where
    only the cap stood in the way, else an InfeasibleBudgetError about the smallest size."""
    if cap_errors and rows[0].least_bytes is None:
        return cap_errors[0]
    if rows[0].cut_short:
        return InfeasibleBudgetError(
            cap_bytes,
            None,
            f"No batch size fits: at batch size {rows[0].batch_size}, the smallest tried, the "
            f"solver ran out of time before it found a fit or knew the least.",
        )
    first, least = rows[0].batch_size, rows[0].least_bytes or 0
    return InfeasibleBudgetError(
        cap_bytes,
        least,
        f"No batch size fits: batch size {first}, the smallest tried, needs at least "
        f"{format_bytes(least)} ({least / 1e9:.3f} GB).",
    )
