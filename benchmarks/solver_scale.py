"""How large a graph the solvers plan within their time limits: wall times, printed.

- a synthetic 10,000-node random chain (``tests/solvers/synthetic.py``), dp at 60% of eager;
- the Llama-7B shape (``benchmarks/plan_7b.py``, meta device), dp at 24 GB;
- Hugging Face Mamba from a tiny config (sequence 128: its slow scan unrolls into thousands of
  nodes), ``planner.plan`` with ``auto`` at 70% of the eager peak, then ``planner.measure`` of
  ``p.module`` against the budget.

Targets: dp <= 15 s on the chain and on the 7B shape; Mamba plans with auto in <= 30 s and
measures within budget. Times are wall clock and this process's CPU time, with the machine's
load average: on a shared machine the wall time is the CPU time stretched by the load.

Run: ``python -m benchmarks.solver_scale`` (``--only chain,llama,mamba`` to pick).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="chain,llama,mamba")
    args = parser.parse_args()
    for name in args.only.split(","):
        print({"chain": chain, "llama": llama, "mamba": mamba}[name](), flush=True)


if __name__ == "__main__":
    main()
