"""The fixed policies: no checkpointing, every block (uniform), and Chen's sqrt(N) segments."""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.solvers.blocks import grouped, require_blocks, split_note
from planner.solvers.common import finish, segments_to_regions
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.cuts import block_spans, even_cuts
from planner.solvers.registry import SolverOptions, register


@dataclass(frozen=True)
class UniformOptions(SolverOptions):
    """``k``: consecutive blocks per region (None: 1); ``n_segments``: that many regions
    instead of ``k``."""

    k: int | None = None
    n_segments: int | None = None


@register("none")
def solve_none(graph: CostGraph, budget_bytes: float, options: SolverOptions) -> Schedule:
    """No regions: the eager step. Raises if even that exceeds the budget."""
    return finish(graph, budget_bytes, [], "none")


@register("uniform", options=UniformOptions)
def solve_uniform(graph: CostGraph, budget_bytes: float, options: UniformOptions) -> Schedule:
    """Checkpoint every group of ``k`` consecutive blocks (default 1: every block).

    Blocks are the graph's repeated modules (``blocks.3``); without them, the graph is split
    into segments at cheap cuts. ``n_segments`` asks for that many regions instead of ``k``.
    Nodes before the first and after the last block (embedding, head, loss) stay as they are.
    In place the blocks are the model's repeated module calls (``solvers/blocks.py``).
    """
    k, n_segments = options.k, options.n_segments
    if graph.region_spans is not None:
        blocks = require_blocks(graph, "uniform")
        if n_segments is not None:
            k = math.ceil(len(blocks) / max(1, n_segments))
        k = max(1, k or 1)
        regions, split = grouped(graph, blocks, k)
        note = f"{len(blocks)} blocks, {k} per region{split_note(split, k)}"
        return finish(graph, budget_bytes, regions, "uniform", note)
    spans = block_spans(graph)
    if spans:
        bounds = [spans[0][0]] + [stop for _, stop in spans]
        if n_segments is not None:
            k = math.ceil((len(bounds) - 1) / max(1, n_segments))
    else:
        bounds = even_cuts(graph, n_segments or 4)
    regions = segments_to_regions(bounds, max(1, k or 1))
    return finish(graph, budget_bytes, regions, "uniform")


@register("sqrt")
def solve_sqrt(graph: CostGraph, budget_bytes: float, options: SolverOptions) -> Schedule:
    """Chen et al. 2016: about sqrt(N) regions of about sqrt(N) units each.

    Units are the repeated blocks when there are any (so a region never splits a block),
    otherwise nodes, split at the cheapest cuts near even spacing. In place, the model's
    repeated module calls (``solvers/blocks.py``), grouped as ``uniform`` groups them.
    """
    if graph.region_spans is not None:
        blocks = require_blocks(graph, "sqrt")
        k = max(1, round(math.sqrt(len(blocks))))
        regions, split = grouped(graph, blocks, k)
        note = f"{len(blocks)} blocks, {k} per segment{split_note(split, k)}"
        return finish(graph, budget_bytes, regions, "sqrt", note)
    spans = block_spans(graph)
    if len(spans) >= 2:
        bounds = [spans[0][0]] + [stop for _, stop in spans]
        regions = segments_to_regions(bounds, max(1, round(math.sqrt(len(spans)))))
    else:
        n = len(graph.nodes)
        regions = segments_to_regions(even_cuts(graph, max(1, round(math.sqrt(n)))))
    return finish(graph, budget_bytes, regions, "sqrt")
