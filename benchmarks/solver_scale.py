"""How large a graph the solvers plan within their time limits: wall times, printed.

- a synthetic 10,000-node random chain (``tests/solvers/synthetic.py``), dp at 60% of eager;
- the Llama-7B shape (``benchmarks/plan_7b.py``, meta device), dp at 24 GB;
- Hugging Face Mamba from a tiny config (sequence 128: its slow scan unrolls into thousands of
  nodes), ``planner.plan`` with ``auto`` at 70% of the eager peak, then ``planner.measure`` of
  ``p.module`` against the budget;
- T5 in place (``benchmarks/conformance_models.py``, batch 2: 582 nodes, 93 nested module
  spans, Python-held storages dp does not price), ``auto`` at the conformance sweep's budgets
  (8 from the least feasible to eager) for both objectives: CPU seconds per solve and the plan.

Targets: dp <= 15 s on the chain and on the 7B shape; Mamba plans with auto in <= 30 s and
measures within budget. Times are wall clock and this process's CPU time, with the machine's
load average: on a shared machine the wall time is the CPU time stretched by the load.

Run: ``python -m benchmarks.solver_scale`` (``--only chain,llama,mamba,t5`` to pick; t5 is
not run by default).
"""

from __future__ import annotations

import argparse
import os
import random
import time

from planner.devices import profile_of_model
from planner.solvers.costgraph import Schedule
from planner.solvers.registry import get_solver
from planner.solvers.simulate import simulate
from tests.solvers.synthetic import random_chain


def _dp_line(name: str, graph, budget_bytes: float) -> str:
    start, cpu = time.perf_counter(), time.process_time()
    schedule = get_solver("dp")(graph, budget_bytes)
    solve_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    sim = simulate(graph, schedule)
    eager = simulate(graph, Schedule()).peak_bytes
    return (
        f"{name}: {len(graph.nodes)} nodes, dp in {solve_s:.1f} s wall, {cpu_s:.1f} s CPU "
        f"({schedule.solver}, load average {os.getloadavg()[0]:.1f}), "
        f"predicted peak {sim.peak_bytes / eager:.1%} of eager (budget "
        f"{budget_bytes / eager:.0%}), recompute {sim.recompute_time_s / _step_time(graph):.1%}"
        f" of the step; {len(schedule.regions)} regions; note: {schedule.note}"
    )


def _step_time(graph) -> float:
    n = len(graph.nodes)
    return sum(graph.node_time_s(i) + graph.node_time_s(i, backward=True) for i in range(n))


def chain() -> str:
    graph = random_chain(random.Random(0), 10_000)
    eager = simulate(graph, Schedule()).peak_bytes
    return _dp_line("random chain", graph, 0.6 * eager)


def llama() -> str:
    from benchmarks.plan_7b import LlamaConfig, llama_example
    from planner.passes.capture import capture
    from planner.passes.estimate import estimate

    model, example = llama_example(LlamaConfig())
    start = time.perf_counter()
    captured = capture(model, example)
    graph = estimate(
        captured.module, captured.args, captured.kwargs, rates=profile_of_model(captured.module)
    )
    prep_s = time.perf_counter() - start
    return f"(capture + estimate {prep_s:.1f} s) " + _dp_line("Llama-7B shape", graph, 24e9)


def mamba(seq_len: int = 128) -> str:
    """The tiny HF Mamba planned with auto, phase by phase (``benchmarks.plan_speed``)."""
    from benchmarks.plan_speed import plan_speed

    return plan_speed(seq_len)


def t5() -> str:
    """T5 in place at the conformance sweep's budgets, both objectives: a line per solve."""
    import resource

    from benchmarks.conformance import BATCH, PROFILE, budgets
    from benchmarks.conformance_models import ZOO
    from planner.devices import device_profile
    from planner.inplace_form import price_inplace
    from planner.solvers.errors import InfeasibleBudgetError
    from planner.solvers.registry import solve

    model, example = ZOO["t5"](BATCH)
    graph = price_inplace(model, example, device=device_profile(PROFILE)).graph
    eager = simulate(graph, Schedule()).peak_bytes
    try:
        solve(graph, 1, "auto")
        raise AssertionError("a 1-byte budget was met")
    except InfeasibleBudgetError as e:
        least = e.min_bytes
    if least is None:
        return "T5 in place: least unknown (solver cut short)"
    lines = [
        f"T5 in place: {len(graph.nodes)} nodes, {len(graph.region_spans or ())} spans, least "
        f"feasible {least:,} B ({least / eager:.0%} of eager), load average "
        f"{os.getloadavg()[0]:.1f}"
    ]
    for budget in budgets(least, eager, 8):
        for objective in ("time", "flops"):
            cpu = time.process_time()
            schedule = solve(graph, budget, "auto", objective)
            cpu_s = time.process_time() - cpu
            sim = simulate(graph, schedule)
            lines.append(
                f"  {budget / eager:.0%} of eager, {objective}: {cpu_s:.2f} s CPU, "
                f"{schedule.solver}, peak {sim.peak_bytes:,} B of {budget:,}, recompute "
                f"{sim.recompute_time_s * 1e3:.3f} ms, {len(schedule.regions)} regions; "
                f"{schedule.note}"
            )
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return "\n".join([*lines, f"  max RSS {rss_mb:.0f} MB"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="chain,llama,mamba")
    args = parser.parse_args()
    runs = {"chain": chain, "llama": llama, "mamba": mamba, "t5": t5}
    for name in args.only.split(","):
        print(runs[name](), flush=True)


if __name__ == "__main__":
    main()
