"""dp's levels: its options (:class:`DPOptions`), the cuts and stages a level searches, the
levels it solves coarse to fine, and what the space of each is called in a note."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import ClassVar

from planner.solvers.costgraph import CostGraph
from planner.solvers.cuts import allowed_cuts, block_spans, crossing_bytes, even_cuts, region_bounds
from planner.solvers.registry import SolverOptions

DEFAULT_SPAN = 8
DEFAULT_COARSE = 24
# A long region crosses at most this many coarse cuts (4 transformer blocks): longer ones
# multiply the states (every cut of the region, for each length) for little gain.
DEFAULT_COARSE_SPAN = 8
# Graphs with more region boundaries than this are coarsened into stages first: the work grows
# with boundaries times span cubed, and past a few hundred it no longer fits a time limit.
DEFAULT_MAX_BOUNDS = 384
# A stage holds several boundaries, so a region reaches as far in fewer of them: on the 10k
# chain, Mamba-128 and the 7B shape, 4 stages plan within 0.04% of 8's step time (Mamba and 7B
# the same plans), 10-35% sooner.
DEFAULT_STAGED_SPAN = 4
# dp solves a graph with more region boundaries than this coarse to fine, from this many
# stages up: an answer early, then better ones while time lasts.
FIRST_STAGES = 48
# Each level has this many times the stages of the one before. A level's work grows about
# linearly with its stages (Mamba-128, CPU: 2.8 s at 48, 10.9 s at 192, 17.6 s at 384), so
# the levels before the last cost about a third of it when each has four times the stages, a
# whole one when each has twice (and on Mamba the 96-stage level found nothing either).
LEVEL_GROWTH = 4
# On a graph coarsened even at the finest level, refining stops once a level improves the
# predicted step time by less than this fraction.
REFINE_GAIN = 0.005
# On such a graph every level is an approximation and each finer one gains less (Mamba-128:
# 0.2% of the step from 194 to 353 stages, for 20 s), so a refinement is started only if it is
# predicted to end within this share of the time limit: the user's wait buys the coarse
# levels' large gains, not the last fraction of a percent.
STAGED_REFINE_SHARE = 1 / 3


@dataclass(frozen=True)
class DPOptions(SolverOptions):
    """dp's search space. A region may span up to ``max_span`` boundaries from any cut, or run
    between two coarse cuts (block boundaries and ``coarse_cuts`` spread ones, None: one per 8
    nodes, at most 24) at most ``coarse_span`` coarse cuts apart; ``max_span=None`` (or a graph
    no longer than it) allows every interval. ``max_depth`` caps the nesting (None: any depth).
    ``grid``: bytes are rounded up to steps of budget / grid (None: every byte counts; a
    state's value is kept as its breakpoints, ``solvers/frontier.py``, so a coarse grid only
    loses plans: on GPT-ref at SAC's measured peak, 2048 steps of 207 kB put SAC's own schedule
    8 MiB over, and dp recomputed attention scores instead). ``selective`` also offers
    top-level selective regions between coarse cuts (matmul outputs kept, the rest
    recomputed). ``max_bounds``: on a graph with more region boundaries
    than this, dp first coarsens it into that many stages (see :func:`stage_bounds`) and
    searches regions whose boundaries are stage boundaries (None: never); a region then spans
    up to ``staged_span`` stages (if less than ``max_span``). ``first_stages``: the coarsest
    level's stages (:func:`stage_levels`)."""

    searches: ClassVar[bool] = True

    max_span: int | None = DEFAULT_SPAN
    coarse_cuts: int | None = None
    max_depth: int | None = None
    grid: int | None = None
    selective: bool = True
    coarse_span: int = DEFAULT_COARSE_SPAN
    max_bounds: int | None = DEFAULT_MAX_BOUNDS
    staged_span: int = DEFAULT_STAGED_SPAN
    first_stages: int = FIRST_STAGES
    # Also offer top-level offload regions (simulate's Rule 7). None: when the graph's device
    # has a host link (``CostGraph.host_link``: offloading frees device memory; never on a CPU).
    offload: bool | None = None


DEFAULT_OPTIONS = DPOptions()


def coarse_cut_points(graph: CostGraph, count: int | None) -> list[int]:
    """Where long regions may begin and end: every repeated block's boundaries and its
    cheapest inner cut (a transformer block's attention/MLP seam), plus ``count`` cuts spread
    evenly, each the cheapest (fewest crossing bytes) near its even position. None: one per 8
    nodes, at most DEFAULT_COARSE. Not the globally cheapest cuts: those bunch up (in the
    embedding or the head, or all at the start of a uniform chain), where long regions help
    least."""
    n = len(graph.nodes)
    if count is None:
        count = min(DEFAULT_COARSE, max(2, n // 8))
    seeds: set[int] = set()
    for a, b in block_spans(graph):
        seeds |= set(even_cuts(graph, 2, a, b)) if b - a >= 2 else {a, b}
    # A whole-number stride, so equal stretches (a uniform chain) get equally spaced cuts and
    # the programme's states for them coincide (shared by hash-consing).
    stride = max(1, round(n / max(1, count)))
    crossing = crossing_bytes(graph)
    ok = allowed_cuts(graph)  # in-place writes forbid some cuts
    for target in range(stride, n, stride):
        lo, hi = max(1, target - stride // 2), min(n, target + (stride + 1) // 2)
        window = [c for c in range(lo, hi) if ok[c]]
        if window:
            seeds.add(min(window, key=lambda c: (crossing[c], abs(c - target))))
    return sorted({0, n, *seeds})


def stage_bounds(graph: CostGraph, bounds: tuple[int, ...], count: int | None) -> tuple[int, ...]:
    """The region boundaries dp searches: all of ``bounds`` when there are at most ``count``;
    else about ``count`` of them, so that each run of nodes between two (a pointwise chain, a
    view, a scan's steps) becomes one stage. Each repeated block gets the same number of stage
    cuts at the same offsets (the cheapest cuts near even positions inside it, its boundaries
    included), so equal blocks stay equal and the programme shares their work; the rest of the
    graph gets the cheapest cuts near even positions, and the graph's region spans keep their
    ends. Each is moved to the boundary at or before it."""
    if count is None or len(bounds) <= count:
        return bounds
    n = len(graph.nodes)
    spans = block_spans(graph)
    if spans:
        inside = sum(b - a for a, b in spans)
        per_block = max(1, round(count * inside / n / len(spans)))
        picked = {c for a, b in spans for c in even_cuts(graph, per_block, a, b)}
        for lo, hi in ((0, spans[0][0]), (spans[-1][1], n)):
            if hi > lo:
                picked |= set(even_cuts(graph, max(1, round(count * (hi - lo) / n)), lo, hi))
    else:  # whole-number strides: equal stretches (a uniform chain) get equal stages
        picked = set(coarse_cut_points(graph, count))
    if graph.region_spans is not None:
        picked |= {c for span in graph.region_spans for c in span}
    return tuple(sorted({bounds[bisect.bisect_right(bounds, c) - 1] for c in picked | {0, n}}))


def prices_exactly(graph: CostGraph) -> bool:
    """Whether dp's prices are simulate's on ``graph`` (see the module docstring)."""
    return not (
        any(nd.state_bytes for nd in graph.nodes)
        or any(t.freed_after > t.producer for t in graph.tensors)
        or graph.region_stash_bytes(0, len(graph.nodes))
    )


def level_space(graph: CostGraph, options: DPOptions) -> tuple[bool, str]:
    """(whether the space is every laminar family of the graph's regions, what it is)."""
    depth = "" if options.max_depth is None else f", depth <= {options.max_depth}"
    if graph.region_spans is not None:  # module-granular: the spans are the whole space
        return True, "every module-call region" + depth
    every = options.max_span is None or len(graph.nodes) <= options.max_span
    note = "every interval" if every else f"spans <= {options.max_span} boundaries or coarse cuts"
    bounds = tuple(region_bounds(graph))
    staged = stage_bounds(graph, bounds, options.max_bounds)
    if len(staged) < len(bounds):
        every = False
        note = f"boundaries at {len(staged)} stage cuts of {len(bounds)}, {note}"
    return every, note + depth


def dp_levels(graph: CostGraph, options: DPOptions) -> list[tuple[str, DPOptions, int]]:
    """The levels dp solves in turn, coarse to fine: (what the level is, its options, its stage
    count). Finer stages (:func:`stage_levels`; regions then span at most ``staged_span``
    stages); one level on a module-granular graph."""
    bounds = tuple(region_bounds(graph))
    out = []
    for count in stage_levels(graph, options):
        stages = len(stage_bounds(graph, bounds, count))
        level = f"{count} stages" if count is not None else f"all {len(bounds)} boundaries"
        level_options = replace(options, max_bounds=count)
        if stages < len(bounds) and options.max_span is not None:
            span = min(options.max_span, options.staged_span)
            level_options = replace(level_options, max_span=span)
        out.append((level, level_options, stages))
    return out


def stage_levels(graph: CostGraph, options: DPOptions) -> list[int | None]:
    """The stage counts (``max_bounds``) dp solves in turn, coarse to fine:
    ``options.first_stages``, times LEVEL_GROWTH while a level keeps at most half the graph's
    boundaries (a coarser level saves little time then), then ``options.max_bounds``; one level
    on a graph with fewer than twice that many boundaries (or whose regions follow module
    spans, which are never staged)."""
    top = options.max_bounds
    if graph.region_spans is not None:
        return [top]
    n_bounds = len(region_bounds(graph))
    levels: list[int | None] = []
    count = options.first_stages
    while 2 * count <= n_bounds and (top is None or count < top):
        levels.append(count)
        count *= LEVEL_GROWTH
    return [*levels, top]


def is_staged(graph: CostGraph, options: DPOptions) -> bool:
    """Whether dp coarsens ``graph`` into stages even at its finest level (``max_bounds``)."""
    top = options.max_bounds
    return top is not None and graph.region_spans is None and len(region_bounds(graph)) > top
