"""``dp``, the solver: the programme of ``solvers/dp.py`` run level by level, its runs kept.

Its claim: among the laminar families of recompute regions of its space, dp finds one of least
predicted step time (recompute time plus each region's bookkeeping,
``CostGraph.region_overhead_s``) whose peak *by simulate* fits the budget. Its prices are
``simulate``'s Rules 1-5 and 10 in closed form: early stop (Rule 5: a recomputation runs to its
last save, the last saving node stops after that save, and a nested region that is the last save
is not run by its parent's recomputation), the lifetimes of nested regions' arguments (Rule
3: to the end of the nested region's own recomputation unless it saves them, and handed down to
the regions nested in it that read them) and of a top-level region's frame (Rule 2: its
arguments and stash live to the backward of its first saving node, a :data:`Credit` its
context carries down; none when nothing in it saves). Asserted against
brute force (every laminar family, scored by ``simulate``) at every budget on random chains,
DAGs with skips and held storages, and chains with in-place writes, with Rule 5 on and off
(``tests/solvers/test_dp_exactness.py``), and with nodes that save nothing
(``tests/solvers/test_frame.py``). Outside that exact space: selective regions, priced as
recomputed to their end, their cache handed back as simulate's Rule 6 says
(``prices.region_peak``),
and three rules only estimated graphs use, which dp does not model exactly, so its prices may
differ from simulate's there: Python-held storages (``Tensor.freed_after``, Rule 1), buffer
copies (Rule 9) and CPU checkpoints' RNG stashes (Rule 12: priced per region over a node that
draws random numbers, nested ones approximately). :func:`solve_dp` replays its answer through
``simulate`` and never returns a plan above the budget by it. ``Schedule.gap`` is 0.0 only when
the space was every interval of the uncoarsened graph on a 1-byte grid and the graph uses none of
those three rules; the note names the space searched.

With ``DPOptions.offload`` (by default: when ``CostGraph.host_link``, a GPU's) the space also
holds top-level offload regions with nothing nested in them (simulate's Rule 7: saves sent to
host, transfers partly hidden behind the region's compute), priced as the time they add to the
step; exact against brute force over the same space too. Never by default on a CPU, where the
host is the device (an offload frees nothing there). On a module-granular graph they are its
spans (the in-place form runs them with ``passes/offload.py``).

Graphs with more than ``DPOptions.max_bounds`` region boundaries are coarsened into stages
(:func:`stage_bounds`): regions then begin and end only at stage boundaries and span at most
``DPOptions.staged_span`` stages, and the note says so; such a graph refines only within
STAGED_REFINE_SHARE of the time limit. :func:`solve_dp` is anytime: on a graph with twice
``first_stages`` boundaries or more it solves coarse to fine (``DPOptions.first_stages`` stages,
FIRST_STAGES by default, times LEVEL_GROWTH, up to ``max_bounds``:
:func:`stage_levels`), keeps the best schedule any level found, and answers with it when the
time limit (``DPOptions.time_limit_s``) cuts the next level short or leaves too little time to
start it; the note names the space of the level that answered and what was cut short. The
programme assumes every tensor a node saves is one it reads or produces (true of autograd).
:func:`solve_dp` replays its answer through ``simulate``.

The least feasible budget dp states is not its search's: that moved with the budget's grid,
the objective and how far the time limit let the search get (Qwen2-MoE graph form: 994,216 B
stated at 1 B, then 1,055,976 B at 994,216 B). It is :func:`least_memory`'s, one schedule
sought on a space fixed by counted work, on the graph with objective-free times, and dp
answers with it wherever its search finds nothing within a budget it fits.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from planner.solvers.common import finish
from planner.solvers.costgraph import CostGraph, Region, Schedule
from planner.solvers.dp import INF, OutOfTime, Programme, Work
from planner.solvers.dp_layout import Space
from planner.solvers.dp_levels import (
    DEFAULT_OPTIONS,
    FIRST_STAGES,
    REFINE_GAIN,
    STAGED_REFINE_SHARE,
    DPOptions,
    coarse_cut_points,
    dp_levels,
    is_staged,
    level_space,
    prices_exactly,
    stage_bounds,
)
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.frontier import Frontier, dense
from planner.solvers.greedy import GreedyOptions, solve_greedy
from planner.solvers.prices import prices
from planner.solvers.registry import register, time_limit_text
from planner.solvers.revolve import RevolveOptions, solve_revolve
from planner.solvers.simulate import simulate


@dataclass(frozen=True)
class Solved:
    """One run of the programme up to ``cap_bytes``: ask it for any budget up to that."""

    graph: CostGraph
    programme: Programme
    root: Frontier

    @property
    def unit_bytes(self) -> int:
        return self.programme.p.unit_bytes

    @property
    def root_value(self) -> np.ndarray:
        """The whole step's ``V[m]`` at every unit of the grid, as an array (one float per
        unit up to the cap: for small graphs and tests; :attr:`root` is the same function)."""
        return dense(self.root, self.programme.size)

    def least_bytes(self) -> int | None:
        """Least budget (rounded up to the grid) any schedule of the space fits, or None."""
        first = self.root.first
        return None if first is None else first * self.unit_bytes

    def schedule(self, budget_bytes: float) -> Schedule | None:
        """The least-recompute schedule within ``budget_bytes``, or None if none fits."""
        m = min(int(budget_bytes // self.unit_bytes), self.programme.size - 1)
        if m < 0 or self.root.at(m) == INF:
            return None
        prog = self.programme
        regions = prog.regions(prog.key(0, prog.p.n, (), True, True, 0), m, 0)
        return Schedule(tuple(regions), "dp")


def solve_all(
    graph: CostGraph,
    cap_bytes: float,
    options: DPOptions = DEFAULT_OPTIONS,
    deadline: float | None = None,
    work: Work | None = None,
) -> Solved:
    """Run the programme once for every budget up to ``cap_bytes`` (OutOfTime past
    ``deadline``, a ``time.process_time()`` value: dp's clock, see :func:`solve_dp`), counting
    its work in ``work`` (None: a fresh count)."""
    unit = 1 if options.grid is None else max(1, math.ceil(cap_bytes / options.grid))
    p = prices(graph, unit)
    p = replace(p, bounds=stage_bounds(graph, p.bounds, options.max_bounds))
    span = p.n if options.max_span is None else options.max_span
    coarse = coarse_cut_points(graph, options.coarse_cuts)
    space = Space(
        coarse_cuts=tuple(coarse),
        max_span=span,
        max_depth=options.max_depth,
        grid_units=int(cap_bytes // unit),
        coarse_span=options.coarse_span,
        selective=options.selective,
        spans=graph.region_spans,
        offload=graph.host_link if options.offload is None else options.offload,
    )
    prog = Programme(p, space, deadline, work)
    return _run(graph, prog)


def _run(graph: CostGraph, prog: Programme) -> Solved:
    n = prog.p.n
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * n + 1000))
    try:
        start = (0, n, (), True, True, 0)  # the whole step, from its first cut, as root
        root = prog.value_at(prog.key(*start), *start)
    finally:
        sys.setrecursionlimit(limit)
    return Solved(graph, prog, root)


def without_selective(
    solved: Solved, deadline: float | None = None, work: Work | None = None
) -> Solved:
    """``solved``'s programme run again without selective regions, as :func:`solve_all` with
    ``selective=False`` and the same cap would, sharing every state of a region context
    instead of solving it again: only root states offer selective regions (``value_at``), and
    nothing else about a state depends on ``selective``, so a region context's value and
    choices are the same (T5 in place: 439 of the 547 states). The root's are solved again
    (OutOfTime past ``deadline``), counted in ``work`` (None: a fresh count)."""
    prog = solved.programme
    root = {i for desc, i in prog._ids.items() if desc[0] == "root"}
    again = copy.copy(prog)  # its caches of what does not depend on the state are shared too
    again.memo = {key: got for key, got in prog.memo.items() if key not in root}
    again.space = replace(prog.space, selective=False)
    again.selective = False
    again.deadline = deadline
    again.work = Work() if work is None else work
    return _run(solved.graph, again)


# Programmes already run (:func:`solved_once`), by (graph, space, cap): a programme run up to
# the eager peak answers every budget below it (its cost hardly depends on the cap: the tiny
# GPT-2's graph, 29,176 states, 12.8-13.4 s at caps from 30% to 100% of eager), so a sweep of
# budgets, compare's rows and a re-plan at another budget read one run.
SOLVED_CACHE_SIZE = 4
_SOLVED_CACHE: dict[tuple[CostGraph, DPOptions, float], tuple[Solved, int, int]] = {}


def solved_once(
    graph: CostGraph,
    cap_bytes: float,
    options: DPOptions,
    deadline: float | None,
    work: Work,
    make: Callable[[], Solved] | None = None,
) -> Solved:
    """:func:`solve_all`'s run (or ``make()``'s, the same programme got another way), from
    the cache when this graph, space and cap ran before (SOLVED_CACHE_SIZE runs kept). A run
    read from the cache counts the work it took again (in ``work``, the search's): whether dp
    refines further
    is decided on counted work, which must not depend on what ran before."""
    key = (graph, replace(options, time_limit_s=0.0), cap_bytes)
    got = _SOLVED_CACHE.pop(key, None)
    if got is None:
        states, cells = work.states, work.cells
        if make is not None:
            solved = make()
        else:
            solved = solve_all(graph, cap_bytes, options, deadline, work)
        got = (solved, work.states - states, work.cells - cells)
    else:
        work.states += got[1]
        work.cells += got[2]
    _keep_recent(_SOLVED_CACHE, key, got, SOLVED_CACHE_SIZE)
    return got[0]


def _keep_recent(cache: dict, key: object, value: object, size: int) -> None:
    """``cache[key] = value`` as the most recent of at most ``size`` entries (a popped
    entry put back is made the most recent)."""
    cache[key] = value
    while len(cache) > size:
        del cache[next(iter(cache))]


# The least-memory schedule (:func:`least_memory`) is sought on dp's levels coarse to fine
# (:func:`dp_levels`, from FIRST_STAGES stages), each one solved
# whole, while the work the next is predicted to take (nominal, counted: :class:`Work`) keeps the
# whole search within this many nominal seconds. A fixed count, not the time limit: the least
# stated must not move with the time a caller (auto's share for dp) leaves, nor with the load.
# Qwen2 graph form (112 boundaries): 40 stages 1.4 s, all 112 (predicted 16 s) 9.6 s, 661,128 B
# against 739,424 B; Qwen2-MoE (178): 43 stages 1.5 s, all 178 predicted 25 s: not refined.
LEAST_NOMINAL_S = 20.0
# Of each level's whole step, the schedules at this many of its least budgets where its value
# changes (its frontier's first points) are replayed through simulate and the lowest peak
# kept: where the graph uses simulate's approximated rules, the programme's estimated prices
# do not rank the few least schedules as simulate does (Qwen2: its least cell 663,385 B by
# simulate, a later one 661,128 B).
LEAST_CELLS = 32
# Least-memory schedules already sought, by (graph as least_memory sees it, its space): a
# sweep of budgets, the flops objective's graph and auto's calls then seek it once.
LEAST_CACHE_SIZE = 4


@dataclass(frozen=True)
class LeastMemory:
    """dp's least-memory schedule: ``peak_bytes`` its peak by ``simulate``, the least budget dp
    states (every budget from it up is planned: :func:`solve_dp`); ``space`` names the space
    of the level that found it."""

    peak_bytes: int
    schedule: Schedule
    space: str


def memory_graph(graph: CostGraph) -> CostGraph:
    """``graph`` as the least-memory search sees it: its memory as it is, every node's
    recomputation timed by the roofline and no checkpoint overhead, so that the objective's
    re-timing (``graph_for_objective``, ``weighted_graph``: memory unchanged) does not change
    which of the least-memory schedules is picked (the least the error states)."""
    nodes = tuple(
        replace(
            nd,
            fwd_time_s=max(
                nd.fwd_flops / graph.flops_per_s, nd.fwd_bytes_accessed / graph.bytes_per_s
            ),
        )
        for nd in graph.nodes
    )
    return replace(
        graph,
        nodes=nodes,
        recompute_scale=1.0,
        region_overhead_s=0.0,
        saving_node_overhead_s=0.0,
        selective_call_overhead_s=0.0,
        offload_region_overhead_s=0.0,
        offloaded_storage_overhead_s=0.0,
    )


def least_memory(graph: CostGraph, options: DPOptions = DEFAULT_OPTIONS) -> LeastMemory:
    """dp's least-memory schedule over its space without selective regions (whose recomputation
    simulate prices higher than dp), the same whatever the budget asked, the objective, the
    time limit and the load: the least :func:`solve_dp` states, and what it answers with at
    that budget when its search finds nothing (rounding to the budget's grid).

    No deadline: the levels searched are fixed by counted work (LEAST_NOMINAL_S), the coarsest
    always. Cached (LEAST_CACHE_SIZE graphs)."""
    key = (memory_graph(graph), replace(options, time_limit_s=0.0, selective=False))
    got = _LEAST_CACHE.pop(key, None)
    if got is None:
        got = _seek_least_memory(*key)
    _keep_recent(_LEAST_CACHE, key, got, LEAST_CACHE_SIZE)
    return got


_LEAST_CACHE: dict[tuple[CostGraph, DPOptions], LeastMemory] = {}


def _seek_least_memory(graph: CostGraph, options: DPOptions) -> LeastMemory:
    eager = simulate(graph, Schedule()).peak_bytes
    # The eager step itself, for when no schedule lowers its peak: rounded up onto the grid,
    # none (the eager one included) then fits under it.
    best = (eager, Schedule(), "the eager step")
    options = replace(options, first_stages=FIRST_STAGES)
    spent_s, done = 0.0, None  # nominal work so far; (size, nominal s) of the last level
    levels = dp_levels(graph, options)
    for _, level_options, stages in levels:
        span = stages if level_options.max_span is None else min(level_options.max_span, stages)
        # the work grows about as stages x span^2 (Qwen2-MoE: 43 stages, span 4: 1.5 s; 178,
        # span 8: 25 s)
        size = stages * span * span
        if done is not None and spent_s + done[1] * size / done[0] > LEAST_NOMINAL_S:
            break
        work = Work()
        solved = solve_all(graph, eager, level_options, work=work)
        done = (size, work.nominal_s())
        spent_s += done[1]
        seen: set[tuple[Region, ...]] = set()
        for m in solved.root.xs[:LEAST_CELLS]:  # the least budgets where the value changes
            schedule = solved.schedule(int(m) * solved.unit_bytes)
            if schedule is None or schedule.regions in seen:
                continue
            seen.add(schedule.regions)
            peak = simulate(graph, schedule).peak_bytes
            if peak < best[0]:
                best = (peak, schedule, level_space(graph, level_options)[1])
    peak, schedule, space = best
    return LeastMemory(peak, Schedule(schedule.regions, "dp"), space)


def least_memory_schedule(
    graph: CostGraph, options: DPOptions = DEFAULT_OPTIONS
) -> tuple[int, Schedule]:
    """(:func:`least_memory`'s peak by ``simulate``, its schedule)."""
    found = least_memory(graph, options)
    return found.peak_bytes, found.schedule


def least_peak(graph: CostGraph, options: DPOptions = DEFAULT_OPTIONS) -> int:
    """The least budget dp states and plans (:func:`least_memory`)."""
    return least_memory(graph, options).peak_bytes


class _NoFit(Exception):
    """Nothing in the space searched fits the budget (the least it reaches was not sought)."""


def _solve_within(
    graph: CostGraph,
    budget_bytes: float,
    options: DPOptions,
    deadline: float,
    eager: int,
    work: Work,
) -> tuple[tuple[Region, ...], str, float | None]:
    """(regions, note, gap) of the least recompute time within budget over ``options``'
    space, its work counted in ``work``; OutOfTime past ``deadline``; _NoFit when nothing of
    it fits on the budget's grid (:func:`solve_dp` then answers with :func:`least_memory`'s
    schedule if it fits)."""
    every, note = level_space(graph, options)
    # Optimal for simulate only where its prices are simulate's (see the module docstring).
    every = every and prices_exactly(graph)
    # Up to the eager peak, so that the run answers every budget (solved_once); on a grid,
    # whose step is a share of the cap, up to the budget.
    cap = float(eager) if options.grid is None else min(float(budget_bytes), eager)
    solved: Solved | None = None
    for with_selective in (True, False) if options.selective else (False,):
        opts = replace(options, selective=with_selective)
        if solved is None:
            solved = solved_once(graph, cap, opts, deadline, work)
        else:  # the same programme without selective regions, its region contexts shared
            again = partial(without_selective, solved, deadline, work)
            solved = solved_once(graph, cap, opts, deadline, work, again)
        schedule = solved.schedule(budget_bytes)
        if schedule is None:
            break  # nothing of the space fits, nor of its part without selective regions
        if simulate(graph, schedule).peak_bytes > budget_bytes:
            continue  # simulate prices selective recomputation higher
        if solved.unit_bytes > 1:
            note += f", bytes rounded up to {solved.unit_bytes}"
        exact = every and solved.unit_bytes == 1
        return schedule.regions, note, 0.0 if exact else None
    raise _NoFit


@register("dp", options=DPOptions)
def solve_dp(graph: CostGraph, budget_bytes: float, options: DPOptions) -> Schedule:
    """Least recompute time within the budget over nested regions (the space: DPOptions).

    The least budget it states is :func:`least_memory`'s: one schedule's peak by ``simulate``,
    sought on a space fixed by counted work (no deadline) over the graph with objective-free
    times, so the same whatever the budget asked, the objective, the time limit and the load.
    When nothing of the space searched fits the budget on its grid (rounding up, or a model
    disagreement), that schedule answers if it fits: every budget from the least it states up
    is planned.

    Anytime within ``options.time_limit_s`` (seconds of this process's CPU time): on a graph
    with at least twice FIRST_STAGES region boundaries it solves coarse to fine
    (:func:`stage_levels`), each level a whole programme over finer cuts, and keeps the best
    schedule found (the note names the space that schedule was solved over, and what the time
    limit cut short). A finer level's space need not contain a coarser one's: on the tiny
    GPT-2's graph, 44 stages spanning 4 each reach regions of about 10 boundaries, which all 111
    boundaries spanning 8 reach only between coarse cuts. On a graph coarsened even at its
    finest level (more boundaries than ``max_bounds``), refining stops once a level gains less
    than REFINE_GAIN of the step time.
    A refinement predicted not to finish in the time left (the last level's work per stage
    times its stages, counted: :class:`Work`, not timed) is not started. A programme cut short
    answers nothing: with no level done, dp answers with ``greedy``'s schedule (else
    ``revolve``'s, else the least-memory one); the note says so. Each level's programme is run
    up to the eager peak and kept (:func:`solved_once`): a later solve of the same graph at
    another budget reads it.
    """
    # dp's time limit is this process's CPU time, as every solver's (SolverOptions.deadline):
    # other jobs on the machine stretch its wall time, not its work, and must not cut a level
    # short that a quiet machine finishes (and so change the plan).
    deadline = options.deadline()
    start = deadline - options.time_limit_s
    eager = simulate(graph, Schedule()).peak_bytes
    if eager <= budget_bytes:  # nothing to recompute (and no rounding to lose it to)
        return finish(graph, budget_bytes, [], "dp", "the eager step fits", gap=0.0)
    limit = time_limit_text(options)
    levels = dp_levels(graph, options)
    staged = is_staged(graph, options)
    best: tuple[float, tuple[Region, ...], str, float | None] | None = None
    stopped = ""
    search_s = 0.8 * options.time_limit_s  # the search's share, the fallback the rest
    search_end = start + search_s
    done: tuple[int, float] | None = None  # the last level solved: its size and nominal s
    work = Work()  # this search's, counted across its levels
    work0_s = work.nominal_s()
    for level, level_options, stages in levels:
        level_work_s = work.nominal_s()
        if done is not None and best is not None:
            # A level's work grows about linearly with its stages (LEVEL_GROWTH): a
            # refinement that cannot finish in the time left is not started, only to be cut
            # short. A level that may give dp's first answer is
            # always tried (the prediction is conservative: Mamba-128's 192 stages take 2.6
            # times its 48, not 3.8). Time here is nominal (STATE_NOMINAL_S): counted work.
            predicted_s = done[1] * stages / done[0]
            spent_s = level_work_s - work0_s
            left_s = search_s - spent_s
            of = f"the {limit}"
            share_s = STAGED_REFINE_SHARE * options.time_limit_s
            if staged and share_s < search_s:
                left_s, of = (
                    share_s - spent_s,
                    f"the share of the {limit} a staged graph refines in",
                )
            if predicted_s > left_s:
                stopped = (
                    f"; refining to {level} not started (about {predicted_s:.0f} s "
                    f"predicted, {max(left_s, 0.0):.0f} s left of {of})"
                )
                break
        try:
            regions, note, gap = _solve_within(
                graph, budget_bytes, level_options, search_end, eager, work
            )
        except OutOfTime:
            stopped = f"; refining to {level} cut short at the {limit}"
            break
        except _NoFit:
            done = (stages, work.nominal_s() - level_work_s)
            continue
        done = (stages, work.nominal_s() - level_work_s)
        step_s = simulate(graph, Schedule(tuple(regions))).step_time_s
        if best is not None and staged and step_s >= best[0] * (1 - REFINE_GAIN):
            if step_s < best[0]:
                best = (step_s, tuple(regions), note, gap)
            stopped = f"; refining stopped at {level} (less than {REFINE_GAIN:.1%} gained)"
            break
        if best is None or step_s < best[0]:
            best = (step_s, tuple(regions), note, gap)
    if best is not None:
        _, regions, note, gap = best
        return finish(graph, budget_bytes, regions, "dp", note + stopped, gap=gap)
    # Nothing of the space searched fits the budget on its grid, or the time limit cut the
    # search short before it found something. When cut short, greedy (cheap, anytime), else
    # revolve, whose deep nesting reaches the least memory of the fixed policies.
    fallback = None
    fallbacks = ((solve_greedy, GreedyOptions), (solve_revolve, RevolveOptions))
    if graph.region_spans is not None or not stopped:
        fallbacks = ()  # neither keeps to module spans
    for solve, opts in fallbacks:
        left_s = max(0.0, deadline - time.process_time())
        try:
            fallback = solve(graph, budget_bytes, opts(time_limit_s=left_s))
            break
        except InfeasibleBudgetError:
            continue
    if fallback is not None:
        # what stopped dp: a level cut short, or one predicted not to finish in the time left
        note = f"dp {stopped.removeprefix('; ')}; {fallback.solver} answered ({fallback.note})"
        return Schedule(fallback.regions, fallback.solver, None, note)
    # The least-memory schedule: the same whatever the budget, the objective or the time
    # limit, so the least it states is planned at that budget and every one above it.
    least = least_memory(graph, options)
    if least.peak_bytes > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, least.peak_bytes, "(solver 'dp')")
    # Not proven the least time within the budget: it is picked on objective-free times.
    note = f"least-memory schedule (searched over {least.space}){stopped}"
    return finish(graph, budget_bytes, least.schedule.regions, "dp", note)
