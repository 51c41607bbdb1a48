"""The MILP that :mod:`planner.solvers.ilp` solves, built row by row: a variable per candidate
region, "kept by then" variables per storage, and a row per memory event (the first forward,
each node's backward, each candidate's recomputation or offload) that must stay within the
budget. The rules the rows follow are simulate's (See Rule 2, 4, 5, 7 there)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from planner.solvers.costgraph import CostGraph, Region
from planner.solvers.prices import (
    Prices,
    frame_node,
    offload_fetch_bytes,
    offload_time_s,
    prices,
    region_peak,
    trigger_node,
)


@dataclass
class Model:
    """A MILP in rows: minimise c.x subject to lo <= A x <= hi, x in [lb, ub], some integer."""

    cost: list[float] = field(default_factory=list)
    lb: list[float] = field(default_factory=list)
    ub: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[dict[int, float]] = field(default_factory=list)
    row_lo: list[float] = field(default_factory=list)
    row_hi: list[float] = field(default_factory=list)

    def var(self, cost: float = 0.0, lb: float = 0.0, ub: float = 1.0, integer: bool = False):
        self.cost.append(cost)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, coef: dict[int, float], lo: float = -np.inf, hi: float = np.inf) -> None:
        self.rows.append(coef)
        self.row_lo.append(lo)
        self.row_hi.append(hi)

    def count_in(self, unit: float, columns: set[int]) -> None:
        """Rows that hold any of ``columns`` (and so those columns) count in ``unit``s: their
        other coefficients and their bounds are divided by it."""
        for r, coef in enumerate(self.rows):
            if not columns.isdisjoint(coef):
                self.rows[r] = {k: c if k in columns else c / unit for k, c in coef.items()}
                self.row_lo[r] /= unit
                self.row_hi[r] /= unit


def build(graph: CostGraph, budget_bytes: float, regions: list[Region]):
    """The MILP for ``budget_bytes`` over candidate ``regions``; returns (model, x indices)."""
    b = _Build(graph, prices(graph), budget_bytes, regions)
    x = b.choices()
    b.reasons()
    b.finished()
    b.forward_rows()
    b.backward_rows()
    b.offload_rows()
    b.recompute_rows()
    # Every row in bytes holds a fin variable, which has a coefficient of one in each. Counted
    # in millionths of the budget (bytes on small budgets): with 1-byte and 3e10-byte
    # coefficients in one row HiGHS's MIP called the dearest candidate optimal, at 33 times the
    # cost of a schedule the same MILP admits (a 2-layer Llama-7B shape at 32k tokens on H100).
    b.mdl.count_in(max(1.0, budget_bytes / 1e6), set(b.fin))
    return b.mdl, x


@dataclass
class _Build:
    """The MILP of :func:`build` as its rows are added, one kind of row per method, in order."""

    graph: CostGraph
    p: Prices
    budget_bytes: float
    regions: list[Region]
    mdl: Model = field(default_factory=Model)
    fetched: dict[int, dict[int, int]] = field(default_factory=dict)
    covering: list[list[int]] = field(default_factory=list)  # candidates containing node i
    points: list[list[int]] = field(default_factory=list)  # positions of t's reasons, sorted
    g: list[list[int]] = field(default_factory=list)  # "kept by then" variables g[t][q]
    last: list[int] = field(default_factory=list)  # storage t's last use
    fin: list[int] = field(default_factory=list)
    fin_max: list[int] = field(default_factory=list)
    crossing: list[list[int]] = field(default_factory=list)

    def cost_s(self, k: int, r: Region) -> float:
        """The time region ``r`` adds to the step: its recomputation, or the transfers it
        exposes, and its bookkeeping."""
        p = self.p
        if r.kind == "offload":
            added_s = offload_time_s(self.graph, r.start, r.stop, sum(self.fetched[k].values()))
        else:
            # Rule 5: the recomputation runs through the region's last saving node
            last = (
                r.stop - 1
                if p.rule5_saves is None
                else trigger_node(p.rule5_saves, r.start, r.stop)
            )
            added_s = p.prefix_time_s[last + 1] - p.prefix_time_s[r.start]
        return added_s + p.overhead_s(r.start, r.stop, r.kind)

    def choices(self) -> list[int]:
        """A variable per candidate, priced by its time, and at most one candidate per node."""
        n, regions, mdl = self.p.n, self.regions, self.mdl
        # See simulate's Rule 7: what each offload candidate's nodes bring back in backward.
        self.fetched = {
            k: offload_fetch_bytes(self.graph, r.start, r.stop)
            for k, r in enumerate(regions)
            if r.kind == "offload"
        }
        # In units of the dearest candidate / 1e9: both backends stop improving once the
        # objective would move by less than about 1e-6 of its units (HiGHS's absolute gap,
        # which scipy does not expose; CBC's increment), and an offload's exposed transfer is
        # often far less than 1e-6 s: in seconds they could not tell two offload regions apart.
        costs_s = [self.cost_s(k, r) for k, r in enumerate(regions)]
        unit_s = max(costs_s, default=0.0) / 1e9 or 1.0
        x = [mdl.var(c / unit_s, integer=True) for c in costs_s]
        self.covering = [[] for _ in range(n)]
        for k, r in enumerate(regions):
            for i in range(r.start, r.stop):
                self.covering[i].append(k)
        for i in range(n):
            if len(self.covering[i]) > 1:
                mdl.row({k: 1.0 for k in self.covering[i]}, hi=1.0)
        return x

    def same(self, a: int, b: int) -> list[int]:
        """Candidates containing nodes a <= b."""
        return [k for k in self.covering[a] if self.regions[k].stop > b]

    def reasons(self) -> None:
        """Each storage's reasons to be kept, and its "kept by then" variables g[t][q]."""
        p, mdl = self.p, self.mdl
        n_t = len(p.size_units)
        self.points = [[] for _ in range(n_t)]
        self.g = [[] for _ in range(n_t)]
        self.last = [0] * n_t
        for t in range(n_t):
            if not p.size_units[t] or t not in p.produced[p.producer[t]]:
                continue  # empty, or held to the end of the step (priced with the gradients)
            prod = p.producer[t]
            savers = set(p.savers[t])
            self.last[t] = max([prod, *p.needers[t]])
            for pos in sorted({*savers, *p.needers[t]}):
                v = mdl.var()
                if self.g[t]:
                    mdl.row({v: 1.0, self.g[t][-1]: -1.0}, lo=0.0)
                coef = {v: 1.0}
                if pos not in savers:  # a reader: g >= in(pos) - same(prod, pos)
                    for k in self.covering[pos]:
                        coef[k] = coef.get(k, 0.0) - 1.0
                for k in self.same(prod, pos):  # a saver: g >= 1 - same(prod, pos)
                    coef[k] = coef.get(k, 0.0) + 1.0
                if pos in savers:
                    mdl.row(coef, lo=1.0)
                else:
                    mdl.row({k: c for k, c in coef.items() if c}, lo=0.0)
                self.points[t].append(pos)
                self.g[t].append(v)

    def kept_by(self, t: int, k: int) -> int | None:
        """g variable for "t has a reason before node k" (None: no reason point yet)."""
        q = np.searchsorted(self.points[t], k, side="left")
        return self.g[t][q - 1] if q else None

    def finished(self) -> None:
        """fin[k]: kept bytes of storages whose last use is before node k; and the storages
        that cross node k (made before it, needed from it on) and may still be kept."""
        p, mdl, n, g = self.p, self.mdl, self.p.n, self.g
        self.fin = [mdl.var(ub=np.inf) for _ in range(n + 1)]
        fin = self.fin
        mdl.row({fin[0]: 1.0}, lo=0.0, hi=0.0)
        ending: list[list[int]] = [[] for _ in range(n)]
        for t in range(len(p.size_units)):
            if g[t]:
                ending[self.last[t]].append(t)
        for k in range(n):
            coef = {fin[k + 1]: 1.0, fin[k]: -1.0}
            for t in ending[k]:
                coef[g[t][-1]] = coef.get(g[t][-1], 0.0) - p.size_units[t]
            mdl.row(coef, lo=0.0, hi=0.0)
        self.fin_max = [0] * (n + 1)  # fin[k] when everything is kept
        for k in range(n):
            self.fin_max[k + 1] = self.fin_max[k] + sum(p.size_units[t] for t in ending[k])
        self.crossing = [[] for _ in range(n + 1)]
        for t in range(len(p.size_units)):
            if g[t]:
                for k in range(p.producer[t] + 1, self.last[t] + 1):
                    self.crossing[k].append(t)

    def forward_rows(self) -> None:
        """Forward events (the first forward; regions do not change it but for what they
        keep)."""
        p, n, n_t = self.p, self.p.n, len(self.p.size_units)
        alive = [0] * (n + 1)
        for t in range(n_t):
            if t in p.produced[p.producer[t]]:
                end = n if p.is_output[t] else self.last[t]
                alive[p.producer[t]] += p.size_units[t]
                alive[end + 1 if end < n else n] -= p.size_units[t]
        running = 0
        outputs = [t for t in range(n_t) if p.is_output[t] and self.g[t]]
        for i in range(n):
            running += alive[i]
            coef = {self.fin[i]: 1.0}
            for t in outputs:  # outputs are already counted as alive to the end of forward
                if self.last[t] < i:
                    coef[self.g[t][-1]] = coef.get(self.g[t][-1], 0.0) - p.size_units[t]
            self.mdl.row(
                coef, hi=self.budget_bytes - running - p.fwd_temp_units[i] - p.held_fwd_units[i]
            )

    def kept_bytes(self, k: int, at: Callable[[int], int | None]) -> tuple[dict, int]:
        """fin[k] plus the storages crossing node k kept by node ``at(t)`` (None: left out),
        and the largest that sum can be."""
        coef = {self.fin[k]: 1.0}
        for t in self.crossing[k]:
            when = at(t)
            v = None if when is None else self.kept_by(t, when)
            if v is not None:
                coef[v] = coef.get(v, 0.0) + self.p.size_units[t]
        return coef, self.fin_max[k] + sum(c for v, c in coef.items() if v != self.fin[k])

    def backward_rows(self) -> None:
        """Backward of an unchecked node i."""
        p, budget = self.p, self.budget_bytes
        for i in range(p.n):
            const = p.grad_at_bwd_units[i] + p.bwd_temp_units[i]
            coef, _ = self.kept_bytes(i + 1, lambda t, i=i: i + 1)
            # The row's largest possible left side, so big-M is no bigger than it must be (a
            # loose big-M makes the LP relaxation, and so branch and bound, weak).
            most = self.fin_max[i + 1] + sum(p.size_units[t] for t in self.crossing[i + 1])
            big_m = max(0.0, most - (budget - const))
            if big_m == 0.0:
                continue  # never binding
            for k in self.covering[i]:
                if self.regions[k].kind != "offload":  # an offload region's own row is tighter
                    coef[k] = coef.get(k, 0.0) - big_m
            self.mdl.row(coef, hi=budget - const)

    def offload_rows(self) -> None:
        """Backward of node i inside an offload region: unchecked, plus what i brings back
        from host, with the region's arguments (made before it, a reason inside it) kept to
        its end."""
        p, budget = self.p, self.budget_bytes
        for k, r in enumerate(self.regions):
            if r.kind != "offload":
                continue
            for i in range(r.start, r.stop):
                const = p.grad_at_bwd_units[i] + p.bwd_temp_units[i] + self.fetched[k].get(i, 0)
                if const > budget:
                    self.mdl.ub[k] = 0.0
                    break
                coef, _ = self.kept_bytes(
                    i + 1, lambda t, r=r, i=i: r.stop if p.producer[t] < r.start else i + 1
                )
                most = self.fin_max[i + 1] + sum(p.size_units[t] for t in self.crossing[i + 1])
                big_m = max(0.0, most - (budget - const))
                if big_m > 0.0:
                    coef[k] = big_m
                    self.mdl.row(coef, hi=budget - const + big_m)

    def recompute_rows(self) -> None:
        """Each candidate recompute region: what the step keeps meanwhile plus its own
        working set."""
        p, budget, mdl = self.p, self.budget_bytes, self.mdl
        for k, r in enumerate(self.regions):
            if r.kind == "offload":
                continue
            # Rules 4 and 5 (the trailing nodes' backward first, the recomputation stopping
            # after the trigger's last save) as region_peak prices them
            trigger = (
                None if p.rule5_saves is None else trigger_node(p.rule5_saves, r.start, r.stop)
            )
            # Rule 2: the region's frame (its arguments) dies at the backward of its first
            # saving node; the backward of the nodes before it is a row of its own
            first = frame_node(p.rule5_saves, r.start, r.stop)
            own = region_peak(p, r.start, r.stop, trigger=trigger, frame=(first, None))
            if first > r.start:
                lead = max(
                    p.grad_at_bwd_units[i] + p.bwd_temp_units[i] for i in range(r.start, first)
                )
                if lead > budget:
                    mdl.ub[k] = 0.0
                    continue
                # what was kept before the region began, nothing of its own (its nodes before
                # ``first`` save nothing)
                coef, most = self.kept_bytes(r.start, lambda t, r=r: r.start)
                big_m = max(0.0, most - (budget - lead))
                if big_m > 0.0:
                    coef[k] = big_m
                    mdl.row(coef, hi=budget - lead + big_m)
            coef, most = self.kept_bytes(
                r.stop, lambda t, r=r: r.stop if p.producer[t] < r.start else None
            )
            if own > budget:
                mdl.ub[k] = 0.0  # cannot fit whatever else is kept
                continue
            big_m = max(0.0, most - (budget - own))
            if big_m > 0.0:
                coef[k] = big_m
                mdl.row(coef, hi=budget - own + big_m)
