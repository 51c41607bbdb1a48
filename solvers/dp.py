"""``dp``: a Rotor-style dynamic programme over the linearised graph, exact for ``simulate``.

The schedule space is every laminar family of recompute regions (nested to any depth) whose
boundaries lie on candidate cuts. The programme walks a context (the whole step, or one region
being recomputed) left to right. At a cut it knows

- ``m``: the bytes still free under the budget once everything kept so far is counted;
- the *crossing state*: each storage produced earlier in this context that a later node still
  reads or saves, with a flag saying whether something already forces autograd (or a
  checkpoint) to keep it until backward.

Every event of ``simulate`` then splits into bytes kept by what lies left of the cut (a prefix
sum, folded into ``m``) plus bytes fixed by the next step alone: gradient buffers are the same
for every schedule, a node's forward working set is the crossing storages plus its own, and a
region's recomputation depends only on the region (the context it runs in holds fixed bytes
while it runs). So a step is either "node ``c`` runs unchecked" or "nodes ``[c, j)`` form a
region", the region's inside is the same programme one level down, and the value of a state is
a non-increasing step function of ``m``.

No table is indexed by memory: each state caches the answers it has computed as intervals
``[bytes used, m asked]`` on which the optimal cost is constant (a schedule using ``u`` bytes
that is optimal for ``m`` stays optimal for every budget in ``[u, m]``), plus the largest ``m``
found infeasible. Work grows with the distinct answers, never with the budget's size.

The programme is exact when every tensor a node saves for backward is one it reads or produces
(true of autograd); :func:`solve_dp` still replays its answer through ``simulate`` and tightens
the budget if the two ever disagree.
"""

from __future__ import annotations

import bisect
import math
import sys
from dataclasses import dataclass

from solvers.common import finish
from solvers.costgraph import CostGraph, Region, Schedule
from solvers.cuts import crossing_bytes
from solvers.errors import InfeasibleBudgetError
from solvers.registry import register
from solvers.simulate import simulate

INF = math.inf
DEFAULT_SPAN = 32
DEFAULT_COARSE = 48


@dataclass(frozen=True)
class _Prices:
    """Per-node and per-tensor numbers the programme reads, precomputed once."""

    n: int
    size: tuple[int, ...]
    producer: tuple[int, ...]
    needers: tuple[tuple[int, ...], ...]  # sorted forward readers and savers of each tensor
    is_output: tuple[bool, ...]
    produced: tuple[tuple[int, ...], ...]
    saves: tuple[frozenset[int], ...]  # tensors each node saves for backward
    time_s: tuple[float, ...]
    prefix_time_s: tuple[float, ...]
    fwd_temp: tuple[int, ...]
    bwd_temp: tuple[int, ...]
    grad_at_bwd: tuple[int, ...]  # gradient + parameter-gradient bytes at node i's backward
    grad_after: tuple[int, ...]  # the same once node i's backward is done (index n: 0)


def prices(graph: CostGraph) -> _Prices:
    n = len(graph.nodes)
    produced: list[list[int]] = [[] for _ in range(n)]
    saves: list[set[int]] = [set() for _ in range(n)]
    used: list[set[int]] = [set() for _ in range(n)]
    for t_i, t in enumerate(graph.tensors):
        produced[t.producer].append(t_i)
        for s in t.saved_by:
            saves[s].add(t_i)
        for u in t.users:
            used[u].add(t_i)
    # Gradient buffers follow reverse node order whatever the schedule, so they are a
    # function of position only (the same bookkeeping as simulate's backward).
    grad_at, grad_after = [0] * n, [0] * (n + 1)
    grads: set[int] = set()
    live = 0
    for i in range(n - 1, -1, -1):
        for t_i in used[i]:
            t = graph.tensors[t_i]
            if t.grad_bytes and t_i not in grads:
                grads.add(t_i)
                live += t.grad_bytes
        live += graph.nodes[i].param_grad_bytes
        grad_at[i] = live
        for t_i in produced[i]:
            if t_i in grads:
                live -= graph.tensors[t_i].grad_bytes
        grad_after[i] = live
    times = [graph.node_time_s(i) for i in range(n)]
    prefix = [0.0]
    for t_s in times:
        prefix.append(prefix[-1] + t_s)
    return _Prices(
        n=n,
        size=tuple(t.size_bytes for t in graph.tensors),
        producer=tuple(t.producer for t in graph.tensors),
        needers=tuple(
            tuple(sorted({u for u in (*t.users, *t.saved_by) if u > t.producer}))
            for t in graph.tensors
        ),
        is_output=tuple(t.is_output for t in graph.tensors),
        produced=tuple(tuple(p) for p in produced),
        saves=tuple(frozenset(s) for s in saves),
        time_s=tuple(times),
        prefix_time_s=tuple(prefix),
        fwd_temp=tuple(nd.fwd_temp_bytes for nd in graph.nodes),
        bwd_temp=tuple(nd.bwd_temp_bytes for nd in graph.nodes),
        grad_at_bwd=tuple(grad_at),
        grad_after=tuple(grad_after),
    )


# A front is a list of (bytes used, recompute time, how) sorted by bytes ascending with time
# strictly descending: the schedules of a state that no other beats on both counts.
# ``how`` rebuilds the schedule: None (nothing left), ("run", next cut, entry) or
# ("region", start, stop, inner entry, rest entry).
_END = [(-INF, 0.0, None)]


def _shift(front: list, delta: float, floor: float, cap: float, how) -> list:
    """Each entry's bytes become max(floor, bytes + delta); entries over ``cap`` drop."""
    out: list = []
    for used, cost, h in front:
        u = max(floor, used + delta)
        if u > cap:
            break
        if out and out[-1][0] == u:
            out[-1] = (u, cost, how(h))  # cost only falls along a front
        else:
            out.append((u, cost, how(h)))
    return out


def _combine(a: list, da: float, b: list, db: float, floor: float, extra: float, cap: float,
             how) -> list:
    """Schedules made of one entry of ``a`` and one of ``b``: bytes max(floor, a + da, b + db),
    time a + b + extra. Each threshold's best pair is the cheapest of each side under it."""
    out: list = []
    ia = ib = 0
    na, nb = len(a), len(b)
    while ia < na and ib < nb:
        ua, ub = a[ia][0] + da, b[ib][0] + db
        v = max(ua, ub)
        # advance both sides to the last entries within v (cheaper and still under v)
        while ia + 1 < na and a[ia + 1][0] + da <= v:
            ia += 1
        while ib + 1 < nb and b[ib + 1][0] + db <= v:
            ib += 1
        u = max(floor, v)
        if u > cap:
            break
        cost = a[ia][1] + b[ib][1] + extra
        if out and out[-1][0] == u:
            if cost < out[-1][1]:
                out[-1] = (u, cost, how(a[ia][2], b[ib][2]))
        elif not out or cost < out[-1][1]:
            out.append((u, cost, how(a[ia][2], b[ib][2])))
        # next threshold: the smaller of the two next breakpoints
        na_next = a[ia + 1][0] + da if ia + 1 < na else INF
        nb_next = b[ib + 1][0] + db if ib + 1 < nb else INF
        if na_next == INF and nb_next == INF:
            break
        if na_next <= nb_next:
            ia += 1
        else:
            ib += 1
    return out


def _pareto(entries: list) -> list:
    out: list = []
    for e in sorted(entries, key=lambda e: (e[0], e[1])):
        if not out or e[1] < out[-1][1]:
            if out and out[-1][0] == e[0]:
                continue
            out.append(e)
    return out


class _Programme:
    """The memoised recursion. A state is (c, b, crossing, root, whole_ok):

    candidate cut ``c`` inside a context ending at cut ``b`` (``root``: the whole step, else a
    region being recomputed); ``crossing`` is a tuple of (tensor, kept) pairs; ``whole_ok`` is
    False only at the start of a region context, where a child equal to the region is pointless.
    Its value is the state's front, with bytes relative to what is kept left of ``c``.
    """

    def __init__(
        self, p: _Prices, coarse: list[int], max_span: int, max_depth: int | None, cap: float
    ) -> None:
        self.p = p
        self.coarse = sorted(set(coarse) | {0, p.n})
        self.is_coarse = [False] * (p.n + 1)
        for c in self.coarse:
            self.is_coarse[c] = True
        self.max_span = max_span
        self.max_depth = max_depth
        self.cap = cap
        self.memo: dict[tuple, list] = {}
        self._last: dict[tuple[int, int, bool], int] = {}
        self._wmax: dict[tuple[int, int, bool], list[float]] = {}

    # -- static pieces ---------------------------------------------------------------------
    def last_need(self, t: int, b: int, root: bool) -> int:
        """Last node in a context ending at ``b`` that reads or saves ``t``."""
        key = (t, b, root)
        got = self._last.get(key)
        if got is None:
            if root and self.p.is_output[t]:
                got = self.p.n  # an output lives until backward starts
            else:
                ns = self.p.needers[t]
                k = bisect.bisect_left(ns, b)
                got = ns[k - 1] if k else self.p.producer[t]
            self._last[key] = got
        return got

    def needed_in(self, t: int, c: int, j: int) -> bool:
        ns = self.p.needers[t]
        k = bisect.bisect_left(ns, c)
        return k < len(ns) and ns[k] < j

    def fwd_peaks(self, c: int, b: int, root: bool) -> list[float]:
        """Running max over i in [c, b) of the bytes produced from c on and alive at i's forward
        (plus i's working set), with the context ending at ``b``."""
        key = (c, b, root)
        got = self._wmax.get(key)
        if got is None:
            p = self.p
            ends: dict[int, int] = {}
            alive, best, got = 0, -INF, []
            for i in range(c, b):
                for t in p.produced[i]:
                    alive += p.size[t]
                    end = self.last_need(t, b, root)
                    ends[end] = ends.get(end, 0) + p.size[t]
                best = max(best, alive + p.fwd_temp[i])
                got.append(best)
                alive -= ends.pop(i, 0)
            self._wmax[key] = got
        return got

    # -- the recursion -----------------------------------------------------------------------
    def run(self, c: int, stop: int, b: int, crossing: tuple, root: bool):
        """Nodes [c, stop) unchecked: (bytes used, bytes kept after, crossing at ``stop``)."""
        p = self.p
        grad_rec = 0 if root else p.grad_after[b]
        used, kept_bytes = -INF, 0
        for i in range(c, stop):
            own, saves = p.produced[i], p.saves[i]
            fwd = sum(p.size[t] for t, _ in crossing) + sum(p.size[t] for t in own)
            fwd += p.fwd_temp[i] + grad_rec
            bwd = p.grad_at_bwd[i] + p.bwd_temp[i]
            bwd += sum(p.size[t] for t, kept in crossing if kept or t in saves)
            bwd += sum(p.size[t] for t in own if t in saves)
            used = max(used, kept_bytes + fwd, kept_bytes + bwd)
            nxt = []
            for t, kept in crossing:
                kept = kept or t in saves
                if self.last_need(t, b, root) == i:
                    kept_bytes += p.size[t] if kept else 0
                else:
                    nxt.append((t, kept))
            for t in own:
                if self.last_need(t, b, root) == i:
                    kept_bytes += p.size[t] if t in saves else 0
                else:
                    nxt.append((t, t in saves))
            crossing = tuple(sorted(nxt))
        return used, kept_bytes, crossing

    def front(self, c: int, b: int, crossing: tuple, root: bool, whole_ok: bool,
              depth: int) -> list:
        if c == b:
            return _END
        key = (c, b, crossing, root, whole_ok, depth if self.max_depth is not None else 0)
        got = self.memo.get(key)
        if got is not None:
            return got
        p, cap = self.p, self.cap
        options: list = []
        # Node c runs unchecked in this context.
        used, kept_bytes, nxt = self.run(c, c + 1, b, crossing, root)
        if used <= cap:
            rest = self.front(c + 1, b, nxt, root, True, depth)
            options += _shift(rest, kept_bytes, used, cap, lambda h, s=c + 1: ("run", s, h))
        # Nodes [c, j) form a region, for each allowed end j.
        if self.max_depth is None or depth < self.max_depth:
            grad_rec = 0 if root else p.grad_after[b]
            cross_bytes = sum(p.size[t] for t, _ in crossing)
            peaks = self.fwd_peaks(c, b, root)
            surviving: list[int] = []  # produced in [c, j), still needed at j or later
            last = c
            for j in self.region_ends(c, b):
                if j == b and not whole_ok:
                    break
                fwd = cross_bytes + peaks[j - 1 - c] + grad_rec
                if fwd > cap:
                    break  # the forward working set only grows with j
                for i in range(last, j):
                    surviving += p.produced[i]
                last = j
                surviving = [t for t in surviving if self.last_need(t, b, root) >= j]
                held = sum(p.size[t] for t, kept in crossing if kept or self.needed_in(t, c, j))
                inner = self.front(c, j, (), False, False, depth + 1)
                if not inner:
                    continue
                kept_bytes, nxt = 0, [(t, False) for t in surviving]
                for t, kept in crossing:
                    if self.last_need(t, b, root) < j:
                        kept_bytes += p.size[t]  # read inside the region: kept as its input
                    else:
                        nxt.append((t, kept or self.needed_in(t, c, j)))
                rest = self.front(j, b, tuple(sorted(nxt)), root, True, depth)
                extra = p.prefix_time_s[j] - p.prefix_time_s[c]
                options += _combine(
                    inner, held, rest, kept_bytes, fwd, extra, cap,
                    lambda hi, hr, c=c, j=j: ("region", c, j, hi, hr),
                )
        result = _pareto(options)
        self.memo[key] = result
        return result

    def region_ends(self, c: int, b: int) -> list[int]:
        """Ends j of regions starting at c: any within ``max_span`` nodes, and the coarse cuts
        beyond when c is one (long regions only between cheap cuts)."""
        ends = list(range(c + 1, min(b, c + self.max_span) + 1))
        if self.is_coarse[c]:
            k = bisect.bisect_right(self.coarse, c + self.max_span)
            ends += [j for j in self.coarse[k:] if j <= b]
        return ends

    def regions(self, how, depth: int = 0) -> list[Region]:
        """Rebuild the regions an entry's ``how`` describes."""
        out: list[Region] = []
        while how is not None:
            if how[0] == "run":
                how = how[2]
            else:
                _, c, j, inner, rest = how
                out.append(Region(c, j, depth=depth))
                out += self.regions(inner, depth + 1)
                how = rest
        return out


def pareto_front(
    graph: CostGraph,
    cap_bytes: float | None = None,
    max_span: int | None = DEFAULT_SPAN,
    coarse_cuts: int = DEFAULT_COARSE,
    max_depth: int | None = None,
) -> list[tuple[int, float, Schedule]]:
    """Every (peak bytes, recompute time, schedule) that no other schedule of the space beats
    on both, up to ``cap_bytes`` (default: the eager peak): one solve serves every budget."""
    p = prices(graph)
    cap = simulate(graph, Schedule()).peak_bytes if cap_bytes is None else cap_bytes
    span = p.n if max_span is None else max_span
    prog = _Programme(p, coarse_cut_points(graph, coarse_cuts), span, max_depth, cap)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * p.n + 1000))
    try:
        front = prog.front(0, p.n, (), True, True, 0)
    finally:
        sys.setrecursionlimit(limit)
    return [
        (int(used), cost, Schedule(tuple(prog.regions(how)), "dp", 0.0))
        for used, cost, how in front
    ]


def coarse_cut_points(graph: CostGraph, count: int) -> list[int]:
    """The ``count`` cheapest cuts (fewest crossing bytes): where long regions may begin and end."""
    n = len(graph.nodes)
    crossing = crossing_bytes(graph)
    inner = sorted(range(1, n), key=lambda c: (crossing[c], c))[: max(0, count)]
    return sorted({0, n, *inner})


def least_peak(graph: CostGraph, **opts) -> int:
    """The least peak any schedule of the programme's space reaches."""
    return pareto_front(graph, None, **opts)[0][0]


@register("dp")
def solve_dp(
    graph: CostGraph,
    budget_bytes: float,
    max_span: int | None = DEFAULT_SPAN,
    coarse_cuts: int = DEFAULT_COARSE,
    max_depth: int | None = None,
    **opts,
) -> Schedule:
    """Least recompute time within the budget over nested regions.

    A region may span up to ``max_span`` nodes from any cut, or run between two of the
    ``coarse_cuts`` cheapest cuts; with ``max_span=None`` (or a graph no longer than it) every
    interval is allowed and the answer is the optimum under ``simulate``. ``max_depth`` caps
    the nesting (None: any depth).
    """
    eager = simulate(graph, Schedule()).peak_bytes
    cap = min(float(budget_bytes), eager)
    opts = dict(max_span=max_span, coarse_cuts=coarse_cuts, max_depth=max_depth)
    front = pareto_front(graph, cap, **opts)
    exact = max_span is None or len(graph.nodes) <= max_span
    note = "every interval" if exact else f"spans <= {max_span} nodes or {coarse_cuts} coarse cuts"
    if max_depth is not None:
        note += f", depth <= {max_depth}"
    if not front:
        raise InfeasibleBudgetError(budget_bytes, least_peak(graph, **opts), "(solver 'dp')")
    _, _, schedule = min(front, key=lambda e: (e[1], e[0]))
    return finish(graph, budget_bytes, schedule.regions, "dp", note, gap=0.0 if exact else None)
