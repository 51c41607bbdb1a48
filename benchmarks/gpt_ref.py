"""GPT-ref: every solver at 50% and 20% of the eager peak, predicted vs measured.

    python -m benchmarks.gpt_ref [--solvers none,uniform,sqrt] [--fractions 0.5,0.2]

Prints one markdown row per (solver, budget): predicted peak, measured peak (planner.measure,
CPU), recompute FLOPs as % of the eager step, CPU step-time ratio vs eager, solve time.
"""

from __future__ import annotations

import argparse
import time

import planner
from benchmarks.models import gpt_ref_example
from planner.planning import price
from planner.solvers.errors import InfeasibleBudgetError
from planner.solvers.registry import get_solver

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--solvers", default="none,uniform,sqrt")
    parser.add_argument("--fractions", default="0.5,0.2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model, example = gpt_ref_example()
    eager = planner.measure(model, example, repeats=args.repeats)
    t0 = time.perf_counter()
    priced = price(model, example, device="cpu")  # the roofline, as estimate's default
    graph = priced.graph
    estimate_s = time.perf_counter() - t0
    print(
        f"GPT-ref eager measured peak {eager.peak_bytes / MIB:.1f} MiB, step "
        f"{eager.step_time_s:.3f} s; capture+estimate {estimate_s:.2f} s\n"
    )
    print(
        "| solver | budget | predicted peak | measured peak | pred/meas | recompute FLOPs "
        "| time ratio | solve time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget = int(fraction * eager.peak_bytes)
        for name in args.solvers.split(","):
            t0 = time.perf_counter()
            try:
                schedule = get_solver(name)(graph, budget)
            except InfeasibleBudgetError as e:
                print(
                    f"| {name} | {fraction:.0%} ({budget / MIB:.0f} MiB) | infeasible: least "
                    f"{e.min_bytes / MIB:.1f} MiB | | | | | |"
                )
                continue
            solve_s = time.perf_counter() - t0
            p = priced.build(schedule, budget)
            m = planner.measure(p.module, example, repeats=args.repeats)
            print(
                f"| {p.solver} | {fraction:.0%} ({budget / MIB:.0f} MiB) "
                f"| {p.predicted_peak_bytes / MIB:.1f} MiB | {m.peak_bytes / MIB:.1f} MiB "
                f"| {p.predicted_peak_bytes / m.peak_bytes:.3f} "
                f"| +{p.predicted_recompute_flops / p.step_flops:.1%} "
                f"| {m.step_time_s / eager.step_time_s:.2f} | {solve_s * 1e3:.0f} ms |"
            )


if __name__ == "__main__":
    main()
