"""``ilp``: a Checkmate-style MILP over the DAG, exact for ``simulate`` on non-nested regions
(but for Rules 9 and 12, below).

Checkmate (Jain et al. 2020) chooses what to keep and recompute with binary variables and a
memory constraint per event. Here the choices are checkpoint regions: ``x[R]`` = 1 when the
candidate interval ``R`` is a region (regions are disjoint; nesting is ``dp``'s business).
Whether autograd keeps a storage ``t`` for backward is a disjunction of *reasons*, one per node
that needs it: a saver ``s`` outside the producer's region (``1 - same(p, s)``) or a reader in
another region (``in(u) - same(p, u)``), where ``same`` and ``in`` are sums of ``x``. A
continuous ``g[t, q]`` >= each of the first ``q`` reasons says "kept by then"; memory only
pushes it down, so it equals the disjunction at an optimum. With ``fin[k]``, the bytes of
storages whose last use is before node ``k`` that stay kept, every event of ``simulate`` is one
sparse row:

- forward of node i:            live(i) + fin[i] <= budget
- backward of unchecked node i: grads(i) + fin[i+1] + crossing kept by i <= budget (off when i
  is in a region: big-M on ``in(i)``)
- region R (its recomputation and backward): fin[R.stop] + crossing kept by R.stop + K_R
  <= budget (off unless ``x[R]``), where K_R, the region's own working set, is a constant;
  when R's first saving node f comes after its start, the backward of its nodes before f runs
  once its frame has let its arguments go (simulate's Rule 2): fin[R.start] + crossing kept by
  R.start + the largest of their gradients and working sets <= budget. A region in which
  nothing saves keeps no frame and frees nothing: not a candidate.

With ``ILPOptions.offload`` (by default: when ``CostGraph.host_link``, as ``dp``'s) every
candidate interval may also be an offload region (simulate's Rule 7), ``x[R]`` of its own.
Whether it keeps a storage is the same disjunction (what it saves of its own storages goes to
host, its arguments stay on the device to its end), and it runs no recomputation: node i's
backward inside it is the unchecked row plus the bytes i brings back from host, with the
region's arguments kept to its end (off unless ``x[R]``). It costs the transfer time it
exposes (``prices.offload_time_s``), not recomputation.

Backends: ``scipy.optimize.milp`` (HiGHS, default) and pulp (CBC). A time limit stops the
search; the gap is reported in Schedule.gap, and on a timeout without a solution ``dp`` answers.
On large graphs the candidates are the intervals ``dp`` uses (short spans plus coarse cuts).

Not priced: the RNG state a checkpoint call over a node that draws random numbers stashes on a
CPU (simulate's Rule 12; a region without one stashes nothing) and the buffer copies of regions
that write BatchNorm statistics (Rule 9). On graphs with them the MILP may pick a schedule over
the budget by ``simulate``; the warm start (dp's, depth 1, which prices them) then answers, and
the note says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from planner.solvers.common import finish
from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.cuts import allowed_cuts, region_bounds
from planner.solvers.dp_levels import DEFAULT_COARSE_SPAN, DPOptions, coarse_cut_points
from planner.solvers.dp_search import solve_dp
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.ilp_rows import Model, build
from planner.solvers.prices import frame_node, rule5_saves
from planner.solvers.registry import SolverOptions, register, time_limit_text
from planner.solvers.simulate import simulate

FULL_NODES = 40  # up to this many nodes every interval is a candidate
# Short spans on large graphs: half dp's, so the MILP on GPT-ref (about 1,200 candidates)
# closes to a 1% gap within its time limit on a busy 2-core machine (2,100 at dp's span do not).
ILP_SPAN = 4


def candidates(
    graph: CostGraph,
    max_span: int | None,
    coarse_cuts: int | None,
    coarse_span: int = DEFAULT_COARSE_SPAN,
    offload: bool = False,
) -> list[Region]:
    """Every interval on small graphs; else intervals spanning at most ``max_span`` boundaries
    (cuts after nodes that allocate: a cut after a view equals the one before it) and those
    between coarse cuts. On a module-granular graph, exactly its region spans. With
    ``offload``, each interval also as an offload region (after all the recompute ones)."""
    n = len(graph.nodes)
    if graph.region_spans is not None:
        pairs = set(graph.region_spans)
    elif max_span is None or n <= FULL_NODES:
        ok = allowed_cuts(graph)  # in-place writes forbid some boundaries
        pairs = {(a, b) for a in range(n) for b in range(a + 1, n + 1) if ok[a] and ok[b]}
    else:
        bounds = region_bounds(graph)
        pairs = {(a, b) for k, a in enumerate(bounds) for b in bounds[k + 1 : k + 1 + max_span]}
        coarse = sorted(
            {max(b for b in bounds if b <= c) for c in coarse_cut_points(graph, coarse_cuts)}
        )
        pairs |= {(a, b) for k, a in enumerate(coarse) for b in coarse[k + 1 : k + 1 + coarse_span]}
    kinds = ("recompute", "offload") if offload else ("recompute",)
    # See simulate's Rule 2: a region in which nothing saves keeps no frame, so it frees
    # nothing and recomputes nothing; it only holds its arguments through its forward: never
    # better than leaving its nodes unchecked, so not a candidate.
    saves = rule5_saves(graph)
    return [
        Region(a, b, kind=kind)
        for kind in kinds
        for a, b in sorted(pairs)
        if kind == "offload" or frame_node(saves, a, b) >= a
    ]


@dataclass(frozen=True)
class Result:
    chosen: list[int] | None  # None: no solution found in time (but maybe a bound)
    optimal: bool
    gap: float | None
    seconds: float
    bound: float | None = None  # proven lower bound on the objective (None: unknown)


def solve_highs(mdl: Model, time_limit_s: float, rel_gap: float) -> Result | None:
    """HiGHS (scipy.optimize.milp, in this process). HiGHS counts ``time_limit_s`` on its own
    timer, which is the wall clock (HighsTimer), and scipy gives it no CPU-time mode nor a
    callback to stop it by ours: the one solver time limit not counted in CPU time. So a MILP
    that HiGHS finishes (to ``rel_gap``) is the same under any load, while one the limit cuts
    short may stop sooner on a loaded machine than on a quiet one."""
    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import csr_array

    data, cols, ptr = [], [], [0]
    for row in mdl.rows:
        cols += list(row)
        data += list(row.values())
        ptr.append(len(cols))
    a = csr_array((data, cols, ptr), shape=(len(mdl.rows), len(mdl.cost)))
    start = time.perf_counter()  # reported only (Result.seconds), not a limit
    res = milp(
        np.array(mdl.cost),
        integrality=np.array(mdl.integer, dtype=int),
        bounds=(np.array(mdl.lb), np.array(mdl.ub)),
        constraints=LinearConstraint(a, np.array(mdl.row_lo), np.array(mdl.row_hi)),
        options={"time_limit": time_limit_s, "mip_rel_gap": rel_gap, "disp": False},
    )
    seconds = time.perf_counter() - start
    bound = getattr(res, "mip_dual_bound", None)
    if res.x is None:
        if bound is None or not np.isfinite(bound) or res.status == 2:  # 2: infeasible
            return None
        return Result(None, False, None, seconds, float(bound))  # a bound, no solution yet
    chosen = [k for k, v in enumerate(res.x) if mdl.integer[k] and v > 0.5]
    gap = getattr(res, "mip_gap", None)
    return Result(
        chosen,
        res.status == 0,
        None if gap is None else float(gap),
        seconds,
        None if bound is None or not np.isfinite(bound) else float(bound),
    )


def solve_cbc(mdl: Model, time_limit_s: float, rel_gap: float) -> Result | None:
    import pulp

    prob = pulp.LpProblem("checkpoint", pulp.LpMinimize)
    vs = [
        pulp.LpVariable(
            f"v{k}",
            lowBound=lb if np.isfinite(lb) else None,
            upBound=ub if np.isfinite(ub) else None,
            cat=pulp.LpInteger if integer else pulp.LpContinuous,  # LpBinary drops ub=0
        )
        for k, (lb, ub, integer) in enumerate(zip(mdl.lb, mdl.ub, mdl.integer))
    ]
    prob += pulp.lpSum(c * vs[k] for k, c in enumerate(mdl.cost) if c)
    for row, lo, hi in zip(mdl.rows, mdl.row_lo, mdl.row_hi):
        expr = pulp.lpSum(c * vs[k] for k, c in row.items())
        if lo == hi:
            prob += expr == lo
        else:
            if np.isfinite(lo):
                prob += expr >= lo
            if np.isfinite(hi):
                prob += expr <= hi
    # CBC runs as a subprocess: ``timeMode="cpu"`` has it count the time limit in its own CPU
    # time (pulp's default counts the wall clock), the CPU time left of ilp's limit, which
    # this process's clock (time.process_time) does not see: ilp's whole call then spends at
    # most its limit in CPU time, its own and CBC's together.
    start = time.perf_counter()  # reported only (Result.seconds), not a limit
    cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=rel_gap, timeMode="cpu")
    status = prob.solve(cbc)
    seconds = time.perf_counter() - start
    if pulp.LpStatus[status] not in ("Optimal", "Not Solved") or vs[0].varValue is None:
        return None
    chosen = [k for k, v in enumerate(vs) if mdl.integer[k] and (v.varValue or 0) > 0.5]
    optimal = pulp.LpStatus[status] == "Optimal"
    return Result(chosen, optimal, 0.0 if optimal else None, seconds)


def dp_answer(graph: CostGraph, budget_bytes: float, dp: DPOptions):
    """dp's schedule over ``dp``'s space, or the InfeasibleBudgetError it raised."""
    try:
        return solve_dp(graph, budget_bytes, dp)
    except InfeasibleBudgetError as e:
        return e


def warm_start(answer, regions: list[Region]) -> list[int] | None:
    """dp's answer as the indices of its regions among ``regions`` (its non-nested space is a
    subset of the candidates), or None when dp found nothing or ran out of time."""
    if not isinstance(answer, Schedule) or answer.solver != "dp":
        return None
    index = {(r.start, r.stop, r.kind): k for k, r in enumerate(regions)}
    chosen = [index.get((r.start, r.stop, r.kind)) for r in answer.regions]
    return None if None in chosen else chosen


@dataclass(frozen=True)
class ILPOptions(SolverOptions):
    """``backend``: "highs" (scipy.optimize.milp) or "cbc" (pulp); the search stops at ``rel_gap``
    or when ``time_limit_s`` (the whole call, in CPU time: this process's, and CBC's own for its
    search; HiGHS counts its search's share on the wall clock, :func:`solve_highs`; dp's warm
    start may take half of it) or ``milp_time_limit_s`` (the MILP search alone, None: what is
    left) runs out. Candidates: every interval on small graphs, else spans of at most
    ``max_span`` boundaries and those between coarse cuts (``coarse_cuts``, ``coarse_span`` as
    dp's). ``warm``: start from dp's schedule. ``offload``: each candidate may also be an
    offload region (None: when the graph's device has a host link, ``CostGraph.host_link``, as
    dp's)."""

    searches: ClassVar[bool] = True

    time_limit_s: float = 10.0
    milp_time_limit_s: float | None = None
    backend: str = "highs"
    rel_gap: float = 0.01
    max_span: int | None = ILP_SPAN
    coarse_cuts: int | None = None
    coarse_span: int = DEFAULT_COARSE_SPAN
    warm: bool = True
    offload: bool | None = None


@register("ilp", options=ILPOptions)
def solve_ilp(graph: CostGraph, budget_bytes: float, options: ILPOptions) -> Schedule:
    """Least added step time (recomputation, offload transfers) within budget over disjoint
    regions, by MILP.

    ``backend``: "highs" (scipy.optimize.milp) or "cbc" (pulp). Stops at ``rel_gap`` or when
    ``time_limit_s`` (the whole call) runs out. ``warm``: dp's non-nested schedule is the first
    incumbent: its cost bounds the objective (an extra row, which prunes the search), it
    answers when the MILP finds nothing better in time, and the gap reported in Schedule.gap
    is between the best schedule found and the MILP's proven lower bound.
    """
    deadline = options.deadline()  # CPU time of this process, as every solver's
    backend, time_limit_s, rel_gap = options.backend, options.time_limit_s, options.rel_gap
    if backend not in ("highs", "cbc"):
        raise ValueError(f"ilp backend {backend!r}: use 'highs' or 'cbc'")
    eager = simulate(graph, Schedule()).peak_bytes
    if eager <= budget_bytes:
        return finish(graph, budget_bytes, [], "ilp", "the eager step fits", gap=0.0)
    offload = graph.host_link if options.offload is None else options.offload
    regions = candidates(graph, options.max_span, options.coarse_cuts, options.coarse_span, offload)
    mdl, x = build(graph, budget_bytes, regions)
    # dp over the same non-nested space: the warm start, and the answer when the MILP has none.
    dp = DPOptions(
        time_limit_s=time_limit_s / 2,
        max_span=options.max_span,
        coarse_cuts=options.coarse_cuts,
        coarse_span=options.coarse_span,
        max_depth=1,
        selective=False,
        offload=offload,
    )
    answer = dp_answer(graph, budget_bytes, dp) if options.warm else None
    incumbent = warm_start(answer, regions)
    upper = None
    if incumbent is not None:
        upper = sum(mdl.cost[k] for k in incumbent)
        mdl.row({k: c for k, c in enumerate(mdl.cost[: len(x)]) if c}, hi=upper * (1 + 1e-9))
    solver = {"highs": solve_highs, "cbc": solve_cbc}[backend]
    left_s = max(0.01, deadline - time.process_time())
    res = solver(mdl, min(left_s, options.milp_time_limit_s or left_s), rel_gap)
    if res is not None and res.chosen is None and incumbent is None:
        res = None  # a bound alone answers nothing
    limit = f"the {time_limit_text(options)}"
    if options.milp_time_limit_s is not None and options.milp_time_limit_s < left_s:
        limit = f"the MILP's time limit ({options.milp_time_limit_s:g} s)"
    if res is None and incumbent is None:
        if answer is None:
            left_s = max(0.01, deadline - time.process_time())
            answer = dp_answer(graph, budget_bytes, replace(dp, time_limit_s=left_s))
        if isinstance(answer, InfeasibleBudgetError):
            raise InfeasibleBudgetError(
                budget_bytes, answer.min_bytes, "(solver 'ilp', non-nested regions)"
            )
        who = "dp (depth 1)" if answer.solver == "dp" else answer.solver
        note = f"{backend}: no solution within {limit}; {who} answered ({answer.note})"
        return Schedule(answer.regions, answer.solver, None, note)
    note = f"{backend}, {len(regions)} candidates"
    chosen, over = incumbent, None
    if res is not None:
        note += f", {res.seconds:.2f} s in the MILP"
        cost = sum(mdl.cost[k] for k in res.chosen or [] if k < len(x))
        pick = None if res.chosen is None else [k for k in res.chosen if k < len(x)]
        if pick is not None and not fits(graph, budget_bytes, [regions[k] for k in pick]):
            # The MILP prices neither the RNG state a CPU checkpoint call over a random node
            # stashes (simulate's Rule 12) nor BatchNorm's buffer copies (Rule 9): its pick may
            # exceed the budget by simulate where dp's, which prices them, fits (the small
            # U-Net's graph form on a CPU, from 54% to 90% of eager). The warm start answers
            # then.
            note += ", its pick over the budget by simulate (Rules 9 and 12 unpriced)"
            pick, over = None, [regions[k] for k in pick]
        if pick is not None and (upper is None or cost < upper):
            chosen, upper = pick, cost
        else:
            note += ", dp's warm start not beaten"
        if not res.optimal:
            note += f", stopped at {limit}"
    gap = None
    if res is not None and res.bound is not None and upper is not None:
        gap = max(0.0, (upper - res.bound) / upper) if upper > 0 else 0.0
    elif res is not None and res.optimal and over is None:  # the gap of the pick it kept
        gap = res.gap
    if res is None:
        note += f"; no MILP answer within {limit}: dp (depth 1) answered"
        return finish(graph, budget_bytes, [regions[k] for k in chosen], "dp", note)
    if chosen is None:  # the MILP's pick was over the budget, with no warm start to keep
        if answer is None:
            left_s = max(0.01, deadline - time.process_time())
            answer = dp_answer(graph, budget_bytes, replace(dp, time_limit_s=left_s))
        if isinstance(answer, Schedule):
            return Schedule(answer.regions, answer.solver, None, f"{note}; dp answered")
        # the least stated: the lower of dp's and the pick's peak (finish raises)
        return finish(graph, budget_bytes, over, "ilp", note, min_bytes=answer.min_bytes)
    return finish(graph, budget_bytes, [regions[k] for k in chosen], "ilp", note, gap=gap)


def fits(graph: CostGraph, budget_bytes: float, regions: list[Region]) -> bool:
    """Whether the schedule of non-nested ``regions`` (in any order: simulate orders them)
    fits the budget by ``simulate``."""
    return simulate(graph, Schedule(tuple(regions))).peak_bytes <= budget_bytes
