"""``auto``: run the solvers that suit the graph and keep the cheapest schedule within budget.

``dp`` is the workhorse (exact over nested regions on its candidate cuts); the cheap fixed
policies (selective, every block, Chen's greedy) are also tried because each can reach a point
``dp``'s space lacks (selective keeps matmul outputs while recomputing their inputs). Small
graphs also get the exact ``ilp``. Schedule.solver names the winner; Schedule.note lists the
time each of the others adds to the step, and what the time limit cut short. On
module-granular graphs (``CostGraph.region_spans``: plans applied in place) only none, dp and
ilp run: the block strategies keep to the spans too, but within any budget one of them fits, dp
is no slower (at each one's own peak: ``benchmarks/dominance.py``).

Options: ``time_limit_s`` (default AUTO_TIME_LIMIT_S: the solve step of ``planner.plan``; CPU
time of this process, as every solver's: ``SolverOptions.deadline``) bounds the whole call and
is shared by the solvers in the order they run, the cheap ones first: ``greedy`` (anytime) gets
at most GREEDY_SHARE of it, ``dp`` (anytime: coarse to fine, the best level done) what is left
but ILP_SHARE when ``ilp`` runs after it. Each solver's own options go in the field named after
it, as its options dataclass or a mapping of its keywords: ``solve_auto(graph, budget,
time_limit_s=30, dp={"max_span": 4})``, or through ``planner.plan(model, x, 1.5,
time_limit_s=30, dp={"max_span": 4})``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

from planner.solvers.basic import UniformOptions
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.dp_levels import LEVEL_GROWTH, DPOptions, is_staged
from planner.solvers.errors import InfeasibleBudgetError, size_text
from planner.solvers.greedy import GreedyOptions
from planner.solvers.ilp import ILPOptions
from planner.solvers.registry import (
    DEFAULT_TIME_LIMIT_S,
    SolverOptions,
    get_solver,
    register,
    time_limit_text,
)
from planner.solvers.selective import SelectiveOptions
from planner.solvers.simulate import simulate

ILP_MAX_NODES = 60
# The whole solve's default time (plan()'s solve step), as every solver's. 10 s was tried: on
# a loaded machine auto then stated a least feasible budget that its next call, cut short
# sooner, could not reach.
AUTO_TIME_LIMIT_S = DEFAULT_TIME_LIMIT_S
GREEDY_SHARE = 0.25  # most of the time limit greedy (anytime: thresholds in turn) may take
ILP_SHARE = 0.2  # of what is left when dp starts, the share dp leaves to ilp


@dataclass(frozen=True)
class AutoOptions(SolverOptions):
    """``time_limit_s`` for the whole call; one field per solver auto runs, with its options
    (their own time limits are capped by what is left when they start)."""

    searches: ClassVar[bool] = True

    time_limit_s: float = AUTO_TIME_LIMIT_S
    none: SolverOptions = SolverOptions()
    selective: SelectiveOptions = SelectiveOptions()
    uniform: UniformOptions = UniformOptions()
    greedy: GreedyOptions = GreedyOptions()
    dp: DPOptions = DPOptions()
    ilp: ILPOptions = ILPOptions()


@register("auto", options=AutoOptions)
def solve_auto(graph: CostGraph, budget_bytes: float, options: AutoOptions) -> Schedule:
    deadline = options.deadline()
    names = ["none", "selective", "uniform", "greedy", "dp"]
    if graph.region_spans is not None:
        names = ["none", "dp"]  # dp is no slower than the block strategies (module docstring)
    if len(graph.nodes) <= ILP_MAX_NODES:
        names.append("ilp")
    found: list[tuple[float, int, str, Schedule]] = []
    least: int | None = None
    unknown: list[str] = []  # cut short before they knew the least they reach
    cut_short: list[str] = []
    for k, name in enumerate(names):
        left_s = deadline - time.process_time()
        if left_s <= 0 and found:
            cut_short += [f"{n} not run" for n in names[k:]]
            break
        own: SolverOptions = getattr(options, name)
        if name == "greedy":
            left_s = min(left_s, GREEDY_SHARE * options.time_limit_s)
        if name == "dp" and "ilp" in names:
            left_s *= 1 - ILP_SHARE
        if name == "dp" and found and isinstance(own, DPOptions) and is_staged(graph, own):
            # A schedule is in hand: the early answer dp's coarsest level is for. On graphs
            # staged even at dp's finest level that level never answered (10k chain, 7B shape,
            # Mamba-128: 192 stages did; Mamba's 48 fit nothing, in 3 s).
            own = replace(own, first_stages=LEVEL_GROWTH * own.first_stages)
        own = replace(own, time_limit_s=max(0.0, min(own.time_limit_s, left_s)))
        started = time.process_time()
        try:
            schedule = get_solver(name)(graph, budget_bytes, own)
        except InfeasibleBudgetError as e:
            if e.min_bytes is not None:  # None: cut short before it knew
                least = e.min_bytes if least is None else min(least, e.min_bytes)
            elif name != "none":
                unknown.append(name)
            if time.process_time() - started >= own.time_limit_s:
                cut_short.append(f"{name}: nothing within budget in its {time_limit_text(own)}")
            continue
        if schedule.solver != name or time_limit_text(own) in schedule.note:
            cut_short.append(f"{name}: {schedule.note}")
        sim = simulate(graph, schedule)
        # Ranked by the whole step's time: recomputation, offload transfers and each region's
        # own overhead (forward and backward are the same for every schedule).
        found.append((sim.step_time_s, sim.peak_bytes, name, schedule))
        if name == "none":
            break  # the eager step fits: nothing beats no recomputation
    if not found and unknown:
        # the others' least is no least: the solver cut short may reach below it (T5 in place:
        # dp out of time at 29-59% of eager, 'none' naming the eager peak as the least)
        reached = "" if least is None else f"; the others reach no lower than {size_text(least)}"
        raise InfeasibleBudgetError(
            budget_bytes, None, f"(solver 'auto': {', '.join(unknown)} cut short{reached})"
        )
    if not found:
        raise InfeasibleBudgetError(budget_bytes, least, "(solver 'auto')")
    found.sort(key=lambda f: (f[0], f[1]))
    time_s, _, name, best = found[0]
    base_s = graph.step_time_s  # the notes give the time each adds to the step
    others = ", ".join(f"{n} {(t - base_s) * 1e3:.1f} ms" for t, _, n, _ in found[1:])
    note = best.note + (f"; auto also tried: {others}" if others else "")
    if cut_short:
        note += f"; cut short by the {time_limit_text(options)}: " + "; ".join(cut_short)
    return Schedule(best.regions, best.solver, best.gap, note.strip("; "))
