"""Pictures of a plan and of a comparison (matplotlib).

- :func:`plot_timeline`: predicted live bytes over one step (forward, recomputation, backward)
  from ``plan.simulation.timeline``, checkpoint regions shaded, the budget and the
  no-checkpointing peak as lines; a measured timeline overlaid when one is given.
- :func:`plot_nodes`: per node, the bytes it keeps for backward against the bytes a region
  drops (recomputed or offloaded), with attention and skip-connection nodes marked.
- :func:`plot_pareto`: a Comparison's memory/recompute-time trade-off, one front per solver.

Every function returns a ``matplotlib.figure.Figure`` built without pyplot, so nothing depends
on a display or on the global backend (it renders with Agg on ``savefig``); in a notebook the
returned figure shows itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from matplotlib.figure import Figure

from planner.plans import Plan
from planner.report import dropping_region
from planner.solvers.costgraph import CostGraph
from planner.solvers.costgraph import Region as Span

MIB = 2**20
PHASE_COLOURS = {"fwd": "tab:blue", "recompute": "tab:orange", "bwd": "tab:green"}


def _runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Contiguous runs [first, last] of sorted integers."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _spans(plan: Plan) -> list[Span]:
    return sorted(plan.schedule.regions, key=lambda r: (r.start, -r.stop))


def plot_timeline(plan: Plan, measured: Any = None, *, ax: Any = None) -> Figure:
    """Predicted live memory (MiB) at every event of one step, regions shaded.

    ``measured``: a ``planner.Measurement`` (or its ``timeline``) of the same step; its
    samples are stretched over the same axis (the two count events differently, so only the
    shape and the levels are comparable, not the exact positions).
    """
    fig, ax = _figure_and_axes(ax, (11, 4))
    events = [event for event, _ in plan.simulation.timeline]
    live_mib = [live / MIB for _, live in plan.simulation.timeline]
    x = list(range(len(events)))
    index = {node.name: i for i, node in enumerate(plan.graph.nodes)}
    node_of = [index.get(event.split(":", 1)[1], -1) for event in events]

    # Shade where regions run: their forward, their recomputation and their backward.
    # Neighbouring regions alternate shades so that their boundaries show.
    for k, span in enumerate(_spans(plan)):
        inside = [e for e, i in enumerate(node_of) if span.start <= i < span.stop]
        colour = "tab:purple" if span.kind == "offload" else "tab:gray"
        alpha = 0.07 + 0.07 * (k % 2) + 0.08 * span.depth
        for first, last in _runs(inside):
            ax.axvspan(first - 0.5, last + 0.5, color=colour, alpha=alpha, lw=0, gid="region")

    # Colour the area under the curve by phase, one filled staircase per run of a phase.
    # The RNG stash a recomputation takes at a nested checkpoint (recompute-stash) is part of it.
    phases = [event.split(":", 1)[0].removesuffix("-stash") for event in events]
    labelled: set[str] = set()
    start = 0
    for e in range(1, len(events) + 1):
        if e < len(events) and phases[e] == phases[start]:
            continue
        phase = phases[start]
        ax.stairs(
            live_mib[start:e],
            [k - 0.5 for k in range(start, e + 1)],
            fill=True,
            color=PHASE_COLOURS.get(phase, "tab:gray"),
            alpha=0.4,
            label=None if phase in labelled else phase,
        )
        labelled.add(phase)
        start = e
    ax.plot(x, live_mib, color="black", lw=0.8, label="predicted")

    measured_timeline = getattr(measured, "timeline", measured)
    if measured_timeline:
        first_bwd = next((e for e, ev in enumerate(events) if not ev.startswith("fwd:")), 0)
        xs, mib = _align_measured(measured_timeline, first_bwd, len(events))
        ax.plot(xs, mib, color="tab:red", lw=1, ls="--", label="measured")

    ax.axhline(plan.budget_bytes / MIB, color="tab:red", lw=1, ls=":", label="budget")
    ax.axhline(
        plan.baseline_peak_bytes / MIB, color="gray", lw=1, ls="-.", label="no checkpointing"
    )
    peak_x = events.index(plan.simulation.peak_event) if plan.simulation.peak_event in events else 0
    ax.annotate(
        f"peak {plan.predicted_peak_bytes / MIB:,.1f} MiB\n{plan.simulation.peak_event}",
        (peak_x, plan.predicted_peak_bytes / MIB),
        fontsize=8,
        xytext=(5, 5),
        textcoords="offset points",
    )
    ax.set_xlabel("event of one training step (forward, recompute, backward)")
    ax.set_ylabel("live bytes above baseline (MiB)")
    ax.set_title(f"memory over one step: solver {plan.solver!r}, {len(plan.regions)} regions")
    ax.set_xlim(-0.5, max(len(events) - 0.5, 0.5))
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def _align_measured(
    timeline: Sequence[tuple[str, int]], pred_bwd_x: int, n_events: int
) -> tuple[list[float], list[float]]:
    """Stretch measured samples (label "phase:what", live bytes) over the predicted event axis.

    The two count events differently (one per aten op vs one per graph node), so forward (and
    loss) samples are spread over the predicted forward events and backward samples over the
    rest: levels and shape compare, exact positions do not.
    """
    mib = [live / MIB for _, live in timeline]
    labels = [str(label) for label, _ in timeline]
    split = next((k for k, lab in enumerate(labels) if lab.startswith("backward")), len(labels))
    xs: list[float] = []
    for lo, hi, x0, x1 in (
        (0, split, 0, pred_bwd_x - 0.5),
        (split, len(labels), pred_bwd_x - 0.5, n_events - 1),
    ):
        n = hi - lo
        xs += [x0 + (x1 - x0) * (k / max(n - 1, 1)) for k in range(n)]
    return xs, mib


def node_bytes(graph: CostGraph, spans: Sequence[Span]) -> list[tuple[int, int, int]]:
    """Per node: (kept, recomputed, offloaded) bytes of the storages it allocates for backward.

    What is dropped (``report.dropping_region``, as the summary counts it) is recomputed, or
    held on the host for an offload region.
    """
    out = [[0, 0, 0] for _ in graph.nodes]
    for t in graph.tensors:
        if not t.saved_by:
            continue
        region = dropping_region(t, spans)
        column = 0 if region is None else 2 if region.kind == "offload" else 1
        out[t.producer][column] += t.size_bytes
    return [(k, r, o) for k, r, o in out]


def plot_nodes(plan: Plan, *, ax: Any = None) -> Figure:
    """Per-node strip: bytes kept for backward vs bytes recomputed (or offloaded)."""
    fig, ax = _figure_and_axes(ax, (11, 3.5))
    graph = plan.graph
    spans = _spans(plan)
    per_node = node_bytes(graph, spans)
    x = list(range(len(graph.nodes)))
    kept = [k / MIB for k, _, _ in per_node]
    recomputed = [r / MIB for _, r, _ in per_node]
    offloaded = [o / MIB for _, _, o in per_node]
    for k, span in enumerate(spans):
        alpha = 0.07 + 0.07 * (k % 2) + 0.08 * span.depth
        ax.axvspan(span.start - 0.5, span.stop - 0.5, color="tab:gray", alpha=alpha, lw=0)
    ax.bar(x, kept, width=1.0, color="tab:blue", label="kept for backward")
    ax.bar(x, recomputed, width=1.0, bottom=kept, color="tab:orange", label="recomputed")
    if any(offloaded):
        bottom = [k + r for k, r in zip(kept, recomputed)]
        ax.bar(x, offloaded, width=1.0, bottom=bottom, color="tab:purple", label="offloaded")
    top = max([k + r + o for k, r, o in zip(kept, recomputed, offloaded)] + [1e-9])
    for tag, marker, colour in (("attention", "v", "tab:red"), ("skip", "s", "tab:green")):
        marked = [i for i, n in enumerate(graph.nodes) if tag in n.tags]
        if marked:
            ax.scatter(
                marked,
                [top * 1.08] * len(marked),
                marker=marker,
                s=14,
                color=colour,
                label=f"{tag} nodes",
                zorder=3,
            )
    ax.set_xlim(-0.5, len(graph.nodes) - 0.5)
    ax.set_ylim(0, top * 1.2)
    ax.set_xlabel("node (graph order)")
    ax.set_ylabel("bytes saved for backward (MiB)")
    kept_total, dropped_total = sum(kept), sum(recomputed) + sum(offloaded)
    ax.set_title(
        f"per node: {kept_total:,.1f} MiB kept, {dropped_total:,.1f} MiB dropped by "
        f"{len(spans)} regions (shaded)"
    )
    ax.legend(loc="upper right", fontsize=8, ncol=4)
    return fig


class Rows(Protocol):
    """What :func:`plot_pareto` reads of a ``planner.Comparison`` (by shape: ``comparison``
    draws itself with this module, so this module does not import it back)."""

    @property
    def rows(self) -> Sequence[Any]: ...  # comparison.Row

    @property
    def eager_predicted_peak_bytes(self) -> int: ...

    @property
    def eager_measured_peak_bytes(self) -> int | None: ...

    @property
    def eager_step_time_s(self) -> float | None: ...


def pareto_front(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (peak, cost) no other point beats on both, sorted by peak."""
    front: list[tuple[float, float]] = []
    for peak, cost in sorted(set(points), key=lambda p: (p[0], p[1])):
        if not front or cost < front[-1][1]:
            front.append((peak, cost))
    return front


def plot_pareto(comparison: Rows, *, ax: Any = None) -> Figure:
    """Peak memory vs the time checkpointing adds to the step (ms), every feasible row, a front
    per solver (anchors included), eager as a star, the budgets as dotted lines.

    Predicted: the predicted peak vs the predicted added time (recomputation and each region's
    bookkeeping, ``Row.added_time_s``): time, not FLOPs, as it is what the solvers minimise (a
    solver called optimal is lowest here at its budget). When the comparison measured its rows
    (``measure=True``) a second panel beside it shows the same rows measured: measured peak vs
    measured step time over the unmodified model's. ``ax``: draw the predicted panel alone there.
    """
    feasible = [r for r in comparison.rows if r.feasible and r.added_time_s is not None]
    eager_step_s = getattr(comparison, "eager_step_time_s", None)
    measured = (
        ax is None
        and bool(feasible)
        and all(r.measured_peak_bytes is not None for r in feasible)
        and all(r.measured_step_time_s is not None for r in feasible)
        and eager_step_s is not None
    )
    if ax is not None:
        fig = ax.figure
    else:
        fig = Figure(figsize=(14 if measured else 8, 5), layout="constrained")
        ax = fig.add_subplot(1, 2 if measured else 1, 1)
    _draw_pareto(
        ax,
        comparison,
        feasible,
        lambda r: (r.predicted_peak_bytes / MIB, r.added_time_s * 1e3),
        comparison.eager_predicted_peak_bytes,
        "predicted",
    )
    if measured:
        _draw_pareto(
            fig.add_subplot(1, 2, 2),
            comparison,
            feasible,
            lambda r: (
                r.measured_peak_bytes / MIB,
                (r.measured_step_time_s - eager_step_s) * 1e3,
            ),
            comparison.eager_measured_peak_bytes or comparison.eager_predicted_peak_bytes,
            "measured",
        )
    return fig


def _draw_pareto(
    ax: Any,
    comparison: Rows,
    feasible: Sequence[Any],
    point: Any,
    eager_bytes: int,
    kind: str,
) -> None:
    """One panel of :func:`plot_pareto`: ``point(row)`` is its (MiB, ms)."""
    solvers = list(dict.fromkeys(r.solver for r in comparison.rows))
    for k, solver in enumerate(solvers):
        points = [point(r) for r in feasible if r.solver == solver]
        if not points:
            continue
        colour = f"C{k % 10}"
        ax.scatter(*zip(*points), color=colour, s=18, alpha=0.6)
        ax.plot(
            *zip(*pareto_front(points)),
            color=colour,
            marker="o",
            ms=5,
            lw=1.5,
            drawstyle="steps-post",
            label=solver,
        )
    ax.scatter(
        [eager_bytes / MIB],
        [0.0],
        marker="*",
        s=160,
        color="black",
        zorder=4,
        label=f"eager ({eager_bytes / MIB:,.1f} MiB)",
    )
    for j, budget in enumerate(sorted({r.budget_bytes for r in comparison.rows})):
        ax.axvline(budget / MIB, color="gray", ls=":", lw=1, label="budgets" if j == 0 else None)
    ax.set_xlabel(f"{kind} peak of one step (MiB)")
    ax.set_ylabel(
        "predicted time checkpointing adds to a step (ms)"
        if kind == "predicted"
        else "measured step time over eager's (ms)"
    )
    ax.set_title(f"{kind}: memory / recompute trade-off (lower left is better)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=min(-0.03 * ax.get_ylim()[1], ax.get_ylim()[0]))  # eager's star on show
    ax.legend(fontsize=8)


def _figure_and_axes(ax: Any, size: tuple[float, float]) -> tuple[Figure, Any]:
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.add_subplot()
