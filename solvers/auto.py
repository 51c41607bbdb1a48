"""``auto``: run the solvers that suit the graph and keep the cheapest schedule within budget.

``dp`` is the workhorse (exact over nested regions on its candidate cuts); the cheap fixed
policies (selective, every block, Chen's greedy) are also tried because each can reach a point
``dp``'s space lacks (selective keeps matmul outputs while recomputing their inputs). Small
graphs also get the exact ``ilp``. Schedule.solver names the winner; Schedule.note lists the
time each of the others adds to the step.
"""

from __future__ import annotations

from planner.solvers.costgraph import CostGraph, Schedule
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import get_solver, register
from planner.solvers.simulate import simulate

ILP_MAX_NODES = 60


@register("auto")
def solve_auto(graph: CostGraph, budget_bytes: float, **opts) -> Schedule:
    names = ["none", "selective", "uniform", "greedy", "dp"]
    if len(graph.nodes) <= ILP_MAX_NODES:
        names.append("ilp")
    found: list[tuple[float, int, str, Schedule]] = []
    least: int | None = None
    for name in names:
        try:
            schedule = get_solver(name)(graph, budget_bytes)
        except InfeasibleBudgetError as e:
            least = e.min_bytes if least is None else min(least, e.min_bytes)
            continue
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
    return Schedule(best.regions, best.solver, best.gap, note.strip("; "))
