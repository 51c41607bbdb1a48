"""``auto``: run the solvers that suit the graph and keep the cheapest schedule within budget.

``dp`` is the workhorse (exact over nested regions on its candidate cuts); the cheap fixed
policies (selective, every block, Chen's greedy) are also tried because each can reach a point
``dp``'s space lacks (selective keeps matmul outputs while recomputing their inputs). Small
graphs also get the exact ``ilp``. Schedule.solver names the winner; Schedule.note lists the
time each of the others adds to the step, and what the time limit cut short. On
module-granular graphs (``CostGraph.region_spans``: plans applied in place) only the solvers
that keep to the spans run: none, dp, ilp.

Options: ``time_limit_s`` bounds the whole call and is shared by the solvers in the order they
run (the cheap ones first); each solver's own options go in the field named after it, as its
options dataclass or a mapping of its keywords:
``solve_auto(graph, budget, time_limit_s=30, dp={"max_span": 4})``, or through
``planner.plan(model, x, 1.5, time_limit_s=30, dp={"max_span": 4})``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from planner.solvers.basic import UniformOptions
from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.dp import DPOptions
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.greedy import GreedyOptions
from planner.solvers.ilp import ILPOptions
from planner.solvers.registry import SolverOptions, get_solver, register, time_limit_text
from planner.solvers.selective import SelectiveOptions
from planner.solvers.simulate import simulate

ILP_MAX_NODES = 60


@dataclass(frozen=True)
class AutoOptions(SolverOptions):
    """``time_limit_s`` for the whole call; one field per solver auto runs, with its options
    (their own time limits are capped by what is left when they start)."""

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
        names = ["none", "dp"]  # the solvers whose regions follow module calls
    if len(graph.nodes) <= ILP_MAX_NODES:
        names.append("ilp")
    found: list[tuple[float, int, str, Schedule]] = []
    least: int | None = None
    cut_short: list[str] = []
    for k, name in enumerate(names):
        left_s = deadline - time.perf_counter()
        if left_s <= 0 and found:
            cut_short += [f"{n} not run" for n in names[k:]]
            break
        own: SolverOptions = getattr(options, name)
        if name == "dp" and "ilp" in names:
            left_s *= 0.8  # leave ilp a share
        own = replace(own, time_limit_s=max(0.0, min(own.time_limit_s, left_s)))
        try:
            schedule = get_solver(name)(graph, budget_bytes, own)
        except InfeasibleBudgetError as e:
            least = e.min_bytes if least is None else min(least, e.min_bytes)
            continue
        if schedule.solver != name or time_limit_text(own) in schedule.note:
            cut_short.append(f"{name}: {schedule.note}")
        sim = simulate(graph, schedule)
        # Ranked by the whole step's time: recomputation, offload transfers and each region's
        # own overhead (forward and backward are the same for every schedule).
        found.append((sim.step_time_s, sim.peak_bytes, name, schedule))
        if name == "none":
            break  # the eager step fits: nothing beats no recomputation
    if not found:
        raise InfeasibleBudgetError(budget_bytes, least or 0, "(solver 'auto')")
    found.sort(key=lambda f: (f[0], f[1]))
    time_s, _, name, best = found[0]
    base_s = graph.step_time_s  # the notes give the time each adds to the step
    others = ", ".join(f"{n} {(t - base_s) * 1e3:.1f} ms" for t, _, n, _ in found[1:])
    note = best.note + (f"; auto also tried: {others}" if others else "")
    if cut_short:
        note += f"; cut short by the {time_limit_text(options)}: " + "; ".join(cut_short)
    return Schedule(best.regions, best.solver, best.gap, note.strip("; "))
