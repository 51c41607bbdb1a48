"""``revolve``: binomial checkpointing (Griewank & Walther 2000) as nested regions.

With ``s`` snapshots and ``t`` forward sweeps a chain of up to beta(s, t) = C(s + t, s) units
can be differentiated, and this is the most any schedule reaches. The optimal partition follows
beta(s, t) = sum over j = 0..s of beta(s - j, t - 1): the chain splits into s + 1 consecutive
regions, region j being beta(s - j, t - 1) units long. In backward the last region is handled
first while the inputs of the others are held, so region j has s - j snapshots left; inside it
(one sweep used up by its recomputation) the same partition repeats one level deeper.

Units are the graph's repeated blocks cut in two, else segments at cheap cuts; in place, the
model's repeated module calls whole (``solvers/blocks.py``). Every s (t the
least with beta(s, t) >= the number of units) is scored by ``simulate`` and the cheapest
schedule within budget wins: few snapshots mean deep nesting, less memory, more recomputation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import comb

from planner.solvers.blocks import nest_depths, require_blocks
from planner.solvers.common import finish
from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.cuts import block_spans, even_cuts
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import SolverOptions, register, time_limit_text
from planner.solvers.simulate import simulate


def beta(s: int, t: int) -> int:
    """Most units ``s`` snapshots and ``t`` sweeps can handle: C(s + t, s)."""
    return comb(s + t, s)


def least_sweeps(s: int, n_units: int) -> int:
    """The least t with beta(s, t) >= n_units."""
    t = 0
    while beta(s, t) < n_units:
        t += 1
    return t


def partition(lo: int, hi: int, s: int, t: int) -> list[tuple[int, int, int]]:
    """Units [lo, hi) split binomially: (start, stop, snapshots left) per region, in order.

    Region j is beta(s - j, t - 1) units long; when [lo, hi) is shorter than beta(s, t) the
    regions are filled from the left and the last one takes what remains.
    """
    out, a = [], lo
    for j in range(s + 1):
        if a >= hi:
            break
        b = hi if j == s else min(hi, a + beta(s - j, t - 1))
        out.append((a, b, s - j))
        a = b
    return out


def nested(bounds: list[int], s: int, t: int, depth: int = 0) -> list[Region]:
    """Regions of the binomial schedule over units ``bounds[0..]`` (node boundaries)."""
    n_units = len(bounds) - 1
    if n_units < 1 or t < 1:
        return []
    parts = partition(0, n_units, s, t)
    out: list[Region] = []
    for a, b, left in parts:
        inner_depth = depth
        if len(parts) > 1 or depth == 0:  # one part equal to its parent would repeat it
            out.append(Region(bounds[a], bounds[b], depth))
            inner_depth = depth + 1
        if b - a > 1:
            out += nested(bounds[a : b + 1], left, t - 1, inner_depth)
    return out


def units(graph: CostGraph) -> list[int]:
    """Unit boundaries: each repeated block halved at its cheapest inner cut (a transformer
    block's attention and MLP), as one block's backward, not the snapshots, is what bounds the
    peak of a deep schedule; without blocks, 16 segments at cheap cuts."""
    spans = block_spans(graph)
    if len(spans) >= 2:
        return sorted({c for a, b in spans for c in even_cuts(graph, min(2, b - a), a, b)})
    return even_cuts(graph, 16)


def inplace_nested(graph: CostGraph, s: int, t: int) -> tuple[Region, ...]:
    """``nested`` over the model's blocks in place (``solvers/blocks.py``): a segment of
    several blocks that is no span (an HF decoder's ModuleList, without a span of its parent's
    forward over them) is left out, its inner segments kept, so every region is one the plan
    can carry out and the rest still nest."""
    blocks = require_blocks(graph, "revolve")
    spans = graph.region_spans or frozenset()
    made = nested(list(range(len(blocks) + 1)), s, t)
    kept = [
        Region(blocks[r.start].start, blocks[r.stop - 1].stop)
        for r in made
        if (blocks[r.start].start, blocks[r.stop - 1].stop) in spans
    ]
    return tuple(nest_depths(kept))


@dataclass(frozen=True)
class RevolveOptions(SolverOptions):
    """``snapshots``: the one snapshot count to use (None: try every count)."""

    snapshots: int | None = None


@register("revolve", options=RevolveOptions)
def solve_revolve(graph: CostGraph, budget_bytes: float, options: RevolveOptions) -> Schedule:
    """The cheapest binomial schedule within budget over the snapshot counts (or the given).
    Anytime: past the time limit it answers with the best count tried so far."""
    snapshots, deadline = options.snapshots, options.deadline()
    inplace = graph.region_spans is not None
    bounds = [] if inplace else units(graph)
    n_units = len(require_blocks(graph, "revolve")) if inplace else len(bounds) - 1
    counts = [snapshots] if snapshots else range(1, max(1, n_units) + 1)
    best, least, cut_short = None, None, False
    for s in counts:
        if least is not None and time.process_time() > deadline:
            cut_short = True
            break
        t, s_max = least_sweeps(s, n_units), s
        regions = inplace_nested(graph, s, t) if inplace else tuple(nested(bounds, s, t))
        if not regions:
            continue
        sim = simulate(graph, Schedule(regions))
        least = sim.peak_bytes if least is None else min(least, sim.peak_bytes)
        if sim.peak_bytes <= budget_bytes:
            key = (sim.recompute_time_s, sim.peak_bytes, regions, s, t)
            if best is None or key[:2] < best[:2]:
                best = key
    if best is None:
        raise InfeasibleBudgetError(budget_bytes, least or 0, "(solver 'revolve')")
    s, t = best[3], best[4]
    note = f"binomial, {s} snapshots, {t} sweeps, beta = {beta(s, t)} >= {n_units} units"
    if inplace:
        note += "; blocks as units"
        left_out = len(nested(list(range(n_units + 1)), s, t)) - len(best[2])
        if left_out:
            note += f", {left_out} segments no span covers left out"
    if cut_short:
        note += f"; {time_limit_text(options)}: snapshot counts up to {s_max} tried"
    return finish(graph, budget_bytes, best[2], "revolve", note)
