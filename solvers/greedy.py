"""``greedy``: Chen et al. 2016's greedy budget variant.

Walk the graph keeping a running count of the bytes each node would keep for backward; at the
next seam (a cut where few bytes cross) past a threshold, close a segment and checkpoint it.
The last segment is left alone (its backward follows its forward at once, so recomputing it buys
nothing). The threshold is searched: every candidate is scored by ``simulate`` and the cheapest
schedule within budget wins.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from planner.solvers.blocks import Block, group_regions, require_blocks
from planner.solvers.common import finish
from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.cuts import allowed_cuts, crossing_bytes
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import SolverOptions, register, time_limit_text
from planner.solvers.simulate import simulate


def seams(graph: CostGraph) -> list[int]:
    """Cuts where the crossing bytes are a local minimum (ties included), among those in-place
    writes allow."""
    n = len(graph.nodes)
    crossing = crossing_bytes(graph)
    ok = allowed_cuts(graph)
    cuts = [c for c in range(n + 1) if ok[c]]  # 0 and n always
    return [
        c
        for prev, c, nxt in zip(cuts, cuts[1:], cuts[2:])
        if crossing[c] <= crossing[prev] and crossing[c] <= crossing[nxt]
    ] or cuts[1:-1]


def kept_bytes(graph: CostGraph) -> list[int]:
    """Bytes each node's outputs hold for backward when it runs unchecked."""
    kept = [0] * len(graph.nodes)
    for t in graph.tensors:
        if t.saved_by:
            kept[t.producer] += t.size_bytes
    return kept


def segments(graph: CostGraph, threshold_bytes: float, cuts: list[int]) -> list[Region]:
    kept = kept_bytes(graph)
    is_cut = set(cuts)
    regions, start, running = [], 0, 0
    for i, b in enumerate(kept):
        running += b
        if running >= threshold_bytes and i + 1 in is_cut:
            regions.append(Region(start, i + 1))
            start, running = i + 1, 0
    return regions  # the last segment [start, n) stays unchecked


def block_segments(graph: CostGraph, threshold_bytes: float, blocks: list[Block]) -> list[Region]:
    """``segments`` in place: runs of whole blocks, each wrapped as ``group_regions`` can."""
    kept = kept_bytes(graph)
    regions: list[Region] = []
    first, running = 0, 0
    for j, block in enumerate(blocks):
        running += sum(kept[block.start : block.stop])
        if running >= threshold_bytes:
            regions += group_regions(graph, blocks[first : j + 1])
            first, running = j + 1, 0
    return regions  # the last run of blocks stays unchecked


@dataclass(frozen=True)
class GreedyOptions(SolverOptions):
    """``n_thresholds``: how many segment thresholds are tried."""

    n_thresholds: int = 48


@register("greedy", options=GreedyOptions)
def solve_greedy(graph: CostGraph, budget_bytes: float, options: GreedyOptions) -> Schedule:
    """Cheapest within budget over thresholds spaced geometrically from the smallest node's
    kept bytes to all of them. Anytime: past the time limit it answers with the best
    threshold tried so far (the note says how many)."""
    n_thresholds = options.n_thresholds
    deadline = options.deadline()
    kept = [b for b in kept_bytes(graph) if b > 0] or [1]
    lo, hi = min(kept), sum(kept)
    if graph.region_spans is not None:  # in place: segments of whole blocks
        blocks = require_blocks(graph, "greedy")

        def make(threshold: float) -> list[Region]:
            return block_segments(graph, threshold, blocks)
    else:
        cuts = seams(graph)

        def make(threshold: float) -> list[Region]:
            return segments(graph, threshold, cuts)

    best: tuple[float, int, tuple[Region, ...]] | None = None
    least = None
    seen = set()
    tried = 0
    for k in range(n_thresholds + 1):
        if tried and time.process_time() > deadline:
            break
        tried += 1
        threshold = lo * (hi / lo) ** (k / n_thresholds)
        regions = tuple(make(threshold))
        if regions in seen:
            continue
        seen.add(regions)
        sim = simulate(graph, Schedule(regions))
        least = sim.peak_bytes if least is None else min(least, sim.peak_bytes)
        if sim.peak_bytes <= budget_bytes:
            key = (sim.step_time_s, sim.peak_bytes, regions)
            if best is None or key[:2] < best[:2]:
                best = key
    if best is None:
        raise InfeasibleBudgetError(budget_bytes, least, "(solver 'greedy')")
    note = f"{len(best[2])} segments"
    if tried < n_thresholds + 1:
        note += f"; {time_limit_text(options)}: {tried} thresholds tried"
    return finish(graph, budget_bytes, best[2], "greedy", note)
