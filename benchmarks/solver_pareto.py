"""Pareto fronts of every solver on GPT-ref: budgets swept from the least feasible to the eager
peak, predicted and measured peaks, recompute FLOPs and time, solve time; plus speed figures.

    python -m benchmarks.solver_pareto                 # full run with measured peaks (~10 min)
    python -m benchmarks.solver_pareto --no-measure    # predictions only (~3 min)
    python -m benchmarks.solver_pareto --budgets 6     # fewer budgets

Prints a markdown table and the checks the solvers issue asks for, and writes the fronts to
``benchmarks/solver_pareto.png``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.models import gpt_ref_example
from planner.comparison import compare
from planner.devices import profile_of_model
from planner.passes.capture import capture
from planner.passes.estimate import estimate
from planner.solvers.costgraph import Schedule
from planner.solvers.dp_search import least_memory_schedule, solve_dp
from planner.solvers.ilp import solve_ilp
from planner.solvers.registry import get_solver
from planner.solvers.simulate import simulate
from tests.solvers.synthetic import GraphBuilder

MIB = 2**20
SOLVERS = ("uniform", "sqrt", "greedy", "selective", "revolve", "dp", "ilp")
EXACT = ("dp", "ilp")


def uniform_chain(n: int) -> GraphBuilder:
    g = GraphBuilder()
    prev = None
    for i in range(n):
        reads = (prev,) if prev else ()
        g.add(
            f"n{i}",
            reads=reads,
            saves=reads,
            out_bytes=1 << 20,
            fwd_flops=10**9,
            param_grad_bytes=1 << 16,
        )
        prev = f"n{i}"
    return g.build(outputs=(prev,))


def speed_figures(graph) -> list[str]:
    lines = []
    chain = uniform_chain(1000)
    eager = simulate(chain, Schedule()).peak_bytes
    t0 = time.perf_counter()
    solve_dp(chain, eager / 4)
    lines.append(f"dp, 1,000-stage chain at 25% of eager: {time.perf_counter() - t0:.2f} s")
    eager = simulate(graph, Schedule()).peak_bytes
    for frac in (0.5, 0.2):
        t0 = time.perf_counter()
        s = solve_dp(graph, frac * eager)
        lines.append(f"dp, GPT-ref at {frac:.0%}: {time.perf_counter() - t0:.2f} s ({s.note})")
        t0 = time.perf_counter()
        s = solve_ilp(graph, frac * eager)
        gap = "n/a" if s.gap is None else f"{100 * s.gap:.2f}%"
        lines.append(
            f"ilp, GPT-ref at {frac:.0%}: {time.perf_counter() - t0:.2f} s, gap {gap} ({s.note})"
        )
    import planner

    model, example = gpt_ref_example()
    t0 = time.perf_counter()
    planner.plan(model, example, mem_budget_gb=0.5 * eager / 1e9, solver="auto", form="graph")
    lines.append(f"plan(solver='auto') on GPT-ref at 50%: {time.perf_counter() - t0:.2f} s")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-measure", action="store_true", help="predictions only")
    ap.add_argument("--budgets", type=int, default=8, help="number of budgets in the sweep")
    ap.add_argument("--png", default=str(Path(__file__).with_name("solver_pareto.png")))
    args = ap.parse_args()
    torch.manual_seed(0)

    model, example = gpt_ref_example()
    captured = capture(model, example)
    graph = estimate(
        captured.module, captured.args, captured.kwargs, rates=profile_of_model(captured.module)
    )
    eager = simulate(graph, Schedule()).peak_bytes
    every_block = simulate(graph, get_solver("uniform")(graph, eager))
    least, _ = least_memory_schedule(graph)
    print(
        f"GPT-ref: {len(graph.nodes)} nodes; predicted eager peak {eager / MIB:.1f} MiB, "
        f"every block {every_block.peak_bytes / MIB:.1f} MiB at "
        f"{100 * every_block.recompute_flops / graph.step_flops:.1f}% FLOPs; dp's least "
        f"feasible {least / MIB:.1f} MiB ({least / every_block.peak_bytes:.2f}x every block)"
    )

    k = max(2, args.budgets)
    fractions = sorted(
        {least / eager + (1 - least / eager) * i / (k - 1) for i in range(k)} | {0.5}
    )
    fractions = [min(1.0, f * 1.0005) for f in fractions]  # a hair above the least: rounding
    result = compare(
        model,
        example,
        solvers=list(SOLVERS),
        measure=not args.no_measure,
        budget_fractions=fractions,
        solver_opts={"ilp": {"time_limit_s": 10}},
        repeats=1,
        form="graph",
    )
    print(result.to_markdown())

    # The checks of the solvers issue.
    rows = [r for r in result.rows if r.feasible]
    by_budget: dict[int, dict[str, float]] = {}
    for r in rows:
        by_budget.setdefault(r.budget_bytes, {})[r.solver] = r.recompute_flops_pct
    wins = strict = 0
    for _budget, got in sorted(by_budget.items()):
        exact = [got[s] for s in EXACT if s in got]
        others = [v for s, v in got.items() if s not in EXACT]
        if not exact:
            continue
        best = min(exact)
        wins += all(best <= v + 1e-9 for v in others)
        strict += bool(others) and all(best < v - 1e-9 for v in others)
    print(
        f"\nbudgets where dp/ilp recompute FLOPs <= every other feasible solver: {wins} of "
        f"{len(by_budget)}; strictly less: {strict}"
    )
    half = [
        r for r in rows if r.solver in EXACT and abs(r.budget_bytes - 0.5 * eager) < 0.01 * eager
    ]
    for r in half:
        print(f"{r.solver} at 50% of eager: recompute {r.recompute_flops_pct:.1f}% of step FLOPs")
    measured = [r for r in rows if r.measured_peak_bytes is not None]
    over = [r for r in measured if r.measured_peak_bytes > r.budget_bytes]
    if measured:
        print(
            f"measured peak <= budget at {len(measured) - len(over)} of {len(measured)} points"
            + (
                ""
                if not over
                else ": over at "
                + ", ".join(
                    f"{r.solver}@{r.budget_bytes / MIB:.0f}MiB ({r.measured_peak_bytes / MIB:.1f})"
                    for r in over
                )
            )
        )
    grads = max(sum(n.param_grad_bytes for n in graph.nodes), 1)
    print(
        f"parameter gradients alone: {grads / MIB:.1f} MiB (a floor); dp's least feasible is "
        f"{least / grads:.2f}x that"
    )
    for line in speed_figures(graph):
        print(line)

    fig = result.plot()
    fig.savefig(args.png, dpi=120, bbox_inches="tight")
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
