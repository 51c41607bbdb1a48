"""Human-readable text for a Plan: ``plan.summary()``, and the byte and FLOP units it prints.

Per region, the summary shows what the region frees and what its recomputation costs; the
columns add up exactly to the totals it prints, because both come from one attribution:

- bytes: each storage saved for backward that a plan no longer keeps is charged to the one
  region that drops it (:func:`dropping_region`), so no storage counts twice when regions nest;
- recompute: ``simulate`` charges every ``recompute:<node>`` event of its timeline to
  ``Simulation.recompute_flops`` / ``recompute_time_s``; each event is charged here to the
  innermost region holding that node. A node inside a nested region is run again both by its
  parent's recomputation and by its own; both runs count in the nested region's column.

The bytes freed are not the fall in peak: recomputation holds memory of its own in backward,
and the peak may lie elsewhere; ``simulate`` prices the peak, and the summary prints both.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.passes.regions import ModulePlace, Place, RunPlace, SpanPlace
from planner.plans import Plan
from planner.solvers.costgraph import CostGraph, Region, Tensor
from planner.solvers.simulate import offload_time_s

MIB = 2**20
GIB = 2**30


def format_bytes(n_bytes: float) -> str:
    """Bytes in MiB, or GiB from 1 GiB on; small sizes keep three decimals to stay legible."""
    if abs(n_bytes) >= GIB:
        return f"{n_bytes / GIB:,.2f} GiB"
    mib = n_bytes / MIB
    return f"{mib:,.1f} MiB" if abs(mib) >= 10 else f"{mib:.3f} MiB"


def format_flops(flops: float, unit_flops: float = 1e9) -> str:
    """FLOPs in GFLOPs, or in MFLOPs with ``unit_flops=1e6`` (one unit for a whole table)."""
    name = "GFLOPs" if unit_flops == 1e9 else "MFLOPs"
    return f"{flops / unit_flops:,.3f} {name}"


def format_ms(time_s: float) -> str:
    return f"{time_s * 1e3:,.2f} ms"


def format_quantity(name: str, value: float) -> str:
    """A value by the unit its name ends in (``_bytes``, ``_flops``, ``_s``)."""
    if name.endswith("_bytes"):
        return format_bytes(value)
    if name.endswith("_flops"):
        return format_flops(value)
    if name.endswith("_s"):
        return format_ms(value)
    return f"{value:,}"


def quantity_label(name: str) -> str:
    """A field's name without its unit, in words: ``activation_bytes`` -> ``activation``."""
    for unit in ("_bytes", "_flops", "_s"):
        name = name.removesuffix(unit)
    return name.replace("_", " ")


def dropping_region(t: Tensor, spans: Sequence[Region]) -> Region | None:
    """The region that stops ``t`` being kept for backward, or None when it is still kept.

    A storage is dropped when a region holds its producer and every node that saves it; the
    outermost such region decides (the main forward runs it without saving), unless it is a
    selective region that keeps the producer's output.
    """
    if not t.saved_by:
        return None
    holders = [s for s in spans if t.producer in s and all(u in s for u in t.saved_by)]
    if not holders:
        return None
    outer = min(holders, key=lambda s: s.depth)
    if outer.kind == "selective" and t.producer in outer.saved_nodes:
        return None
    return outer


def dropped_bytes(graph: CostGraph, span: Region) -> int:
    """Bytes ``span`` alone would no longer keep: storages made and saved inside it."""
    return sum(
        t.size_bytes
        for t in graph.tensors
        if t.producer in span
        and t.producer not in span.saved_nodes
        and t.saved_by
        and all(s in span for s in t.saved_by)
    )


@dataclass(frozen=True)
class RegionCost:
    """One summary row: what a region frees and what recomputing it costs (module docstring)."""

    name: str
    kind: str
    freed_bytes: int  # saved storages no longer kept on the device (recomputed or offloaded)
    recompute_flops: int
    recompute_time_s: float
    offload_bytes: int = 0  # an offload region's saves sent to host
    transfer_time_s: float = 0.0  # what its transfers add to the step (simulate's Rule 7)
    # what recomputing the region instead would cost: its nodes' forward time
    recompute_instead_s: float = 0.0


def region_costs(plan: Plan) -> list[RegionCost]:
    """Per region, in ``plan.regions`` order; sums equal the plan's totals (module docstring)."""
    graph = plan.graph
    spans = sorted(plan.schedule.regions, key=lambda r: (r.start, -r.stop))
    freed = dict.fromkeys(spans, 0)
    for t in graph.tensors:
        if (span := dropping_region(t, spans)) is not None:
            freed[span] += t.size_bytes
    flops = dict.fromkeys(spans, 0)
    time_s = dict.fromkeys(spans, 0.0)
    index = {node.name: i for i, node in enumerate(graph.nodes)}
    for event, _ in plan.simulation.timeline:
        phase, _, name = event.partition(":")
        if phase != "recompute":
            continue
        i = index[name]
        innermost = max((s for s in spans if i in s), key=lambda s: s.depth)
        flops[innermost] += graph.nodes[i].fwd_flops
        time_s[innermost] += graph.node_recompute_time_s(i)
    sent = dict(plan.simulation.offloaded)
    costs = []
    for r, s in zip(plan.regions, spans):
        cost = RegionCost(r.name, r.kind, freed[s], flops[s], time_s[s])
        if s.kind == "offload":
            cost = replace(
                cost,
                offload_bytes=sent.get(s, 0),
                transfer_time_s=offload_time_s(graph, s.start, s.stop, sent.get(s, 0)),
                recompute_instead_s=sum(
                    graph.node_recompute_time_s(i) for i in range(s.start, s.stop)
                ),
            )
        costs.append(cost)
    return costs


def module_paths(graph: CostGraph, span: Region) -> list[str]:
    """The model's modules a region covers, outermost paths first, e.g. ``blocks.0``,
    ``blocks.1`` (a module inside another covered one is not repeated)."""
    parts: list[str] = []
    for i in range(span.start, span.stop):
        path = graph.nodes[i].module_path
        if path and path not in parts and not any(path.startswith(p + ".") for p in parts):
            parts = [p for p in parts if not p.startswith(path + ".")] + [path]
    return parts


def model_parts(
    graph: CostGraph, span: Region, limit: int = 3, prefix: str = "", root: Place | None = None
) -> str:
    """``limit`` of :func:`module_paths` with ``prefix`` taken off each, e.g. ``blocks.0,
    blocks.1, +2 more``. ``root``: the module the region is (in place), which stands for every
    path inside it."""
    paths = module_paths(graph, span)
    if root is not None:
        # a run (blocks[0:2]) stands for its children's paths as a module for its own
        heads = (
            tuple(f"{root.path}.{k}".lstrip(".") for k in range(root.start, root.stop))
            if isinstance(root, RunPlace)
            else (root.name,)
        )
        inside = [p for p in paths if p in heads or p.startswith(tuple(f"{h}." for h in heads))]
        paths = [root.name] * bool(inside) + [p for p in paths if p not in inside]
    parts = [p.removeprefix(prefix) for p in paths]
    shown = ", ".join(parts[:limit])
    return shown + (f", +{len(parts) - limit} more" if len(parts) > limit else "")


def shown_name(place: Place, prefix: str) -> str:
    """An in-place region's name without ``prefix``: a module's path, a run's
    (``blocks[0:2]``), a span's parent and, for a span of the root's forward, its ends
    (``(encoder.layers.0.attn..encoder.layers.0.mlp)``, whose ends are paths from the root)."""
    match place:
        case SpanPlace(path="", first=first, last=last):
            return SpanPlace("", first.removeprefix(prefix), last.removeprefix(prefix)).name
        case SpanPlace(path=path):
            return replace(place, path=path.removeprefix(prefix)).name
        case ModulePlace() | RunPlace():
            return place.name.removeprefix(prefix)


def common_path_prefix(paths: Sequence[str]) -> str:
    """The dotted prefix every path in ``paths`` starts with, ending in a dot, e.g.
    ``"model."`` for ``model.layers.0`` and ``model.layers.1.mlp``; "" when there is none or
    only one path.

    It never takes a path whole, and stops before a numeric part (``model.layers.`` would
    leave bare ``0``, ``1.mlp``): what is left still reads as a module path.
    """
    split = [p.split(".") for p in dict.fromkeys(paths) if p]
    if len(split) < 2:
        return ""
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    common = common[: min(len(s) for s in split) - 1]
    while common and _numeric_after(common, split):
        common.pop()
    return ".".join(common) + "." if common else ""


def _numeric_after(common: list[str], split: list[list[str]]) -> bool:
    return any(len(s) > len(common) and s[len(common)].isdigit() for s in split)


def plan_summary(plan: Plan, verbose: bool = False) -> str:
    """The text of ``plan.summary(verbose)``: the totals, notes on how the step was priced,
    then one row per region (:func:`region_table`)."""
    costs = region_costs(plan)
    unit = 1e9 if plan.simulation.recompute_flops >= 1e9 else 1e6  # tiny models stay legible
    lines = _totals(plan, unit) + _pricing_notes(plan) + _region_notes(plan, costs, verbose)
    # An in-place plan's regions are module paths too: one prefix, said once, for both columns
    # (long paths in narrow columns were cut to "model.laye…").
    spans = sorted(plan.schedule.regions, key=lambda r: (r.start, -r.stop))
    paths = [p for span in spans for p in module_paths(plan.graph, span)]
    if plan.form == "inplace":
        paths += [r.place.path if isinstance(r.place, SpanPlace) else r.name for r in plan.regions]
    prefix = common_path_prefix(paths)
    if prefix:
        lines.append(f"module paths below leave out the prefix they share, {prefix!r}")
    table = region_table(plan, costs, unit, prefix, verbose)
    # As wide as the table needs to keep every path on one line, within reason.
    width = min(max(140 if verbose else 120, natural_width(table)), 200)
    text = "\n".join(lines) + "\n" + plain_text(table, width=width)
    if not verbose:
        text += "solver details: plan.summary(verbose=True)\n"
    return text


def _totals(plan: Plan, unit: float) -> list[str]:
    """The budget, the predicted peak, recomputation and step time, in words."""
    graph, sim = plan.graph, plan.simulation
    step_flops = max(graph.step_flops, 1)
    saving = 1 - plan.predicted_peak_bytes / max(plan.baseline_peak_bytes, 1)
    return [
        f"planner: solver {plan.solver!r}, budget {format_bytes(plan.budget_bytes)} "
        f"({plan.budget_bytes / 1e9:.3f} GB)",
        f"predicted peak {format_bytes(plan.predicted_peak_bytes)}, "
        f"{format_bytes(plan.baseline_peak_bytes)} without checkpointing ({saving:.1%} less)",
        f"recompute {format_flops(sim.recompute_flops, unit)} "
        f"(+{sim.recompute_flops / step_flops:.1%} of the step's FLOPs), about "
        f"{format_ms(sim.recompute_time_s)} estimated",
        f"predicted step time {format_ms(sim.step_time_s)}: forward+backward "
        f"{format_ms(graph.step_time_s)} + recompute {format_ms(sim.recompute_time_s)}"
        + (f" + offload {format_ms(sim.offload_time_s)}" if sim.offload_bytes else "")
        + (
            f" + checkpoint bookkeeping {format_ms(sim.overhead_time_s)}"
            if sim.overhead_time_s
            else ""
        )
        + (f" ({graph.meta['device']})" if graph.meta.get("device") else ""),
    ]


def _pricing_notes(plan: Plan) -> list[str]:
    """What the plan was solved and priced under: compile's margin, other predictions, the
    dtypes, the attention kernel, what pricing could not know."""
    graph, lines = plan.graph, []
    if plan.compiled_margin:  # plan(..., compiled=True): planner/compiled.py
        lines.append(
            f"for torch.compile: no nested regions (compile flattens them), planned within "
            f"{format_bytes(plan.budget_bytes * (1 - plan.compiled_margin))}, the budget less "
            f"a {plan.compiled_margin:.0%} margin for what compile adds to the eager prediction"
        )
    others = plan.predictions.others()  # predictions with no line of their own above
    if others:
        lines.append(
            "also predicted: "
            + ", ".join(f"{quantity_label(n)} {format_quantity(n, v)}" for n, v in others)
        )
    if graph.meta.get("page_faults"):  # passes/costing.py: a CPU step's fresh large blocks
        lines.append(graph.meta["page_faults"])
    if graph.meta.get("precision"):  # the dtypes it was priced in: plan as you train
        lines.append(f"priced in {graph.meta['precision']}")
    lines.extend(_attention_lines(graph.meta))
    lifetimes = graph.meta.get("python_lifetimes", "")
    if lifetimes.startswith("unknown"):  # passes/python_lifetimes.py: not on the safe side
        lines.append(
            f"Python's lifetimes are {lifetimes}: a storage a region's caller holds past the "
            f"region may measure above the prediction"
        )
    return lines


def _region_notes(plan: Plan, costs: list[RegionCost], verbose: bool) -> list[str]:
    """What the regions free in all, each offload's transfer against its recomputation, and
    (``verbose``) what the solver said."""
    lines = []
    if plan.regions:
        lines.append(
            f"{len(plan.regions)} regions keep {format_bytes(sum(c.freed_bytes for c in costs))} "
            f"less for backward (recomputed or offloaded instead); the predicted peak counts "
            f"what recomputation needs itself"
        )
    for cost in costs:
        if cost.kind == "offload":
            lines.append(
                f"{cost.name} offloaded {format_bytes(cost.offload_bytes)} to host: transfer "
                f"{format_ms(cost.transfer_time_s)} < recompute "
                f"{format_ms(cost.recompute_instead_s)}"
                if cost.transfer_time_s < cost.recompute_instead_s
                else f"{cost.name} offloaded {format_bytes(cost.offload_bytes)} to host: "
                f"transfer {format_ms(cost.transfer_time_s)}, recompute "
                f"{format_ms(cost.recompute_instead_s)} (chosen for memory, not time)"
            )
    if verbose:
        gap = plan.schedule.gap
        lines.append(
            f"solver: {plan.schedule.note or 'no note'}; optimality gap "
            f"{'unknown' if gap is None else f'{gap:.1%}'}; solved in {plan.solve_time_s:.2f} s "
            f"on {len(plan.graph.nodes)} graph nodes"
        )
    return lines


def region_table(
    plan: Plan, costs: list[RegionCost], unit: float, prefix: str, verbose: bool
) -> Table:
    """One row per region (its name, kind, what it covers, frees and costs to recompute) and
    the totals; module paths without ``prefix``."""
    graph, sim = plan.graph, plan.simulation
    spans = sorted(plan.schedule.regions, key=lambda r: (r.start, -r.stop))
    in_place = plan.form == "inplace"
    columns = ["region", "kind", "covers", "frees", "recompute", "recompute time"]
    offloads = any(c.kind == "offload" for c in costs)
    if offloads:
        columns += ["offloaded", "transfer"]
    body = []
    for region, span, cost in zip(plan.regions, spans, costs):
        cells = [
            "  " * region.depth + (shown_name(region.place, prefix) if in_place else region.name),
            region.kind,
            model_parts(graph, span, prefix=prefix, root=region.place if in_place else None),
            format_bytes(cost.freed_bytes),
            format_flops(cost.recompute_flops, unit),
            format_ms(cost.recompute_time_s),
        ]
        if offloads:
            cells += [format_bytes(cost.offload_bytes), format_ms(cost.transfer_time_s)]
        body.append(cells)
    if plan.regions:
        total = ["total", "", "", format_bytes(sum(c.freed_bytes for c in costs))]
        total += [format_flops(sim.recompute_flops, unit), format_ms(sim.recompute_time_s)]
        if offloads:
            total += [format_bytes(sim.offload_bytes), format_ms(sim.offload_time_s)]
        body.append(total)
    # An in-place region is a module: what it covers is its own path, said once already.
    if in_place and all(c[2] == c[0].strip() for c in body[: len(plan.regions)]):
        columns.pop(2)
        body = [c[:2] + c[3:] for c in body]
    if verbose:
        at = columns.index("kind") + 1
        columns[at:at] = ["depth", "nodes", "kept nodes"]
        for i, region in enumerate(plan.regions):
            body[i][at:at] = [
                str(region.depth),
                str(len(region.nodes)),
                str(len(region.saved_nodes)),
            ]
        if plan.regions:
            body[-1][at:at] = ["", "", ""]
    return _table(f"{len(plan.regions)} checkpoint regions", columns, body, len(plan.regions))


def _table(title: str, columns: list[str], body: list[list[str]], section_at: int) -> Table:
    """A rich table of ``body`` under ``columns``; the totals from row ``section_at`` on."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        numeric = column not in ("region", "kind", "covers")
        # the names are what a user looks up (p.module.<name>): never cut them; paths wrap
        # at their commas, and one longer than its column folds rather than being cut
        table.add_column(
            column,
            justify="right" if numeric else "left",
            no_wrap=column == "region",
            overflow="fold",
        )
    for i, cells in enumerate(body):
        if i == section_at:
            table.add_section()
        table.add_row(*cells)
    return table


def natural_width(renderable: object) -> int:
    """The width ``renderable`` takes when nothing wraps."""
    console = Console(width=10_000, force_terminal=False, force_jupyter=False, color_system=None)
    return console.measure(renderable).maximum  # type: ignore[arg-type]


def plain_text(renderable: object, width: int) -> str:
    """What rich prints for ``renderable`` (a table), as plain text ``width`` columns wide.

    force_jupyter=False: in a notebook rich would display the table instead of returning it.
    """
    out = io.StringIO()
    Console(
        file=out, width=width, force_terminal=False, force_jupyter=False, color_system=None
    ).print(renderable)
    return out.getvalue()


def data_frame(rows: Sequence[object], who: str) -> Any:
    """Dataclass ``rows`` as a ``pandas.DataFrame`` (pandas is an optional dependency; ``who``
    names the method that asked, for the error without it)."""
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            f"{who} needs pandas: pip install pandas "
            "(or install planner with its dev extra: pip install -e '.[dev]')"
        ) from None
    return pd.DataFrame([asdict(r) for r in rows])  # type: ignore[call-overload]


def _attention_lines(meta: dict[str, str]) -> list[str]:
    """The attention kernel priced (passes/attention_kernels.py: as the target device runs
    it, where the plan is for another device than the model's), and what pricing for another
    device could not know."""
    lines = []
    if meta.get("attention"):
        lines.append(f"attention priced {meta['attention']}")
    elif meta.get("sdpa_backend"):
        lines.append(f"attention kernel priced: {meta['sdpa_backend']}")
    lines.extend(meta[key] for key in ("unknown_values", "untied", "unpriced") if meta.get(key))
    return lines
