"""``revolve``: recursive checkpointing as nested regions (Griewank & Walther; Chen's O(log N)).

The graph's units (its repeated blocks, else segments at cheap cuts) are split into ``k``
regions; each region is split again into ``k`` nested regions, down to ``depth`` levels (below
one block, a block is split at its cheapest cuts). Memory falls towards O(k log_k N) while each
level adds one more recomputation of what lies inside it. Every (k, depth) is scored by
``simulate`` and the cheapest schedule within budget wins.
"""

from __future__ import annotations

from solvers.common import finish
from solvers.costgraph import CostGraph, Region, Schedule
from solvers.cuts import block_spans, even_cuts
from solvers.errors import InfeasibleBudgetError
from solvers.registry import register
from solvers.simulate import simulate


def _split(bounds: list[int], k: int) -> list[list[int]]:
    """Split a list of boundaries (len m+1 for m units) into up to k contiguous groups."""
    m = len(bounds) - 1
    k = max(1, min(k, m))
    edges = [round(j * m / k) for j in range(k + 1)]
    return [bounds[a : b + 1] for a, b in zip(edges, edges[1:]) if b > a]


def nested(graph: CostGraph, bounds: list[int], k: int, depth: int, level: int = 0) -> list[Region]:
    """Regions splitting [bounds[0], bounds[-1]) k ways, recursively ``depth`` levels deep."""
    if depth == 0:
        return []
    out: list[Region] = []
    groups = _split(bounds, k)
    for group in groups:
        lo, hi = group[0], group[-1]
        if len(groups) > 1 or level == 0:
            out.append(Region(lo, hi, depth=level))
            inner_level = level + 1
        else:
            inner_level = level  # a single group would repeat its parent
        inner = group if len(group) > 2 else even_cuts(graph, k, lo, hi)
        if hi - lo > 1 and len(inner) > 2:
            out += nested(graph, inner, k, depth - 1, inner_level)
    return out


def units(graph: CostGraph) -> list[int]:
    spans = block_spans(graph)
    if len(spans) >= 2:
        return [spans[0][0]] + [stop for _, stop in spans]
    return even_cuts(graph, 16)


@register("revolve")
def solve_revolve(
    graph: CostGraph, budget_bytes: float, k: int | None = None, depth: int | None = None, **opts
) -> Schedule:
    bounds = units(graph)
    ks = [k] if k else [2, 3, 4, 6, 8]
    depths = [depth] if depth else [1, 2, 3, 4, 5]
    best, least = None, None
    for kk in ks:
        for d in depths:
            regions = tuple(nested(graph, bounds, kk, d))
            if not regions:
                continue
            sim = simulate(graph, Schedule(regions))
            least = sim.peak_bytes if least is None else min(least, sim.peak_bytes)
            if sim.peak_bytes <= budget_bytes:
                key = (sim.recompute_time_s, sim.peak_bytes, regions, kk, d)
                if best is None or key[:2] < best[:2]:
                    best = key
    if best is None:
        raise InfeasibleBudgetError(budget_bytes, least or 0, "(solver 'revolve')")
    return finish(graph, budget_bytes, best[2], "revolve", f"{best[3]}-way, depth {best[4]}")
