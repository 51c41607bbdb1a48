"""Human-readable text for a Plan: ``plan.summary()``."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from planner.solvers.costgraph import CostGraph
from planner.solvers.costgraph import Region as Span

if TYPE_CHECKING:
    from planner.planning import Plan


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:,.1f} MiB"


def dropped_bytes(graph: CostGraph, span: Span) -> int:
    """Bytes the region no longer keeps for backward: storages made and saved inside it."""
    return sum(
        t.size_bytes
        for t in graph.tensors
        if t.producer in span
        and t.producer not in span.saved_nodes
        and t.saved_by
        and all(s in span for s in t.saved_by)
    )


def model_parts(graph: CostGraph, span: Span, limit: int = 3) -> str:
    parts: list[str] = []
    for i in range(span.start, span.stop):
        path = graph.nodes[i].module_path
        if path and path not in parts and not any(path.startswith(p + ".") for p in parts):
            parts = [p for p in parts if not p.startswith(path + ".")] + [path]
    shown = ", ".join(parts[:limit])
    return shown + (f", +{len(parts) - limit} more" if len(parts) > limit else "")


def plan_summary(plan: Plan) -> str:
    graph, sim = plan.graph, plan.simulation
    step = max(graph.step_flops, 1)
    saving = 1 - plan.predicted_peak_bytes / max(plan.baseline_peak_bytes, 1)
    lines = [
        f"planner: solver {plan.solver!r}, budget {mib(plan.budget_bytes)} "
        f"({plan.budget_bytes / 1e9:.3f} GB)",
        f"predicted peak {mib(plan.predicted_peak_bytes)} vs {mib(plan.baseline_peak_bytes)} "
        f"without checkpointing ({saving:.1%} less)",
        f"recompute {plan.predicted_recompute_flops / 1e9:,.2f} GFLOPs "
        f"(+{plan.predicted_recompute_flops / step:.1%} of the step's FLOPs), "
        f"~{sim.recompute_time_s * 1e3:,.1f} ms estimated",
    ]
    if plan.schedule.note:
        lines.append(plan.schedule.note)
    table = Table(title=f"{len(plan.regions)} checkpoint regions", title_justify="left")
    for column in ("region", "kind", "depth", "nodes", "covers", "not kept", "recompute"):
        table.add_column(column, justify="right" if column in ("not kept", "recompute") else "left")
    spans = sorted(plan.schedule.regions, key=lambda r: (r.start, -r.stop))
    for region, span in zip(plan.regions, spans):
        table.add_row(
            region.name,
            region.kind,
            str(region.depth),
            str(len(region.nodes)),
            model_parts(graph, span),
            mib(dropped_bytes(graph, span)),
            f"{sum(graph.nodes[i].fwd_flops for i in range(span.start, span.stop)) / 1e9:,.2f} GF",
        )
    out = io.StringIO()
    Console(
        file=out, width=120, force_terminal=False, force_jupyter=False, color_system=None
    ).print(table)
    return "\n".join(lines) + "\n" + out.getvalue()
